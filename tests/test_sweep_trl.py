"""``equiv sweep trl`` (issue 45): every accumulating TRL trainer, one SweepRow each, audited against its documented
full-batch objective.  The sweep targets the trainers of trl 1.16.0 (DistillationTrainer and the per-loss_type
rows are not in older releases): its tests run where that release is installed (``tox -e sweep-trl``) and skip
cleanly elsewhere; the renderer's test runs everywhere.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os
from typing import Any

import pytest

from equiv.reporting.markdown import read_markdown_table

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded: the model and tokenizer are built here

#: The trl release the sweep's trainers and findings are those of (the ``trl`` extra's pin).
SWEPT_TRL = (1, 16, 0)


def _installed_trl() -> tuple[int, ...] | None:
    if importlib.util.find_spec("trl") is None:
        return None
    return tuple(int(part) for part in importlib.metadata.version("trl").split(".")[:3] if part.isdigit())


needs_swept_trl = pytest.mark.skipif(
    _installed_trl() is None or _installed_trl() < SWEPT_TRL,  # type: ignore[operator]
    reason=f"needs trl>={'.'.join(map(str, SWEPT_TRL))} (the sweep's trainers; tox -e sweep-trl)",
)


# -- equiv sweep trl (issue 45): every accumulating trainer, one SweepRow each ---------------------------------


@functools.cache
def _sweep_row(subject: str) -> Any:
    from equiv.peers.trl_sweep import run_subject

    return run_subject(subject, {})


@needs_swept_trl
@pytest.mark.parametrize(
    "subject", ["DPOTrainer[sigmoid]", "DPOTrainer[ipo]", "KTOTrainer[apo_zero_unpaired]", "RewardTrainer"]
)
def test_per_item_trainers_average_micro_batch_means_so_the_uneven_tail_window_is_not_equivalent(subject: str) -> None:
    row = _sweep_row(subject)
    first, tail = row.audit["windows"]
    # The control: a window of equal item counts is the full-batch step (our objective is the trainer's).
    assert first["items"] == [2, 2] and first["status"] == "equivalent"
    # The epoch's last window holds 2 + 1 items: the Trainer divides each micro-batch's mean by GA=2
    # (loss_is_scaled_for_ga=False), so each micro-batch's loss sum gets 1/(2 n_i), not 1/3.
    assert tail["items"] == [2, 1] and tail["status"] == "not_equivalent"
    assert tail["weights"]["normaliser"] == "mean of means"
    assert tail["weights"]["run"] == pytest.approx([1 / 4, 1 / 2], rel=1e-3)
    assert tail["weights"]["full_batch"] == pytest.approx([1 / 3, 1 / 3])
    assert row.outcome == "not_equivalent"


@needs_swept_trl
def test_dpo_sft_loss_type_averages_token_means() -> None:
    row = _sweep_row("DPOTrainer[sft]")  # per token: micro-batches hold unequal chosen tokens in every window
    assert all(window["weights"]["normaliser"] == "mean of means" for window in row.audit["windows"])


@needs_swept_trl
def test_gkd_is_equivalent_off_policy_and_mis_normalised_on_policy() -> None:
    assert _sweep_row("GKDTrainer[lmbda=0]").outcome == "equivalent"
    on_policy = _sweep_row("GKDTrainer[lmbda=0.5]")
    failing = [window for window in on_policy.audit["windows"] if window["status"] != "equivalent"]
    # num_items_in_batch is counted on the data set's labels before the generated completions replace them
    assert failing and all(window["weights"]["normaliser"].startswith("uniform scale") for window in failing)


@needs_swept_trl
@pytest.mark.parametrize("subject", ["DistillationTrainer", "SFTTrainer[nll]", "GRPOTrainer[dapo]"])
def test_trainers_normalising_by_the_windows_items_are_equivalent(subject: str) -> None:
    row = _sweep_row(subject)
    assert row.outcome == "equivalent", row.audit
    assert len({sum(window["items"]) for window in row.audit["windows"]}) > 1 or any(
        len(set(window["items"])) > 1 for window in row.audit["windows"]
    )  # uneven item counts: the verdict could have failed


@needs_swept_trl
def test_a_loss_with_no_item_weighted_form_gets_a_reason_not_a_verdict() -> None:
    for subject in ("KTOTrainer[kto]", "DPOTrainer[aot]", "GRPOTrainer[bnpo]"):
        row = _sweep_row(subject)
        assert row.audit is None and row.outcome == "could_not_run" and row.reason


def test_sweep_subjects_are_sorted_and_unknown_ones_refused() -> None:
    pytest.importorskip("transformers")
    from equiv.peers import trl_sweep

    listed = trl_sweep.subjects({})
    assert listed == sorted(listed, key=lambda pair: (pair[1], pair[0]))
    assert {family for _, family in listed} >= {"DPO", "KTO", "Reward", "SFT", "GRPO", "GKD / distillation"}
    with pytest.raises(ValueError, match="unknown TRL sweep subject 'NoTrainer'"):
        trl_sweep.run_subject("NoTrainer", {})


def test_the_sweep_report_has_a_summary_a_row_each_and_a_reproduction_per_not() -> None:
    from equiv.peers.sweep_rows import SweepRow
    from equiv.reporting.sweeps import command_reproduction, render_sweep

    failing_window = {
        "step": 2,
        "items": [2, 1],
        "status": "not_equivalent",
        "weights": {"run": [0.25, 0.5], "full_batch": [1 / 3, 1 / 3], "normaliser": "mean of means"},
        "failure_kind": {"means": "each micro-batch's mean averaged"},
    }
    rows = [
        SweepRow("A", "X", audit={"status": "equivalent", "steps": 2, "windows": [{"status": "equivalent"}]}),
        SweepRow("B", "X", audit={"status": "not_equivalent", "steps": 2, "windows": [failing_window]}, setup={"k": 1}),
        SweepRow("C", "Y", reason="building the trainer: AssertionError: no CUDA"),
    ]
    report = render_sweep(rows, title="T", preamble=[], reproduction=command_reproduction("equiv sweep trl"))
    summary = read_markdown_table(report.split("## Summary")[1].split("##")[0])
    assert summary[-1] == {
        "family": "all",
        "subjects": "3",
        "equivalent": "1",
        "NOT equivalent": "1",
        "other verdict": "0",
        "could not run": "1",
    }
    table = read_markdown_table(report.split("## Every subject")[1].split("##")[0])
    assert [row["verdict"] for row in table] == ["equivalent", "not equivalent", "could not run"]
    assert "weights [0.25, 0.5] vs full batch [0.3333, 0.3333]: mean of means" in table[1]["what"]
    assert "no CUDA" in table[2]["what"]
    reproductions = report.split("## Reproductions (one per NOT equivalent subject)")[1]
    assert "### B" in reproductions and "### A" not in reproductions
    assert "equiv sweep trl --only 'B'" in reproductions and '"k": 1' in reproductions

"""TRL's GRPOTrainer (per loss_type) and SFTTrainer under gradient accumulation, every
optimizer step audited (equiv.peers.trl).  Needs trl (``pip install equiv[trl]``;
``tox -e peers-trl`` and ``tox -e peers-trl190`` run them) and skips with the reason without it.

What the tests pin, per installed trl: the loss types whose documented objective is a
full-batch one are equivalent under accumulation; dapo / cispo with steps_per_generation
!= gradient_accumulation_steps are not, before trl #6024 (trl <= 1.9.0: the generation
batch's token count) and after it (trl >= 1.9.1: that count × GA / steps_per_generation,
the expected window count), the kind shown by the judge itself, the scale predicted from
the token counts; #6024's published 0.5x / 2x / 4x before its rescaling and exactness after it
when every window holds the same number of tokens; bnpo is local by design."""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import json
import os
from pathlib import Path
from typing import Any

import pytest

from equiv.reporting.markdown import read_markdown_table
from equiv.reporting.trl import trl_section

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded: the model and tokenizer are built here

needs_trl = pytest.mark.skipif(
    importlib.util.find_spec("trl") is None, reason="needs trl (pip install equiv[trl]; tox -e peers-trl)"
)


def _trl_version() -> tuple[int, ...]:
    return tuple(int(part) for part in importlib.metadata.version("trl").split(".")[:3] if part.isdigit())


def _rescaled() -> bool:
    """trl #6024's rescaling (num_items_in_batch × GA / steps_per_generation) is in trl 1.9.1 and later."""
    return _trl_version() >= (1, 9, 1)


@functools.cache
def _row(loss_type: str, setting: str) -> dict[str, Any]:
    from equiv.peers import trl as peers_trl

    return peers_trl.grpo_row(loss_type, next(s for s in peers_trl.SETTINGS if s.name == setting))


def _setting(name: str) -> str:
    from equiv.peers import trl as peers_trl

    return str(getattr(peers_trl, name).name)


@needs_trl
@pytest.mark.parametrize("loss_type", ["grpo", "sapo", "luspo", "dr_grpo", "dapo", "cispo"])
def test_full_batch_loss_types_are_equivalent_under_default_accumulation(loss_type: str) -> None:
    row = _row(loss_type, _setting("DEFAULT"))
    assert row["verdict"] == "equivalent", "\n".join(row["steps"])
    assert len(row["steps"]) == 3


@needs_trl
@pytest.mark.parametrize("setting", ["SPG_ABOVE_GA", "SPG_BELOW_GA"])
def test_grpo_does_not_depend_on_steps_per_generation(setting: str) -> None:
    row = _row("grpo", _setting(setting))  # the control: its normaliser is the sequence count, not num_items_in_batch
    assert row["verdict"] == "equivalent", "\n".join(row["steps"])


@needs_trl
@pytest.mark.parametrize("loss_type", ["dapo", "cispo"])
@pytest.mark.parametrize("setting", ["SPG_ABOVE_GA", "SPG_BELOW_GA", "SPG_WITHOUT_GA"])
def test_token_normalised_losses_are_mis_normalised_when_a_generation_batch_is_not_the_window(
    loss_type: str, setting: str
) -> None:
    row = _row(loss_type, _setting(setting))
    assert row["verdict"] == "NOT equivalent", "\n".join(row["steps"])
    # The kind is the one hypothesis under which the judge finds every step equivalent, the other one flagged.
    expected = "generation batch tokens x GA/spg" if _rescaled() else "generation batch tokens"
    assert row["explained_by"] == [expected]
    assert "6024" in row["upstream"]


@needs_trl
@pytest.mark.parametrize(
    ("setting", "scale"), [("SPG_ABOVE_GA_EQUAL", 0.5), ("SPG_BELOW_GA_EQUAL", 2.0), ("LITE_PPO_EQUAL", 4.0)]
)
def test_6024s_published_scales_before_its_rescaling_and_exact_after_when_windows_hold_equal_tokens(
    setting: str, scale: float
) -> None:
    # trl #6024: GA / steps_per_generation = 2 / 4 gives 0.5x, 32 / 8 gives 4x; every completion max length here.
    row = _row("dapo", _setting(setting))
    if _rescaled():
        assert row["verdict"] == "equivalent", "\n".join(row["steps"])
        assert "exact here" in row["upstream"]
        return
    assert row["verdict"] == "NOT equivalent", "\n".join(row["steps"])
    assert row["explained_by"] == ["generation batch tokens"]
    assert row["update_ratios"] == pytest.approx([scale] * len(row["steps"]), rel=1e-4)


@needs_trl
def test_the_dapo_update_scale_is_the_window_over_the_normaliser_tokens() -> None:
    from equiv.peers import trl as peers_trl

    setting = peers_trl.SPG_ABOVE_GA  # a generation batch of 4 micro-batches, windows of 2: steps (0, 1), (2, 3)
    windows = peers_trl.grpo_run("dapo", setting, hypotheses=())["documented"].windows
    tokens = [sum(window.items) for window in windows]
    for step, window in enumerate(windows):
        generation = tokens[step - step % 2] + tokens[step - step % 2 + 1]
        normaliser = (
            generation * setting.gradient_accumulation_steps / setting.generation_steps if _rescaled() else generation
        )
        row = next(row for row in window.mismatches if row.quantity == "update")
        # SGD without clipping: the update is the gradient's scale, tokens / normaliser, up to float32 rounding.
        assert row.update_ratio == pytest.approx(tokens[step] / normaliser, rel=1e-4), window.line()
        assert row.cosine == pytest.approx(1.0, abs=1e-4)


@needs_trl
@pytest.mark.parametrize("setting", ["DEFAULT", "SPG_BELOW_GA"])
def test_bnpo_is_local_by_design_and_its_normaliser_is_confirmed(setting: str) -> None:
    row = _row("bnpo", _setting(setting))
    assert row["verdict"] == "by design not full-batch"
    # Against the window's token mean it is flagged (the micro-batches hold different token counts) ...
    assert row["measured_against_window"] == "NOT equivalent", "\n".join(row["steps"])
    # ... and the local-batch normaliser explains every step.
    assert row["explained_by"] == ["local tokens"]


@needs_trl
@pytest.mark.parametrize("loss_type", ["nll", "dft"])
def test_sft_trainer_normalises_by_the_windows_tokens(loss_type: str) -> None:
    from equiv.peers import trl as peers_trl

    audited = peers_trl.sft_run(loss_type)
    assert len(audited.windows) == 3 and audited, audited.summary()
    assert len({sum(window.items) for window in audited.windows}) > 1 or any(
        len(set(window.items)) > 1 for window in audited.windows
    )  # unequal token counts: the test can fail


def test_the_section_renders_saved_rows_and_says_when_there_are_none(tmp_path: Path) -> None:
    rows = [
        {
            "trainer": "GRPOTrainer",
            "loss_type": "dapo",
            "setting": "GA=2, steps_per_generation=4",
            "verdict": "NOT equivalent",
            "kind": "normaliser is the generation batch's token count",
            "magnitude": "update 0.41x to 0.59x the full-batch one",
            "upstream": "trl #6024",
            "versions": {"trl": "1.9.0", "torch": "2.13.0"},
        }
    ]
    saved = tmp_path / "peers-trl.json"
    saved.write_text(json.dumps(rows))
    section = trl_section(saved)
    assert section.startswith("## TRL")
    glance = read_markdown_table(section)  # first: one line per trainer, loss type and release
    assert glance == [
        {
            "trainer, loss type (release)": "GRPOTrainer dapo (trl 1.9.0)",
            "GA=2, steps_per_generation=4": "✗ (generation-batch tokens)",
        }
    ]
    table = read_markdown_table([part for part in section.split("\n\n") if part.startswith("|")][1])
    assert table == [
        {
            "trainer": "GRPOTrainer",
            "loss_type": "dapo",
            "setting": "GA=2, steps_per_generation=4",
            "trl": "1.9.0",
            "verdict": "NOT equivalent",
            "kind": "normaliser is the generation batch's token count",
            "magnitude": "update 0.41x to 0.59x the full-batch one",
            "upstream issue": "trl #6024",
        }
    ]
    assert "torch 2.13.0, trl 1.9.0" in section
    assert "Not measured" in trl_section(tmp_path / "absent.json")


@needs_trl
def test_bnpo_without_accumulation_is_judged_as_measured() -> None:
    row = _row("bnpo", _setting("SPG_WITHOUT_GA"))  # GA = 1: the local batch is the window
    assert row["verdict"] == "equivalent", "\n".join(row["steps"])


def test_the_glance_names_each_kind_short_and_tells_the_rescaled_normaliser_apart() -> None:
    from equiv.reporting.trl import trl_glance

    kinds = {
        "1.9.0": "normaliser is the generation batch's token count (num_items_in_batch spans ...)",
        "1.16.0": "normaliser is the generation batch's token count × GA / steps_per_generation (...)",
    }
    rows = [
        {
            "trainer": "GRPOTrainer",
            "loss_type": "dapo",
            "setting": "GA=2, spg=4",
            "verdict": "NOT equivalent",
            "kind": kind,
            "versions": {"trl": release},
        }
        for release, kind in kinds.items()
    ]
    rows.append(
        {
            "trainer": "GRPOTrainer",
            "loss_type": "bnpo",
            "setting": "GA=2, spg=4",
            "verdict": "by design not full-batch",
            "kind": "not a full-batch objective by design; ...",
            "versions": {"trl": "1.16.0"},
        }
    )
    rows.append(
        {
            "trainer": "GRPOTrainer",
            "loss_type": "grpo",
            "setting": "GA=2, spg=4",
            "verdict": "equivalent",
            "kind": "",
            "versions": {"trl": "1.16.0"},
        }
    )
    assert [row["GA=2, spg=4"] for row in read_markdown_table(trl_glance(rows))] == [
        "✗ (generation-batch tokens)",
        "✗ (expected window tokens)",
        "by design",
        "✓",
    ]


def test_the_torchtune_section_renders_saved_rows_and_says_when_there_are_none(tmp_path: Path) -> None:
    from equiv.reporting.trl import torchtune_section

    rows = [
        {
            "setting": "GA=2, text completion",
            "verdict": "NOT equivalent",
            "kind": "counts before the shift",
            "magnitude": "update 0.99-1.007x",
            "upstream": "torchtune #2613",
            "versions": {"torchtune": "0.6.1"},
        }
    ]
    saved = tmp_path / "peers-torchtune.json"
    saved.write_text(json.dumps(rows))
    section = torchtune_section(saved)
    assert read_markdown_table(section) == [
        {
            "setting": "GA=2, text completion",
            "verdict": "NOT equivalent",
            "kind": "counts before the shift",
            "magnitude": "update 0.99-1.007x",
            "upstream": "torchtune #2613",
        }
    ]
    assert "torchtune 0.6.1" in section
    assert "Not measured" in torchtune_section(tmp_path / "absent.json")

"""A sweep's row (issue 45): an audit's result or a reason, never both, never neither; JSON round trip."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from equiv.outcomes import Outcome
from equiv.peers.sweep_rows import COULD_NOT_RUN, SweepRow


def test_a_row_holds_an_audit_or_a_reason_and_says_its_outcome() -> None:
    ran = SweepRow("GPT2ForTokenClassification", "token classification", audit={"status": "not_equivalent"})
    failed = SweepRow("XForCausalLM", "causal LM", reason="the config class needs a vision sub-config")
    assert (ran.outcome, ran.status) == ("not_equivalent", Outcome.NOT_EQUIVALENT)
    assert (failed.outcome, failed.status) == (COULD_NOT_RUN, None)
    for row in (ran, failed):
        assert SweepRow.from_dict(row.to_dict()) == row
        assert pickle.loads(pickle.dumps(row)) == row


@pytest.mark.parametrize("audit, reason", [(None, ""), ({"status": "equivalent"}, "and a reason")])
def test_neither_or_both_is_refused_by_name(audit: dict[str, str] | None, reason: str) -> None:
    with pytest.raises(ValueError, match=r"either an audit or a reason.*'Subject'"):
        SweepRow("Subject", "family", audit=audit, reason=reason)


def test_a_row_keeps_the_first_mismatch_of_each_window_and_their_count() -> None:
    audit = {"status": "not_equivalent", "windows": [{"step": 0, "mismatches": [{"name": "a"}, {"name": "b"}]}]}
    row = SweepRow("S", "family", audit=audit)
    assert row.audit is not None
    (window,) = row.audit["windows"]
    assert (window["mismatches"], window["mismatched"]) == ([{"name": "a"}], 2)
    assert SweepRow.from_dict(row.to_dict()) == row  # kept the same when read back
    assert len(audit["windows"][0]["mismatches"]) == 2  # the audit's own dict is not changed


def test_saved_rows_render_again_with_their_own_version_without_the_library(tmp_path: Path) -> None:
    from equiv.cli import main
    from equiv.reporting.sweeps import rows_json

    rows = [SweepRow("DPOTrainer[sigmoid]", "DPO", audit={"status": "equivalent", "steps": 1, "windows": []})]
    saved = tmp_path / "rows.json"
    saved.write_text(rows_json(rows, library="trl", version="0.0.1", preamble="Measured with trl 0.0.1."))
    out = tmp_path / "report.md"
    assert main(["sweep", "trl", "--rows", str(saved), "--out", str(out)]) == 0
    report = out.read_text()
    assert report.startswith("# TRL 0.0.1:") and "Measured with trl 0.0.1." in report
    assert "`DPOTrainer[sigmoid]`" in report or "DPOTrainer[sigmoid]" in report

"""A sweep's row (issue 45): an audit's result or a reason, never both, never neither; JSON round trip."""

from __future__ import annotations

import pickle

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

"""Verdicts pinned before the comparison was made streaming: the same numbers, the same messages.

tests/data/pinned_verdicts.json holds, for the reference and each bug of the zoo on
the (then) standard cases, the verdict's status, worst ratio per tier, and a hash of
every mismatch and worst tensor (step, name, tier, greatest differences, index,
allowance and its explanation), made by the code that kept whole trajectories.  Any
change to how a check computes its numbers shows here.  Regenerate only for a
deliberate change of the numbers: ``python tests/test_pinned_verdicts.py``.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

import equiv
from equiv.zoo.bugs import BUGS

PINNED = Path(__file__).parent / "data" / "pinned_verdicts.json"
CANDIDATES = {"accumulator_step": equiv.accumulator_step, **BUGS}


def fingerprint(verdict: equiv.Verdict) -> dict[str, Any]:
    numbers = {key: value for key, value in verdict.to_dict().items() if key in ("status", "mismatches", "worst")}
    return {
        "status": verdict.status,
        "worst_ratio": {tier: diff.ratio for tier, diff in sorted(verdict.worst.items())},
        "mismatches": len(verdict.mismatches),
        "sha256": hashlib.sha256(json.dumps(numbers, sort_keys=True).encode()).hexdigest(),
        "message_sha256": hashlib.sha256(verdict.message().encode()).hexdigest(),
    }


def _rows() -> list[dict[str, Any]]:
    return list(json.loads(PINNED.read_text())) if PINNED.is_file() else []


@pytest.mark.parametrize("row", _rows(), ids=lambda row: f"{row['candidate']}-{row['case_name']}")
def test_verdict_is_the_pinned_one(row: dict[str, Any]) -> None:
    verdict = equiv.check(CANDIDATES[row["candidate"]], equiv.Case.from_dict(row["case"]))
    got = fingerprint(verdict)
    expected = {key: row[key] for key in got}
    assert got == expected, verdict.message()


def test_the_pin_covers_the_reference_and_every_pinned_bug() -> None:
    rows = _rows()
    assert len(rows) >= 100, f"{PINNED} is missing or short"
    assert {row["candidate"] for row in rows} <= set(CANDIDATES)
    assert "accumulator_step" in {row["candidate"] for row in rows}


if __name__ == "__main__":
    from equiv.cases.standard import STANDARD_CASES

    # Cases as the test rebuilds them (through JSON), so the messages' reproduction lines agree.
    cases = {name: equiv.Case.from_dict(json.loads(json.dumps(case.to_dict(), sort_keys=True)))
             for name, case in STANDARD_CASES.items()}
    rows = [
        {"case_name": case_name, "candidate": name, "case": case.to_dict(), **fingerprint(equiv.check(candidate, case))}
        for case_name, case in cases.items()
        for name, candidate in CANDIDATES.items()
    ]
    PINNED.write_text(json.dumps(rows, indent=1, sort_keys=True) + "\n")
    print(f"wrote {len(rows)} verdicts to {PINNED}")

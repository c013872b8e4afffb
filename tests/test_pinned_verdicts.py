"""Verdicts pinned as facts that hold on every machine.

tests/data/pinned_verdicts.json holds, for the reference and each bug of the
zoo on the standard cases, the verdict's :class:`equiv.results.facts.VerdictFacts`: status
and class, per tier within or past the allowance, and for a failing verdict
its first divergence (step, tier, tensor, relative error as an order of
magnitude).  Not the digits of a ratio and not a hash of the message: those
are rounding noise that moves with the CPU's vector kernels (AVX2, AVX-512,
none, arm64) and the thread count (equiv.results.facts).  tests/
test_portability.py recomputes these pins under other kernels; the bit-exact
regression check of the numbers is tests/test_comparison_oracle.py, in one
process.  Regenerate for a deliberate change of a verdict:
``python tests/test_pinned_verdicts.py``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import equiv
from equiv.results.facts import VerdictFacts
from equiv.zoo.bugs import BUGS

PINNED = Path(__file__).parent / "data" / "pinned_verdicts.json"
CANDIDATES = {"accumulator_step": equiv.accumulator_step, **BUGS}


def pinned_rows() -> list[dict[str, Any]]:
    return list(json.loads(PINNED.read_text())) if PINNED.is_file() else []


def facts_of(row: dict[str, Any]) -> dict[str, Any]:
    """The facts of the pinned row's verdict, recomputed here."""
    verdict = equiv.check(CANDIDATES[row["candidate"]], equiv.Case.from_dict(row["case"]))
    return VerdictFacts.of(verdict).to_dict()


@pytest.mark.parametrize("row", pinned_rows(), ids=lambda row: f"{row['candidate']}-{row['case_name']}")
def test_verdict_facts_are_the_pinned_ones(row: dict[str, Any]) -> None:
    assert facts_of(row) == row["facts"]


def test_the_pin_covers_the_reference_and_every_bug_on_every_standard_case() -> None:
    from equiv.cases.standard import STANDARD_CASES

    rows = pinned_rows()
    assert {(row["case_name"], row["candidate"]) for row in rows} == {
        (case, candidate) for case in STANDARD_CASES for candidate in CANDIDATES
    }, f"{PINNED} is out of date: regenerate it with python tests/test_pinned_verdicts.py"
    kinds = {row["facts"]["kind"] for row in rows}
    assert {"equivalent", "not_equivalent", "not_applicable"} <= kinds
    # Every bug is caught somewhere, the reference nowhere.
    failing = {row["candidate"] for row in rows if row["facts"]["status"] == "not_equivalent"}
    assert failing == set(BUGS)


def test_the_pin_records_no_digits_of_noise() -> None:
    for row in pinned_rows():
        assert set(row["facts"]) == {"status", "kind", "tiers", "first_divergence", "precision"}
        assert set(row["facts"]["tiers"].values()) <= {"≤ 1", "> 1"}
        assert row["facts"]["precision"] in (None, "default_dtype", "float32_sized", "bfloat16_arithmetic")
        first = row["facts"]["first_divergence"]
        # A divergence is recorded for a failure, and for a pass with a precision note (where it is).
        assert (first is None) == (row["facts"]["status"] != "not_equivalent" and row["facts"]["precision"] is None)
        if first is not None:
            assert first["relative_error"] in ("0", "inf") or first["relative_error"].startswith("~1e")


if __name__ == "__main__":
    from equiv.cases.standard import STANDARD_CASES

    # Cases as the test rebuilds them (through JSON).
    cases = {
        name: equiv.Case.from_dict(json.loads(json.dumps(case.to_dict(), sort_keys=True)))
        for name, case in STANDARD_CASES.items()
    }
    rows: list[dict[str, Any]] = [
        {"case_name": case_name, "candidate": name, "case": case.to_dict()}
        for case_name, case in cases.items()
        for name in CANDIDATES
    ]
    for row in rows:
        row["facts"] = facts_of(row)
    PINNED.write_text(json.dumps(rows, indent=1, sort_keys=True, ensure_ascii=False) + "\n")
    print(f"wrote {len(rows)} verdicts to {PINNED}")

"""Floors run only when the verdict needs them, and the verdict is the one every floor would give.

The allowance is FLOOR_FACTOR x floor + a roundoff term, so a difference within
the roundoff term passes whatever the floor.  ``equiv.check`` compares each tier
with no floor first and runs a tier's floor samples (and the candidate again)
only when a tensor is past that term.
"""

from __future__ import annotations

import pytest

import equiv
from equiv.cases.standard import STANDARD_CASES
from equiv.checking.check import ReferenceRuns
from equiv.zoo.bugs import BUGS

CASES = ["SGD momentum, uneven 1+5+10", "Adam, uneven 1+2", "SGD, active clipping 3+5",
         "Adam, token loss with padding 2+3"]


def eager(candidate: object, case: equiv.Case) -> equiv.Verdict:
    """The verdict with every tier's floors run first (how equiv.check judged before)."""
    references = ReferenceRuns.of(case)
    diffs = [d for tier in references.tiers for d in references.run_and_compare(tier, case, candidate)]  # type: ignore[arg-type]
    return references.judge(getattr(candidate, "__name__", "step"), diffs)


@pytest.mark.parametrize("case_name", CASES)
def test_a_failing_verdict_is_the_one_every_floor_gives(case_name: str) -> None:
    case = STANDARD_CASES[case_name]
    lazy, full = equiv.check(BUGS["mean_of_means"], case), eager(BUGS["mean_of_means"], case)
    assert lazy.status == full.status
    assert lazy.mismatches == full.mismatches  # every number: differences, allowances, counts, indices


@pytest.mark.parametrize("case_name", CASES)
def test_a_correct_step_within_the_roundoff_term_runs_no_floor(case_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    case = STANDARD_CASES[case_name]
    assert eager(equiv.accumulator_step, case)

    def no_floors(self: ReferenceRuns, tiers: object = None) -> ReferenceRuns:
        raise AssertionError("a floor ran for a correct step within the roundoff term")

    monkeypatch.setattr(ReferenceRuns, "with_floors", no_floors)
    assert equiv.check(equiv.accumulator_step, case)

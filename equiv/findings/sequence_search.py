"""Packed sequences, RL loss normalisers and the accumulation buffer's precision, searched for reports/equivalence.md.

- :func:`measure_packed_search` and :func:`measure_policy_search`: the reference
  accumulator on every packed (or policy) loss of
  :data:`equiv.cases.strategies.SEQUENCE_LOSS_FAMILIES`, then every step of
  :data:`equiv.zoo.sequence_bugs.PACKED_BUGS` (or ``POLICY_BUGS``) on the loss its
  report is about, each through :func:`equiv.verify` at the report's seed: what was
  found and the case it shrank to.
- :func:`measure_precision_search`: every entry of
  :data:`equiv.zoo.precision.PRECISION_SEARCH`, searched for the precision its
  user trains in.

The zoos are read whole, so an entry added there is searched and shown with no
list to keep in step.  Only facts that hold on every machine are kept (the search
is steered by pass / fail alone, at a fixed seed): the outcome, a precision
finding's cause, the shrunk case, how many cases it took, and a precision
finding's sensitivity as the part of the allowance that is a constant (the
roundoff term), never the measured floor.  :mod:`equiv.reporting.sequence_search`
renders them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import pandas as pd
import torch

from equiv.accumulator import accumulator_step
from equiv.cases.strategies import SEQUENCE_LOSS_FAMILIES
from equiv.checking.search_space import SearchSpace
from equiv.checking.verify import VerifyResult, verify
from equiv.findings.results import ZooSearchFindings
from equiv.judging.tolerances import ROUNDOFF_UNITS_PER_STEP, unit_roundoff
from equiv.outcomes import Outcome, outcome_words
from equiv.results.verdict import BFLOAT16_UNIT_ROUNDOFF
from equiv.zoo.precision import PRECISION_SEARCH, PrecisionEntry
from equiv.zoo.sequence_bugs import PACKED_BUGS, POLICY_BUGS, SEQUENCE_BUG_REPORTS

__all__ = [
    "PRECISION_SEARCH_EXAMPLES",
    "SEQUENCE_SEARCH_EXAMPLES",
    "measure_packed_search",
    "measure_policy_search",
    "measure_precision_search",
    "precision_rows",
    "sequence_rows",
]

log = logging.getLogger(__name__)

#: Cases each packed / policy search may draw (the ci profile's count).
SEQUENCE_SEARCH_EXAMPLES = 60
#: Cases each precision search may draw: enough to meet clipping, token losses and several optimizers.
PRECISION_SEARCH_EXAMPLES = 30
_NO_REPORT = "equiv's zoo, no upstream report"
#: The report's searches' seed (as :data:`equiv.findings.equivalence.SEARCH_SEED`, which imports this module).
SEARCH_SEED = 0


def _outcome(outcome: Outcome | None) -> str:
    return "nothing" if outcome is None else outcome.label


def _cause(result: VerifyResult) -> str:
    """A precision finding's cause ("bfloat16_arithmetic", ...), else ""."""
    verdict = result.verdict
    if result.outcome is not Outcome.PRECISION or verdict is None or verdict.precision is None:
        return ""
    return verdict.precision.cause


def _with_cause(outcome: Outcome | None, cause: str) -> str:
    return _outcome(outcome) + (f" ({outcome_words(cause)})" if cause else "")


def _search_row(name: str, result: VerifyResult, expected: Outcome, cause: str = "") -> dict[str, str]:
    """The columns every zoo search shows: expected, found, how soon, the shrunk case, as expected."""
    want = None if expected is Outcome.EQUIVALENT else expected
    matches = result.outcome is want and (not cause or cause == _cause(result))
    return {
        "step": f"`{name}`",
        "expected": _with_cause(want, cause),
        "found": _with_cause(result.outcome, _cause(result)),
        "cases to find": "-" if result.first_failure_at is None else str(result.first_failure_at),
        "shrunk counterexample": "-" if result.counterexample is None else f"`{result.counterexample!r}`",
        "as expected": "yes" if matches else "NO",
    }


def sequence_rows(bugs: dict[str, tuple[Callable[..., Any], str]], losses: Iterable[str]) -> pd.DataFrame:
    """The reference on each of ``losses``, then each step of ``bugs`` on its loss, searched at the report's seed.

    Args:
        bugs: name -> (step, the loss its report is about), as :data:`equiv.zoo.sequence_bugs.PACKED_BUGS`.
        losses: the losses the reference is searched on (every one must pass).

    Returns:
        One row per search: step, loss, expected, found, cases to find, the shrunk case, as expected, upstream.
    """
    searches = [("accumulator_step", accumulator_step, loss, Outcome.EQUIVALENT, "-") for loss in losses]
    searches += [
        (name, step, loss, Outcome.NOT_EQUIVALENT, SEQUENCE_BUG_REPORTS.get(name) or _NO_REPORT)
        for name, (step, loss) in bugs.items()
    ]
    rows = []
    for name, step, loss, expected, upstream in searches:
        result = verify(
            step,
            SearchSpace(losses=(loss,)),
            max_examples=SEQUENCE_SEARCH_EXAMPLES,
            seed=SEARCH_SEED,
            replay_in_fresh_process=False,
        )
        log.info("sequence search: %s on %s: %s", name, loss, result.outcome)
        row = _search_row(name, result, expected)
        rows.append({"step": row.pop("step"), "loss": f"`{loss}`", **row, "upstream": upstream})
    return pd.DataFrame(rows)


def _losses_of(family: str) -> list[str]:
    return [loss for loss, families in SEQUENCE_LOSS_FAMILIES.items() if family in families]


def measure_packed_search() -> ZooSearchFindings:
    """The reference on every packed loss and every step of ``PACKED_BUGS``, searched."""
    return ZooSearchFindings(
        table=sequence_rows(PACKED_BUGS, _losses_of("packed_lm")), examples=SEQUENCE_SEARCH_EXAMPLES, seed=SEARCH_SEED
    )


def measure_policy_search() -> ZooSearchFindings:
    """The reference on every policy loss and every step of ``POLICY_BUGS``, searched."""
    return ZooSearchFindings(
        table=sequence_rows(POLICY_BUGS, _losses_of("policy")), examples=SEQUENCE_SEARCH_EXAMPLES, seed=SEARCH_SEED
    )


def _sensitivity(result: VerifyResult) -> str:
    """Per dtype a precision finding judged, the constant part of its smallest allowance relative
    to a tensor's scale (the roundoff term at step 1: ROUNDOFF_UNITS_PER_STEP x u), and whether the
    smallest measured one lies below one bfloat16 rounding in every such dtype (three decades apart,
    so the same on every machine; the measured digits are not)."""
    precision = None if result.verdict is None else result.verdict.precision
    if precision is None or not precision.resolves:
        return "-"
    bounds = ", ".join(
        f"{ROUNDOFF_UNITS_PER_STEP * unit_roundoff(getattr(torch, dtype)):.2g} in {dtype}"
        for dtype, _ in precision.resolves
    )
    below = all(relative < BFLOAT16_UNIT_ROUNDOFF for _, relative in precision.resolves)
    return f"≥ {bounds}; below one bfloat16 rounding ({BFLOAT16_UNIT_ROUNDOFF:.2g}): {'yes' if below else 'NO'}"


def precision_rows(entries: dict[str, PrecisionEntry]) -> pd.DataFrame:
    """Every entry searched for its user's precision at the report's seed.

    Args:
        entries: name -> :class:`~equiv.zoo.precision.PrecisionEntry`.

    Returns:
        One row per entry: step, training precision, optimizers, expected, found, the case, as expected,
        the sensitivity of a bfloat16-sized finding, upstream.
    """
    rows = []
    for name, entry in entries.items():
        result = verify(
            entry.step,
            SearchSpace(item_weighted=True, optimizers=entry.optimizers),
            max_examples=PRECISION_SEARCH_EXAMPLES,
            seed=SEARCH_SEED,
            replay_in_fresh_process=False,
            train_dtype=entry.train_dtype,
        )
        log.info("precision search: %s: %s", name, result.outcome)
        row = _search_row(name, result, entry.expected, entry.cause)
        rows.append(
            {
                "step": row.pop("step"),
                "trains in": entry.train_dtype,
                "optimizers": ", ".join(entry.optimizers) or "all",
                "what": entry.what,
                **row,
                "sensitivity (smallest relative difference resolved)": _sensitivity(result),
                "upstream": entry.upstream or "-",
            }
        )
    return pd.DataFrame(rows)


def measure_precision_search() -> ZooSearchFindings:
    """Every entry of :data:`~equiv.zoo.precision.PRECISION_SEARCH` searched."""
    return ZooSearchFindings(
        table=precision_rows(PRECISION_SEARCH), examples=PRECISION_SEARCH_EXAMPLES, seed=SEARCH_SEED
    )

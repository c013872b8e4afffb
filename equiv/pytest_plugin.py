"""equiv's pytest plugin (entry point ``pytest11``: loaded by pytest wherever equiv is installed).

- registers equiv's Hypothesis profiles (``--hypothesis-profile equiv-ci``,
  ``equiv-dev``, ``equiv-thorough``: :mod:`equiv.checking.profiles`);
- parametrises a test that asks for the ``equiv_case`` fixture with the
  standard cases, one test per case, its name as id (see :mod:`equiv.testing`
  for the assertion that skips a case the step cannot take);
- records what :func:`equiv.testing.assert_equivalent` found in a test as the
  test's user properties, which ``pytest --junitxml`` writes as
  ``<property name="equiv_..." value="..."/>`` (:data:`PROPERTIES`): CI shows
  the status, the outcome, the tier and the worst ratio without parsing messages.

Disable with ``-p no:equiv``.
"""

from __future__ import annotations

import math
from collections.abc import Generator
from contextvars import ContextVar

import pytest

from equiv.cases.standard import STANDARD_CASES
from equiv.checking.profiles import register_profiles
from equiv.outcomes import Outcome
from equiv.results.verdict import Verdict

__all__ = ["FIXTURE", "PROPERTIES", "junit_properties", "record_verdict"]

#: The fixture a test asks for to run once per standard case.
FIXTURE = "equiv_case"
#: The user properties a test that asserted equivalence gets, in this order.
PROPERTIES = (
    "equiv_checks",
    "equiv_status",
    "equiv_kind",
    "equiv_failure_kind",
    "equiv_tier",
    "equiv_worst_ratio",
    "equiv_case",
)

#: The verdicts :func:`record_verdict` heard during the running test (None outside one).
_verdicts: ContextVar[list[Verdict] | None] = ContextVar("equiv_verdicts", default=None)


def record_verdict(verdict: Verdict) -> None:
    """Note ``verdict`` for the running test's properties (nothing outside a test run by this plugin).

    Args:
        verdict: what :func:`equiv.testing.assert_equivalent` got from :func:`equiv.check`.
    """
    heard = _verdicts.get()
    if heard is not None:
        heard.append(verdict)


def junit_properties(verdicts: list[Verdict]) -> list[tuple[str, object]]:
    """The properties of a test that checked ``verdicts`` (:data:`PROPERTIES`; none if it checked none).

    The verdict shown is the last that failed (under Hypothesis, the shrunk case it
    replays last), else the one closest to its allowance: ``equiv_status`` its
    status, ``equiv_kind`` its outcome (a failing precision finding told apart),
    ``equiv_failure_kind`` the kind of failure a mathematical mismatch amounts to
    (:class:`~equiv.results.verdict.FailureKind`: "mean of means", ..., "unclassified";
    with the kinds the case cannot tell apart after "/"; empty when none), ``equiv_tier`` where it diverged first (passing: the tier closest to its
    allowance), ``equiv_worst_ratio`` its greatest difference over the allowance
    (> 1 fails), ``equiv_case`` the case to paste.

    Args:
        verdicts: in the order the test checked them.

    Returns:
        (name, value) pairs for ``item.user_properties``.
    """
    if not verdicts:
        return []
    failing = [v for v in verdicts if v.status is Outcome.NOT_EQUIVALENT]
    shown = failing[-1] if failing else max(verdicts, key=_worst_ratio)
    first = shown.first_mismatch
    worst = max(shown.worst.values(), key=lambda row: row.ratio, default=None)
    tier = first.tier if first is not None else (worst.tier if worst is not None else "")
    ratio = _worst_ratio(shown)
    failure = shown.failure_kind
    failure_kind = "" if failure is None else " / ".join((failure.name, *failure.also))
    values: tuple[object, ...] = (
        len(verdicts),
        shown.status.value,
        shown.outcome.value,
        failure_kind,
        tier,
        f"{ratio:.3g}" if not math.isnan(ratio) else "",
        repr(shown.case),
    )
    return list(zip(PROPERTIES, values, strict=True))


def _worst_ratio(verdict: Verdict) -> float:
    """The greatest difference over its allowance among the verdict's rows (NaN: none judged)."""
    rows = [*verdict.worst.values(), *verdict.mismatches]
    return max((row.ratio for row in rows), default=math.nan)


def pytest_configure(config: pytest.Config) -> None:
    register_profiles()


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if FIXTURE in metafunc.fixturenames:
        metafunc.parametrize(FIXTURE, list(STANDARD_CASES.values()), ids=list(STANDARD_CASES))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, object, object]:
    token = _verdicts.set([])
    try:
        return (yield)
    finally:
        heard = _verdicts.get() or []
        _verdicts.reset(token)
        item.user_properties.extend(junit_properties(heard))

"""equiv in your own pytest suite.

Three routes, each never failing a test on a case that does not apply to the
step (a clip norm for a step that cannot clip) and never passing one silently:

- the standard cases as parametrised tests with readable ids: ask for the
  ``equiv_case`` fixture (equiv's pytest plugin parametrises it), or
  parametrise with :func:`standard_cases` yourself; a case that does not apply
  is skipped with the reason::

      def test_my_step(equiv_case):
          equiv.testing.assert_equivalent(my_step, equiv_case)

- a Hypothesis search that only draws cases the step can take, and so never
  shrinks to one it cannot (:func:`equiv.strategies.cases_for`)::

      @given(equiv.strategies.cases_for(my_step))
      def test_my_step_on_drawn_cases(case):
          equiv.testing.assert_equivalent(my_step, case)

  (with :func:`equiv.strategies.cases`, which also draws cases the step
  cannot take, those are discarded, ``hypothesis.reject()``: the property
  goes on with the others, never skipped as a whole);

- every standard case in one test: ``equiv.check(my_step).assert_ok()``.

equiv's Hypothesis profiles are shipped in the package: ``pytest
--hypothesis-profile equiv-ci`` (derandomized) or ``equiv-dev`` /
``equiv-thorough`` work in any project once equiv is installed.
"""

from __future__ import annotations

from typing import Any, NoReturn

import hypothesis
import pytest
import torch

from equiv.cases.case import Case
from equiv.cases.standard import STANDARD_CASES
from equiv.checking.check import check
from equiv.judging.contract import Candidate
from equiv.outcomes import Outcome
from equiv.pytest_plugin import record_verdict
from equiv.results.verdict import Verdict

__all__ = ["assert_equivalent", "standard_cases"]


def standard_cases() -> list[Any]:
    """The standard cases as ``pytest.param`` values, each with its name as id:
    ``@pytest.mark.parametrize("case", equiv.testing.standard_cases())``."""
    return [pytest.param(case, id=name) for name, case in STANDARD_CASES.items()]


def assert_equivalent(
    candidate: Candidate, case: Case, *, train_dtype: torch.dtype | str | None = None, strict: bool = False
) -> Verdict:
    """Check ``candidate`` on ``case`` and fail the test unless it is equivalent.

    A case that does not apply to the step, or that no accumulation can match
    (BatchNorm, dropout), is neither a pass nor a failure: the test is skipped
    with the reason, and inside a Hypothesis test (``@given``) the drawn case is
    discarded instead (``hypothesis.reject()``), so the property goes on with
    the cases that apply rather than skipping as a whole at the first one.  A mismatch raises :class:`equiv.EquivalenceError` with the whole
    verdict; a step that raises propagates as :class:`equiv.CandidateError`.
    Returns the verdict of an equivalent step.  ``train_dtype`` / ``strict``: as in
    :func:`equiv.check` (a precision note passes unless you train in float64).
    Under equiv's pytest plugin the test's JUnit XML gets the verdict's status, outcome,
    tier and worst ratio as properties (:func:`equiv.pytest_plugin.junit_properties`).
    """
    __tracebackhide__ = True
    verdict = check(candidate, case, train_dtype=train_dtype, strict=strict)
    record_verdict(verdict)  # the test's JUnit properties (equiv's pytest plugin)
    if verdict.status is Outcome.NOT_APPLICABLE:
        _set_aside("not applicable: " + "; ".join(verdict.not_applicable))
    if verdict.status is Outcome.INHERENTLY_NON_EQUIVALENT:
        _set_aside("inherently not equivalent: " + "; ".join(verdict.inherent))
    verdict.assert_ok()
    return verdict


def _set_aside(reason: str) -> NoReturn:
    """A case that says nothing about the step: the example discarded inside a
    Hypothesis test (``pytest.skip`` there would skip the whole property at the
    first such draw, hiding a bug the next draw shows), the test skipped elsewhere."""
    __tracebackhide__ = True
    if hypothesis.currently_in_test_context():
        hypothesis.event(reason)  # counted in Hypothesis's statistics (pytest --hypothesis-show-statistics)
        hypothesis.reject()
    pytest.skip(reason)

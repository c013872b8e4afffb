"""equiv inside a user's pytest suite: the plugin, equiv.testing, cases_for, check(step).

Each test runs a fresh pytest in a temporary folder outside the repository
(pytester, in a subprocess), as a user's project would, with equiv installed.
"""

from __future__ import annotations

import pytest
from hypothesis import find, given, settings
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument, NoSuchExample, Unsatisfiable

import equiv
from equiv.cases.standard import STANDARD_CASES
from equiv.results.verdict import CaseVerdicts

pytest_plugins = ["pytester"]

STEPS = '''
import equiv, equiv.testing
from hypothesis import given

def textbook(model, optimizer, micro_batches, loss_fn):
    """The textbook loop: divides each micro-batch's mean by N (mean of means)."""
    optimizer.zero_grad()
    for inputs, targets in micro_batches:
        (loss_fn(model(inputs), targets) / len(micro_batches)).backward()
    optimizer.step()

def weighted(model, optimizer, micro_batches, loss_fn):
    """Correct for sample losses, and it cannot clip (no max_grad_norm)."""
    optimizer.zero_grad()
    total = sum(len(targets) for _, targets in micro_batches)
    for inputs, targets in micro_batches:
        (loss_fn(model(inputs), targets) * len(targets) / total).backward()
    optimizer.step()
'''


@pytest.mark.slow
def test_the_given_route_finds_the_textbook_bug_and_never_shrinks_to_a_case_it_cannot_take(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(steps=STEPS)
    pytester.makepyfile(
        test_search="""
from hypothesis import given
import equiv, equiv.testing
from steps import textbook

@given(equiv.strategies.cases_for(textbook))
def test_textbook(case):
    equiv.testing.assert_equivalent(textbook, case)
"""
    )
    result = pytester.runpytest_subprocess("--hypothesis-profile", "equiv-ci", "-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    output = result.stdout.str()
    assert "EquivalenceError: Not equivalent to full-batch training" in output
    # The real bug, shrunk: two micro-batches of different sizes, no clip norm (the step cannot clip).
    assert "micro_batch_sizes=(1, 2)" in output
    falsifying = output.split("Falsifying example")[-1]
    assert "max_grad_norm=None" in falsifying and "micro_batch_sizes=(1, 2)" in falsifying
    assert "Not applicable" not in output


@pytest.mark.slow
def test_the_cases_route_discards_cases_the_step_cannot_take_and_finds_the_textbook_bug(
    pytester: pytest.Pytester,
) -> None:
    # equiv.strategies.cases() also draws clip norms the textbook loop cannot take: each
    # is discarded (not applicable), never a pytest.skip of the whole property ("1 skipped").
    pytester.makepyfile(steps=STEPS)
    pytester.makepyfile(
        test_search="""
from hypothesis import given
import equiv, equiv.testing
from steps import textbook

@given(equiv.strategies.cases())
def test_textbook(case):
    equiv.testing.assert_equivalent(textbook, case)
"""
    )
    result = pytester.runpytest_subprocess("--hypothesis-profile", "equiv-ci", "-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    output = result.stdout.str()
    assert "EquivalenceError: Not equivalent to full-batch training" in output
    assert "max_grad_norm=None" in output.split("Falsifying example")[-1]


TOY = equiv.Case(
    batch_size=8,
    micro_batch_sizes=(1, 3, 4),
    model="scalar_linear",
    data="toy_2x",
    optimizer_kwargs={"lr": 0.02},
    steps=1,
)


def test_a_case_that_does_not_apply_is_discarded_inside_given_and_skipped_outside() -> None:
    steps: dict[str, object] = {}
    exec(STEPS, steps)
    weighted = steps["weighted"]
    clipped = TOY.replace(max_grad_norm=1.0)  # weighted takes no max_grad_norm: not applicable

    @given(st.just(clipped))
    @settings(max_examples=5, database=None)
    def property_(case: equiv.Case) -> None:
        equiv.testing.assert_equivalent(weighted, case)  # type: ignore[arg-type]

    # Every draw discarded (hypothesis.reject), none skipping the property: nothing left to satisfy it.
    with pytest.raises(Unsatisfiable):
        property_()
    with pytest.raises(pytest.skip.Exception, match="not applicable: weighted takes no max_grad_norm"):
        equiv.testing.assert_equivalent(weighted, clipped)  # type: ignore[arg-type]


def test_verify_and_the_given_route_shrink_the_textbook_bug_to_the_same_split() -> None:
    # In this process, not through pytester (whose module snapshot would make torch register its ops twice).
    steps: dict[str, object] = {}
    exec(STEPS, steps)
    result = equiv.verify(steps["textbook"], profile="ci", replay_in_fresh_process=False)  # type: ignore[arg-type]
    assert result.counterexample is not None and result.counterexample.micro_batch_sizes == (1, 2)
    assert result.counterexample.max_grad_norm is None


def test_the_equiv_case_fixture_runs_every_standard_case_and_skips_those_that_do_not_apply(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(steps=STEPS)
    pytester.makepyfile(
        test_standard="""
import equiv.testing
from steps import weighted

def test_weighted(equiv_case):
    equiv.testing.assert_equivalent(weighted, equiv_case)
"""
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rs", "-v")
    not_applicable = [
        name
        for name, case in STANDARD_CASES.items()
        if case.max_grad_norm is not None or case.scheduler is not None or case.loss_scale is not None
    ]
    # Token-loss cases fail the sample-weighted step: they are the bug it has.
    token = [name for name, case in STANDARD_CASES.items() if case.loss == "token_cross_entropy"]
    outcomes = result.parseoutcomes()
    assert outcomes.get("skipped") == len(not_applicable)
    assert outcomes.get("failed", 0) == len(set(token) - set(not_applicable))
    assert outcomes.get("passed") == len(STANDARD_CASES) - len(not_applicable) - outcomes.get("failed", 0)
    output = result.stdout.str()
    assert "SKIPPED" in output and "not applicable: weighted takes no max_grad_norm" in output
    assert "test_weighted[toy 2.04, uneven 1+3+4] PASSED" in output


def test_the_profiles_ship_in_the_package_and_work_from_any_folder(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_profile="""
from hypothesis import settings

def test_loaded():
    assert settings.default.derandomize and settings.default.max_examples == 60
"""
    )
    pytester.runpytest_subprocess("--hypothesis-profile", "equiv-ci", "-p", "no:cacheprovider").assert_outcomes(
        passed=1
    )


def test_check_without_a_case_runs_the_standard_cases() -> None:
    from equiv.zoo.bugs import BUGS

    verdicts = equiv.check(BUGS["mean_of_means"])
    assert isinstance(verdicts, CaseVerdicts)
    assert list(verdicts.order) == list(STANDARD_CASES)
    assert not verdicts and "toy 2.04, uneven 1+3+4" in verdicts.failed
    assert verdicts.counts()["not applicable"] > 0
    with pytest.raises(equiv.EquivalenceError, match=r"FAIL  toy 2\.04, uneven 1"):
        verdicts.assert_ok()
    assert verdicts.summary().endswith(f"of {len(STANDARD_CASES)} case(s)")


def test_cases_for_refuses_a_clip_mode_the_step_cannot_take() -> None:
    def no_clip(model, optimizer, micro_batches, loss_fn):  # type: ignore[no-untyped-def]
        pass

    with pytest.raises(InvalidArgument, match=r"clipping must be \('none',\) for .*no_clip.*takes no max_grad_norm"):
        equiv.strategies.cases_for(no_clip, clipping=("active",))
    with pytest.raises(InvalidArgument, match="takes no scheduler"):
        equiv.strategies.cases_for(no_clip, schedulers=("StepLR",))
    with pytest.raises(InvalidArgument, match=r"loss_scaling must be \('none',\) for .*takes no grad_scaler"):
        equiv.strategies.cases_for(no_clip, loss_scaling=("overflow",))


@pytest.mark.slow
def test_cases_for_draws_loss_scales_and_overflows_only_for_a_step_that_takes_a_grad_scaler() -> None:
    def scaled(model, optimizer, micro_batches, loss_fn, *, grad_scaler=None):  # type: ignore[no-untyped-def]
        pass

    def plain(model, optimizer, micro_batches, loss_fn):  # type: ignore[no-untyped-def]
        pass

    overflowing = find(equiv.strategies.cases_for(scaled), lambda c: c.overflow_at is not None)
    assert overflowing.loss_scale is not None
    assert find(equiv.strategies.cases_for(scaled), lambda c: True).loss_scale is None  # what a search shrinks to
    with pytest.raises(NoSuchExample):
        find(equiv.strategies.cases_for(plain), lambda c: c.loss_scale is not None, settings=settings(max_examples=200))


def test_a_keyword_the_step_requires_is_always_drawn_and_a_case_without_it_does_not_apply() -> None:
    def needs_a_scaler(model, optimizer, micro_batches, loss_fn, *, grad_scaler):  # type: ignore[no-untyped-def]
        raise AssertionError("never called on a case without a loss scale")

    drawn = find(equiv.strategies.cases_for(needs_a_scaler), lambda case: True)
    assert drawn.loss_scale is not None
    verdict = equiv.check(needs_a_scaler, equiv.Case(batch_size=2, micro_batch_sizes=(1, 1)))
    assert verdict.status == "not_applicable"
    assert "requires grad_scaler (no default), and the case sets no loss_scale" in verdict.message()

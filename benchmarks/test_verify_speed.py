"""How many cases ``equiv verify`` checks per second, on a correct step and on a
buggy one, at a fixed seed: as shipped, and as a check ran before its floors
were made lazy (every floor sample run for every check, every failing row
detailed, nothing kept between checks), side by side in one run.

The two modes must reach the same verdict on the same cases (asserted: a
faster search that finds something else measures nothing).  Target (issue "a
check that costs little more than the runs it needs"): at least 2x the cases
per second on a correct step.  Reported, not asserted.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

import equiv
import equiv.checking.check as check_module
import equiv.checking.verify as verify_module
from equiv.checking.verify import VerifyResult
from equiv.judging.judge import ReferenceRuns, clear_reference_cache
from equiv.reporting.benchmarks import VERIFY_MODES as MODES
from equiv.zoo.bugs import BUGS

CANDIDATES: dict[str, Callable[..., Any]] = {"passing": equiv.accumulator_step, "failing": BUGS["mean_of_means"]}
SEED = 0


@contextmanager
def _as_before_lazy_floors() -> Iterator[None]:
    """Each check runs all its floor samples first, details every failing row and
    keeps no truth for the next (the comparison itself stays today's)."""
    originals = (check_module._natural_overflow_possible, check_module.reference_runs, verify_module.check)

    def detailed_check(*args: Any, **kwargs: Any) -> Any:
        return originals[2](*args, **{**kwargs, "details": True})

    check_module._natural_overflow_possible = lambda case: True  # type: ignore[assignment]
    check_module.reference_runs = ReferenceRuns.truth_of  # type: ignore[assignment]
    verify_module.check = detailed_check  # type: ignore[assignment]
    try:
        yield
    finally:
        (
            check_module._natural_overflow_possible,
            check_module.reference_runs,  # type: ignore[assignment]
            verify_module.check,
        ) = originals


def _search(step: Callable[..., Any], mode: str, max_examples: int) -> VerifyResult:
    clear_reference_cache()
    if mode == MODES[0]:
        return equiv.verify(step, max_examples=max_examples, seed=SEED, replay_in_fresh_process=False)
    with _as_before_lazy_floors():
        return equiv.verify(step, max_examples=max_examples, seed=SEED, replay_in_fresh_process=False)


@pytest.mark.parametrize("verdict_kind", list(CANDIDATES))
def test_verify_speed(benchmark: Any, bench_settings: Any, verdict_kind: str) -> None:
    if bench_settings.device.type != "cpu":
        pytest.skip("verify searches CPU cases by default")
    step = CANDIDATES[verdict_kind]
    max_examples = 200
    rounds = 1 if bench_settings.quick else 3
    seconds: dict[str, list[float]] = {mode: [] for mode in MODES}
    results: dict[str, VerifyResult] = {}

    def both_modes() -> None:
        # Alternately in every round: side by side, same load.
        for mode in MODES:
            start = time.perf_counter()
            results[mode] = _search(step, mode, max_examples)
            seconds[mode].append(time.perf_counter() - start)

    benchmark.pedantic(both_modes, rounds=rounds, iterations=1, warmup_rounds=0)
    shipped, eager = results[MODES[0]], results[MODES[1]]
    assert shipped.found == (verdict_kind == "failing"), shipped
    # Same search, same verdict: the faster mode must not have found something else.
    assert (shipped.found, shipped.examples, shipped.first_failure_at) == (
        eager.found,
        eager.examples,
        eager.first_failure_at,
    )
    assert shipped.counterexample == eager.counterexample
    median = {mode: statistics.median(values) for mode, values in seconds.items()}
    benchmark.extra_info.update(
        bench_settings.extra_info(),
        verify_speed=True,
        verdict=verdict_kind,
        candidate=getattr(step, "__name__", "step"),
        seed=SEED,
        max_examples=max_examples,
        examples=shipped.examples,
        found=shipped.found,
        seconds={mode: median[mode] for mode in MODES},
        cases_per_second={mode: shipped.examples / median[mode] for mode in MODES},
        speedup=median[MODES[1]] / median[MODES[0]],
    )

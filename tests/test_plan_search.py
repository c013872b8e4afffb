"""The planning algorithm (equiv.cost.planner.search_plan) on synthetic memory and time curves.

No model runs here: the measurement is a function of the micro-batch size, so
each test knows the right answer and every probe the search made.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from equiv.cost.costmodel import MicroStepPoint
from equiv.cost.memory import StepMemory
from equiv.cost.planner import Measurements, NothingFitsError, Probe, search_plan
from equiv.cost.steps import StepMeasurement

KIB = 2**10
BATCH = 64
#: Time of one micro-step: a fixed cost plus a per-sample cost (seconds).
T_FIXED, T_SAMPLE, T_UPDATE = 1e-3, 1e-5, 2e-3


class Curves:
    """Peak bytes and seconds as functions of the micro-batch size m; records every measurement."""

    def __init__(
        self,
        forward_backward: Callable[[int], int],
        optimizer_step: int = 100 * KIB,
        whole_step_seconds: Callable[[int], float] | None = None,
    ) -> None:
        self.forward_backward = forward_backward
        self.optimizer_step = optimizer_step
        #: A whole step's time as a function of N; by default what the probes' line predicts.
        self.whole_step_seconds = whole_step_seconds or (lambda n: n * T_FIXED + BATCH * T_SAMPLE + T_UPDATE)
        self.probed: list[int] = []
        self.whole_steps: list[int] = []

    def memory(self, m: int) -> StepMemory:
        return StepMemory(
            device="cpu",
            method="synthetic",
            baseline_bytes=0,
            forward_backward_peak_bytes=self.forward_backward(m),
            optimizer_step_peak_bytes=self.optimizer_step,
        )

    def probe(self, m: int, window: int) -> Probe:
        self.probed.append(m)
        return Probe(
            self.memory(m),
            MicroStepPoint(micro_batch_size=m, micro_step_seconds=T_FIXED + m * T_SAMPLE, update_seconds=T_UPDATE),
            window,
        )

    def whole_step(self, n: int) -> StepMeasurement:
        self.whole_steps.append(n)
        m = -(-BATCH // n)
        return StepMeasurement(
            n_micro_batches=n, micro_batch_size=m, memory=self.memory(m), step_seconds=[self.whole_step_seconds(n)]
        )

    def measurements(self) -> Measurements:
        return Measurements(probe=self.probe, whole_step=self.whole_step)


def linear(static: int, per_sample: int) -> Callable[[int], int]:
    return lambda m: static + per_sample * m


def test_linear_memory_recommends_the_fewest_micro_batches_that_fit() -> None:
    curves = Curves(linear(200 * KIB, 10 * KIB))
    # 200 + 10 m <= 400 KiB  <=>  m <= 20: micro-batch 16 (N=4) fits, 32 (N=2) does not.
    result = search_plan(curves.measurements(), global_batch_size=BATCH, memory_budget_bytes=400 * KIB)
    assert result.recommended_n == 4
    # Smallest first, then the largest predicted to fit: never a size over budget.
    assert curves.probed[:3] == [1, 2, 16]
    assert all(curves.forward_backward(m) <= 400 * KIB for m in curves.probed)
    # The pick, then its slower neighbour that fits (N=2 does not): the walk stops there.
    assert curves.whole_steps == [4, 8]
    assert [row.n_micro_batches for row in result.rows if row.fits] == [4, 8, 16, 32, 64]


def test_whole_steps_overrule_a_time_line_that_misranks_neighbouring_n() -> None:
    # The probes' line says N=1 is fastest; whole steps are fastest at N=4 (say the
    # micro-batch of 16 fits a cache the larger ones do not).  Everything fits.
    def u_shaped(n: int) -> float:
        return 0.010 + 0.002 * abs(n - 4)

    curves = Curves(linear(200 * KIB, 10 * KIB), whole_step_seconds=u_shaped)
    result = search_plan(curves.measurements(), global_batch_size=BATCH, memory_budget_bytes=10_000 * KIB)
    assert result.recommended_n == 4
    # From the line's pick, one neighbour at a time towards the faster side, until both sides are slower.
    assert curves.whole_steps == [1, 2, 4, 8]
    measured = {row.n_micro_batches: row.measured_samples_per_s for row in result.rows}
    assert measured[4] == max(v for v in measured.values() if v is not None)


def test_the_walk_never_measures_a_step_predicted_over_budget() -> None:
    # Faster with fewer micro-batches without end, but N=2 (m=32, 520 KiB) is over the budget.
    curves = Curves(linear(200 * KIB, 10 * KIB), whole_step_seconds=lambda n: 0.001 * n)
    result = search_plan(curves.measurements(), global_batch_size=BATCH, memory_budget_bytes=400 * KIB)
    assert result.recommended_n == 4
    assert 2 not in curves.whole_steps and 1 not in curves.whole_steps


def test_a_size_inside_the_safety_margin_is_probed_not_guessed() -> None:
    # 200 + 10 m KiB: micro-batch 16 (N=4) peaks at 360 KiB, 1 KiB under the budget,
    # inside the 5% margin a prediction must keep.  A probe measures it exactly.
    curves = Curves(linear(200 * KIB, 10 * KIB))
    result = search_plan(curves.measurements(), global_batch_size=BATCH, memory_budget_bytes=361 * KIB)
    assert curves.probed == [1, 2, 8, 16]
    assert all(curves.forward_backward(m) <= 361 * KIB for m in curves.probed)
    assert result.recommended_n == 4
    assert next(row for row in result.rows if row.n_micro_batches == 4).probed_peak_bytes == 360 * KIB


def test_more_budget_means_fewer_micro_batches() -> None:
    picks = []
    for budget_kib in (300, 400, 600, 900):
        curves = Curves(linear(200 * KIB, 10 * KIB))
        picks.append(
            search_plan(
                curves.measurements(), global_batch_size=BATCH, memory_budget_bytes=budget_kib * KIB
            ).recommended_n
        )
    assert picks == [8, 4, 2, 1]


def test_a_curve_that_bends_up_rules_out_what_a_probe_measured_over_budget() -> None:
    # Linear on small micro-batches, then steeply up: the line through the two
    # smallest probes predicts micro-batch 32 fits; its probe measures it over.
    def bends(m: int) -> int:
        return 200 * KIB + 10 * KIB * m + (0 if m <= 16 else 40 * KIB * (m - 16))

    curves = Curves(bends)
    result = search_plan(curves.measurements(), global_batch_size=BATCH, memory_budget_bytes=560 * KIB, probes=3)
    assert curves.probed == [1, 2, 32]
    assert next(row for row in result.rows if row.n_micro_batches == 2).fits is False
    assert 2 not in curves.whole_steps  # measured over budget: never confirmed
    # The line refitted through the over-budget probe is steep, so micro-batch 16
    # (N=4, 360 KiB: it would fit) is predicted over budget and N=8 is taken: safe,
    # at a cost in throughput that a curved memory model would avoid.
    assert result.recommended_n == 8
    recommended = result.recommended
    assert recommended is not None and recommended.measured_peak_bytes is not None
    assert recommended.measured_peak_bytes <= 560 * KIB


def test_nothing_fits_names_the_smallest_micro_batch_and_the_budget() -> None:
    curves = Curves(linear(200 * KIB, 10 * KIB))
    with pytest.raises(NothingFitsError, match=r"even micro-batch 1 \(N=64\) peaks at 215040 bytes > budget 102400"):
        search_plan(curves.measurements(), global_batch_size=BATCH, memory_budget_bytes=100 * KIB)
    assert curves.probed == [1]  # nothing larger was tried


def test_the_optimizer_step_peak_can_decide_alone() -> None:
    # Activations are tiny but the optimizer step peaks above the budget at any N.
    curves = Curves(linear(10 * KIB, KIB), optimizer_step=500 * KIB)
    with pytest.raises(NothingFitsError, match=r"optimizer step alone: 512000 bytes"):
        search_plan(curves.measurements(), global_batch_size=BATCH, memory_budget_bytes=400 * KIB)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"probes": 1}, r"probes must be >= 2 \(a line needs two points\), got 1"),
        ({"safety_margin": 1.0}, r"safety_margin must be in \[0, 1\), got 1.0"),
        ({"candidates": [0, 4]}, r"candidates must be in 1..64 \(the global batch size\), got \[0\]"),
    ],
    ids=["one-probe", "margin-1", "n-zero"],
)
def test_search_refuses_bad_settings(arguments: dict[str, object], message: str) -> None:
    curves = Curves(linear(200 * KIB, 10 * KIB))
    with pytest.raises(ValueError, match=message):
        search_plan(curves.measurements(), global_batch_size=BATCH, memory_budget_bytes=400 * KIB, **arguments)  # type: ignore[arg-type]
    assert curves.probed == []  # refused before measuring anything

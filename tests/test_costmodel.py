"""equiv.cost.costmodel: the fits recover known coefficients; leave-one-out is honest."""

from __future__ import annotations

import pytest

from equiv.cost.costmodel import (
    MemoryPoint,
    MicroStepPoint,
    TimePoint,
    fit_memory,
    fit_micro_steps,
    fit_time,
    leave_one_out,
)

STATIC, PER_SAMPLE, STEP_PEAK = 5_000_000.0, 30_000.0, 9_000_000.0
T_FIXED, T_SAMPLE = 0.002, 0.00005


def _memory_points(sizes: list[int]) -> list[MemoryPoint]:
    return [
        MemoryPoint(
            micro_batch_size=m, forward_backward_peak_bytes=STATIC + PER_SAMPLE * m, optimizer_step_peak_bytes=STEP_PEAK
        )
        for m in sizes
    ]


def _time_points(ns: list[int], batch: int) -> list[TimePoint]:
    return [
        TimePoint(n_micro_batches=n, global_batch_size=batch, step_seconds=n * T_FIXED + batch * T_SAMPLE) for n in ns
    ]


def test_fit_memory_recovers_static_and_per_sample_terms() -> None:
    model = fit_memory(_memory_points([128, 64, 32, 8]))
    assert model.static_bytes == pytest.approx(STATIC, rel=1e-9)
    assert model.activation_bytes_per_sample == pytest.approx(PER_SAMPLE, rel=1e-9)
    assert model.optimizer_step_peak_bytes == STEP_PEAK
    # Small micro-batches are bounded by the optimizer step, large ones by activations.
    assert model.peak_bytes(8) == STEP_PEAK
    assert model.peak_bytes(256) == pytest.approx(STATIC + PER_SAMPLE * 256)


def test_largest_micro_batch_within_budget() -> None:
    model = fit_memory(_memory_points([128, 8]))
    assert model.largest_micro_batch_within(STATIC + PER_SAMPLE * 200.5) == 200
    assert model.largest_micro_batch_within(STEP_PEAK - 1) == 0


@pytest.mark.parametrize("batch_sizes", [[256], [256, 64]], ids=["one-global-batch", "two-global-batches"])
def test_fit_time_recovers_fixed_and_per_sample_terms(batch_sizes: list[int]) -> None:
    points = [p for b in batch_sizes for p in _time_points([1, 2, 8, 32], b)]
    model = fit_time(points)
    assert model.seconds_per_micro_step == pytest.approx(T_FIXED, rel=1e-9)
    assert model.seconds_per_sample == pytest.approx(T_SAMPLE, rel=1e-9)
    assert model.samples_per_s(4, 256) == pytest.approx(256 / (4 * T_FIXED + 256 * T_SAMPLE))


def test_fit_micro_steps_recovers_the_terms_and_predicts_whole_steps() -> None:
    update = 0.004
    points = [
        MicroStepPoint(micro_batch_size=m, micro_step_seconds=T_FIXED + m * T_SAMPLE, update_seconds=u)
        for m, u in [(1, update), (8, update * 2), (64, update)]
    ]
    model = fit_micro_steps(points)
    assert model.seconds_per_micro_step == pytest.approx(T_FIXED, rel=1e-9)
    assert model.seconds_per_sample == pytest.approx(T_SAMPLE, rel=1e-9)
    assert model.seconds_per_update == update  # the median: one slow update does not move it
    assert model.step_seconds(4, 256) == pytest.approx(4 * T_FIXED + 256 * T_SAMPLE + update)


@pytest.mark.parametrize(
    ("seconds", "expected"),
    [
        ([0.010, 0.009, 0.008], (0.009, 0.0)),  # least squares: slope < 0; the mean instead
        ([0.0006, 0.0022, 0.0118], (0.0, 0.7952 / 4416)),  # intercept < 0; a line through 0 instead
    ],
    ids=["slope-would-be-negative", "intercept-would-be-negative"],
)
def test_fit_micro_steps_never_fits_a_negative_term(seconds: list[float], expected: tuple[float, float]) -> None:
    points = [
        MicroStepPoint(micro_batch_size=m, micro_step_seconds=t, update_seconds=0.0)
        for m, t in zip([8, 16, 64], seconds, strict=True)
    ]
    model = fit_micro_steps(points)
    assert (model.seconds_per_micro_step, model.seconds_per_sample) == pytest.approx(expected, rel=1e-9, abs=1e-15)


def test_leave_one_out_is_exact_on_a_line_and_finds_the_outlier() -> None:
    points = _memory_points([64, 32, 16, 8])
    held = leave_one_out(
        points,
        fit_memory,
        lambda m, p: m.forward_backward_bytes(p.micro_batch_size),
        lambda p: p.forward_backward_peak_bytes,
    )
    assert [h.index for h in held] == [0, 1, 2, 3]
    assert max(abs(h.relative_error) for h in held) < 1e-9

    bumped = [
        *points[:2],
        MemoryPoint(micro_batch_size=16, forward_backward_peak_bytes=STATIC * 2, optimizer_step_peak_bytes=STEP_PEAK),
        points[3],
    ]
    held = leave_one_out(
        bumped,
        fit_memory,
        lambda m, p: m.forward_backward_bytes(p.micro_batch_size),
        lambda p: p.forward_backward_peak_bytes,
    )
    # Fitted without it, the bumped point is predicted from the clean line and the error shows.
    assert held[2].predicted == pytest.approx(STATIC + PER_SAMPLE * 16, rel=1e-9)
    assert held[2].relative_error == pytest.approx((STATIC + PER_SAMPLE * 16) / (STATIC * 2) - 1, rel=1e-9)


def test_leave_one_out_skips_points_whose_removal_leaves_too_few() -> None:
    held = leave_one_out(_memory_points([64, 8]), fit_memory, lambda m, p: 0.0, lambda p: 1.0)
    assert held == []


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: fit_memory(_memory_points([32, 32])), r"at >= 2 different micro-batch sizes, got sizes \[32\]"),
        (lambda: fit_time(_time_points([4, 4], 64)), r"at >= 2 different N, got N = \[4\]"),
        (
            lambda: fit_time([TimePoint(n_micro_batches=1, global_batch_size=8, step_seconds=0.0)] * 2),
            r"step_seconds must be positive and finite, got \[0.0, 0.0\]",
        ),
    ],
    ids=["one-micro-batch-size", "one-n", "zero-seconds"],
)
def test_bad_input_is_refused_with_the_values(call: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()  # type: ignore[operator]

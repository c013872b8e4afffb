"""What accumulation over N micro-batches costs, as two fitted lines.

For a global batch of B samples cut into N micro-batches of at most
m = ceil(B / N) samples:

* memory:  forward/backward peak(m) = static + activation_per_sample * m,
  and the whole step's peak is max(that, optimizer-step peak), the latter a
  constant of the model and optimizer (it does not see the micro-batch);
* time:    seconds per step(N, B) = N * t_fixed + B * t_sample,
  t_fixed being what every micro-step pays whatever its size (Python,
  kernel launches, a pass over the gradients) and t_sample the work per sample.

Fits are ordinary least squares (numpy); :func:`leave_one_out` refits without
each point in turn and reports how far the fit misses it, which is the
honest measure of whether the line can be used to predict an N not measured.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

import numpy as np

__all__ = [
    "HeldOut",
    "MemoryModel",
    "MemoryPoint",
    "MicroStepPoint",
    "TimeModel",
    "TimePoint",
    "fit_memory",
    "fit_micro_steps",
    "fit_time",
    "leave_one_out",
]

P = TypeVar("P")
M = TypeVar("M")


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryPoint:
    """One measured step: its largest micro-batch and its two peaks (bytes)."""

    micro_batch_size: int
    forward_backward_peak_bytes: float
    optimizer_step_peak_bytes: float

    @property
    def peak_bytes(self) -> float:
        return max(self.forward_backward_peak_bytes, self.optimizer_step_peak_bytes)


@dataclass(frozen=True, slots=True, kw_only=True)
class TimePoint:
    """One measured step: N micro-batches over a global batch, its median seconds."""

    n_micro_batches: int
    global_batch_size: int
    step_seconds: float


@dataclass(frozen=True, slots=True, kw_only=True)
class MicroStepPoint:
    """A probe: one micro-step's median seconds at a micro-batch size, and the
    optimizer update's median seconds, timed apart."""

    micro_batch_size: int
    micro_step_seconds: float
    update_seconds: float


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryModel:
    """peak(m) = max(static + activation_per_sample * m, optimizer_step_peak)."""

    static_bytes: float
    activation_bytes_per_sample: float
    optimizer_step_peak_bytes: float

    def forward_backward_bytes(self, micro_batch_size: int) -> float:
        return self.static_bytes + self.activation_bytes_per_sample * micro_batch_size

    def peak_bytes(self, micro_batch_size: int) -> float:
        return max(self.forward_backward_bytes(micro_batch_size), self.optimizer_step_peak_bytes)

    def largest_micro_batch_within(self, budget_bytes: float) -> int:
        """The largest micro-batch whose predicted peak is within ``budget_bytes``
        (0 when not even the optimizer step or an empty micro-batch fits)."""
        if self.optimizer_step_peak_bytes > budget_bytes or self.static_bytes > budget_bytes:
            return 0
        if self.activation_bytes_per_sample <= 0:
            raise ValueError(
                f"fitted activation_bytes_per_sample is {self.activation_bytes_per_sample:.1f} <= 0: "
                "memory does not grow with the micro-batch, so there is no largest micro-batch"
            )
        return int((budget_bytes - self.static_bytes) // self.activation_bytes_per_sample)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True, kw_only=True)
class TimeModel:
    """seconds(N, B) = N * seconds_per_micro_step + B * seconds_per_sample + seconds_per_update.

    Fitted on whole steps at one B (:func:`fit_time`) the update term cannot
    be told apart from B * t_sample and is 0 (folded into t_sample); fitted on
    micro-steps and updates timed apart (:func:`fit_micro_steps`) it is the
    optimizer step's own time."""

    seconds_per_micro_step: float
    seconds_per_sample: float
    seconds_per_update: float = 0.0

    def step_seconds(self, n_micro_batches: int, global_batch_size: int) -> float:
        return (
            n_micro_batches * self.seconds_per_micro_step
            + global_batch_size * self.seconds_per_sample
            + self.seconds_per_update
        )

    def samples_per_s(self, n_micro_batches: int, global_batch_size: int) -> float:
        return global_batch_size / self.step_seconds(n_micro_batches, global_batch_size)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True, kw_only=True)
class HeldOut:
    """A point predicted by a fit that did not see it."""

    index: int
    measured: float
    predicted: float

    @property
    def relative_error(self) -> float:
        """(predicted - measured) / measured: positive when the fit over-predicts."""
        return (self.predicted - self.measured) / self.measured


def _lstsq(columns: Sequence[Sequence[float]], y: Sequence[float]) -> list[float]:
    design = np.column_stack([np.asarray(c, dtype=np.float64) for c in columns])
    target = np.asarray(y, dtype=np.float64)
    if np.linalg.matrix_rank(design) < design.shape[1]:
        raise ValueError(
            f"cannot fit {design.shape[1]} terms from these {design.shape[0]} points: "
            "they need at least that many different settings"
        )
    coefficients, *_ = np.linalg.lstsq(design, target, rcond=None)
    return [float(c) for c in coefficients]


def _nonnegative_lstsq(columns: Sequence[Sequence[float]], y: Sequence[float]) -> list[float]:
    """Least squares with every coefficient >= 0 (for times: a term cannot
    cost negative seconds, but noisy timings can make plain least squares say
    so, and then predict negative throughput).  Exact for two columns: if the
    free fit has a negative coefficient, the best fit with that term at 0."""
    free = _lstsq(columns, y)
    if all(c >= 0 for c in free):
        return free
    target = np.asarray(y, dtype=np.float64)
    best: tuple[float, list[float]] | None = None
    for keep, column in enumerate(columns):
        x = np.asarray(column, dtype=np.float64)
        coefficient = max(0.0, float(x @ target / (x @ x)))
        residual = float(np.sum((target - coefficient * x) ** 2))
        if best is None or residual < best[0]:
            best = (residual, [coefficient if i == keep else 0.0 for i in range(len(columns))])
    assert best is not None
    return best[1]


def fit_memory(points: Sequence[MemoryPoint]) -> MemoryModel:
    """Fit the forward/backward peak to a line in the micro-batch size; the
    optimizer-step peak is taken as the largest measured (it should not vary,
    and erring high keeps a plan on the safe side).  Needs two micro-batch sizes."""
    if len({p.micro_batch_size for p in points}) < 2:
        raise ValueError(
            f"fit_memory needs points at >= 2 different micro-batch sizes, got sizes "
            f"{sorted({p.micro_batch_size for p in points})}"
        )
    static, per_sample = _lstsq(
        [[1.0] * len(points), [p.micro_batch_size for p in points]],
        [p.forward_backward_peak_bytes for p in points],
    )
    return MemoryModel(
        static_bytes=static,
        activation_bytes_per_sample=per_sample,
        optimizer_step_peak_bytes=max(p.optimizer_step_peak_bytes for p in points),
    )


def fit_time(points: Sequence[TimePoint]) -> TimeModel:
    """Fit step seconds to N * t_fixed + B * t_sample, both >= 0.  With one
    global batch size B the second column is constant, i.e. an intercept:
    still two different N are needed."""
    bad = [p.step_seconds for p in points if not (p.step_seconds > 0 and math.isfinite(p.step_seconds))]
    if bad:
        raise ValueError(f"step_seconds must be positive and finite, got {bad}")
    if len({p.n_micro_batches for p in points}) < 2:
        raise ValueError(
            f"fit_time needs points at >= 2 different N, got N = {sorted({p.n_micro_batches for p in points})}"
        )
    per_micro_step, per_sample = _nonnegative_lstsq(
        [[p.n_micro_batches for p in points], [p.global_batch_size for p in points]],
        [p.step_seconds for p in points],
    )
    return TimeModel(seconds_per_micro_step=per_micro_step, seconds_per_sample=per_sample)


def fit_micro_steps(points: Sequence[MicroStepPoint]) -> TimeModel:
    """Fit one micro-step's seconds to t_fixed + m * t_sample, and take the
    update's seconds as the median over the points; a step of N micro-batches
    over B samples then takes about N * t_fixed + B * t_sample + t_update."""
    if len({p.micro_batch_size for p in points}) < 2:
        raise ValueError(
            f"fit_micro_steps needs points at >= 2 different micro-batch sizes, got sizes "
            f"{sorted({p.micro_batch_size for p in points})}"
        )
    per_micro_step, per_sample = _nonnegative_lstsq(
        [[1.0] * len(points), [p.micro_batch_size for p in points]], [p.micro_step_seconds for p in points]
    )
    update = statistics.median(p.update_seconds for p in points)
    return TimeModel(seconds_per_micro_step=per_micro_step, seconds_per_sample=per_sample, seconds_per_update=update)


def leave_one_out(
    points: Sequence[P],
    fit: Callable[[Sequence[P]], M],
    predict: Callable[[M, P], float],
    measured: Callable[[P], float],
) -> list[HeldOut]:
    """For each point: fit without it, predict it.  Points whose removal leaves
    too few to fit are skipped (no held-out figure rather than a made-up one)."""
    held_out: list[HeldOut] = []
    for index, point in enumerate(points):
        rest = [p for i, p in enumerate(points) if i != index]
        try:
            model = fit(rest)
        except ValueError:
            continue
        held_out.append(HeldOut(index=index, measured=measured(point), predicted=predict(model, point)))
    return held_out

"""Pick the number of micro-batches N: the fastest that fits a memory budget.

:func:`plan` measures a few *small* micro-batches of the user's model (the
largest N, which need the least memory, so no trial can run out of memory
before the budget is known to be reachable), fits :mod:`equiv.cost.costmodel`'s
two lines, predicts every candidate N, and then measures the one it
recommends to confirm the prediction.  ``equiv plan`` is the same from the
command line.

The algorithm (:func:`search_plan`) only sees a :class:`Measurements`: two
functions that measure a probe window and a whole step.  :func:`plan` passes
real measurements of the model (:mod:`equiv.cost.steps`); tests pass
synthetic memory and time curves.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from equiv.batches import Batch
from equiv.cost.costmodel import MemoryModel, MemoryPoint, MicroStepPoint, TimeModel, fit_memory, fit_micro_steps
from equiv.cost.memory import StepMemory
from equiv.cost.steps import StepMeasurement, StepOptions, default_optimizer, measure_step, prepare_step
from equiv.cost.workloads import CountItems, LossSum

__all__ = [
    "Measurements",
    "NothingFitsError",
    "Plan",
    "PlanRow",
    "Probe",
    "default_candidates",
    "format_plan",
    "measurements_of",
    "plan",
    "resize_batch",
    "search_plan",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanRow:
    """One candidate N: what the fit predicts, and what was measured if it ran."""

    n_micro_batches: int
    micro_batch_size: int
    predicted_peak_bytes: float
    predicted_samples_per_s: float
    #: Measured peak within the budget where measured (probe or full step), else predicted within it less the margin.
    fits: bool
    #: Peak of a probe at this micro-batch size (two micro-batches: the same peak as any N >= 2 window).
    probed_peak_bytes: int | None = None
    #: Figures of the whole step at this N, measured to confirm the recommendation.
    measured_peak_bytes: int | None = None
    measured_forward_backward_peak_bytes: int | None = None
    measured_optimizer_step_peak_bytes: int | None = None
    measured_samples_per_s: float | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """The recommended N and everything it was decided from."""

    global_batch_size: int
    memory_budget_bytes: int
    device: str
    #: None when no N whose micro-batch was tried fits (see rows).
    recommended_n: int | None
    rows: list[PlanRow]
    memory_model: MemoryModel
    time_model: TimeModel
    #: Micro-batch sizes probed, in the order they ran (smallest first).
    probed_micro_batch_sizes: list[int] = field(default_factory=list)

    @property
    def recommended(self) -> PlanRow | None:
        return next((r for r in self.rows if r.n_micro_batches == self.recommended_n), None)

    def to_dict(self) -> dict[str, Any]:
        return {
            "global_batch_size": self.global_batch_size,
            "memory_budget_bytes": self.memory_budget_bytes,
            "device": self.device,
            "recommended_n": self.recommended_n,
            "probed_micro_batch_sizes": self.probed_micro_batch_sizes,
            "memory_model": self.memory_model.to_dict(),
            "time_model": self.time_model.to_dict(),
            "rows": [asdict(r) for r in self.rows],
        }


class NothingFitsError(ValueError):
    """Not even the smallest micro-batch's step fits the memory budget."""


@dataclass(frozen=True, slots=True)
class Probe:
    """One measured probe window: its peaks and its micro-step and update times."""

    memory: StepMemory
    point: MicroStepPoint
    #: Micro-batches in the probe's window: 2, or 1 when the micro-batch is the whole batch (N=1).
    window: int


@dataclass(frozen=True, slots=True)
class Measurements:
    """What the planning algorithm may measure, and nothing else."""

    #: probe(micro_batch_size, window): a window of ``window`` micro-batches of that size.
    probe: Callable[[int, int], Probe]
    #: whole_step(n): the whole global batch cut into n micro-batches.
    whole_step: Callable[[int], StepMeasurement]


def default_candidates(global_batch_size: int) -> list[int]:
    """Powers of two up to the batch size, and the batch size itself (N = B: one sample each)."""
    candidates = [1 << k for k in range(global_batch_size.bit_length()) if 1 << k <= global_batch_size]
    return sorted({*candidates, global_batch_size})


def resize_batch(batch: Batch, size: int) -> Batch:
    """Repeat the example batch's rows (cyclically) to ``size`` rows."""
    inputs, targets = batch
    if inputs.shape[0] == 0 or inputs.shape[0] != targets.shape[0]:
        raise ValueError(
            f"example batch needs >= 1 sample and as many targets as inputs, got "
            f"{inputs.shape[0]} inputs and {targets.shape[0]} targets"
        )
    index = torch.arange(size) % inputs.shape[0]
    return inputs[index], targets[index]


def measurements_of(model: nn.Module, full_batch: Batch, options: StepOptions, *, repeats: int) -> Measurements:
    """Real measurements of ``model`` (copied for every measurement, so its
    weights are never touched) on ``full_batch``, the global batch."""

    def probe(micro_batch_size: int, window: int) -> Probe:
        samples = window * micro_batch_size
        prepared = prepare_step(
            copy.deepcopy(model), (full_batch[0][:samples], full_batch[1][:samples]), window, options
        )
        memory = prepared.measure_memory()
        phases = prepared.time_phases(repeats)
        # The fastest repeat: load from other processes only ever adds time,
        # and one slow probe would tilt the whole line.
        point = MicroStepPoint(
            micro_batch_size=micro_batch_size,
            micro_step_seconds=min(a for a, _ in phases) / window,
            update_seconds=min(u for _, u in phases),
        )
        return Probe(memory, point, window)

    def whole_step(n_micro_batches: int) -> StepMeasurement:
        return measure_step(model, full_batch, n_micro_batches, options, repeats=repeats)

    return Measurements(probe=probe, whole_step=whole_step)


def plan(
    model: nn.Module,
    batch: Batch,
    *,
    global_batch_size: int,
    memory_budget_bytes: int,
    loss_sum: LossSum | None = None,
    count_items: CountItems | None = None,
    optimizer_factory: Callable[[Any], torch.optim.Optimizer] = default_optimizer,
    device: torch.device | str = "cpu",
    candidates: Sequence[int] | None = None,
    probes: int = 4,
    repeats: int = 3,
    safety_margin: float = 0.05,
) -> Plan:
    """Recommend the fastest N (micro-batches per optimizer step) whose step fits ``memory_budget_bytes``.

    How the N is chosen without a trial beyond the budget's reach: :func:`search_plan`.

    Args:
        model: the model to train (a copy is measured; it is not trained).
        batch: an example ``(inputs, targets)``; its rows are repeated to ``global_batch_size``.
        global_batch_size: samples per optimizer step (a positive integer).
        memory_budget_bytes: the peak memory a step may use.
        loss_sum, count_items: the summed loss and the item count of a micro-batch (default:
            summed cross-entropy for integer targets, summed squared error for float targets).
        optimizer_factory: builds the optimizer over the model's parameters.
        device: where to measure.
        candidates: the Ns to consider (default: the powers of two up to ``global_batch_size``, and it).
        probes, repeats: how many Ns are timed, and how many times each.
        safety_margin: the fraction of the budget kept free.

    Returns:
        A :class:`Plan`: the recommended N, every N measured or predicted, and why.

    Raises:
        NothingFitsError: no N fits the budget.
        ValueError: an argument is out of range (named, with the value given).
    """
    device = _measuring_device(device, repeats, global_batch_size)
    options = StepOptions(
        loss_sum=loss_sum or _default_loss_sum(batch[1]),
        count_items=count_items or (lambda targets: int(targets.shape[0])),
        optimizer_factory=optimizer_factory,
        device=device,
    )
    full_batch = resize_batch(batch, global_batch_size)
    return search_plan(
        measurements_of(model, full_batch, options, repeats=repeats),
        global_batch_size=global_batch_size,
        memory_budget_bytes=memory_budget_bytes,
        candidates=candidates,
        probes=probes,
        safety_margin=safety_margin,
        device=str(device),
    )


def _measuring_device(device: torch.device | str, repeats: int, global_batch_size: int) -> torch.device:
    """:func:`plan`'s ``device``, refused (with ``repeats`` and ``global_batch_size``) before anything is measured."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1 (the time line needs a timing), got {repeats}")
    if global_batch_size < 1:
        raise ValueError(f"global_batch_size must be >= 1, got {global_batch_size}")
    device = torch.device(device)
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda[:index]', got {str(device)!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(device)!r} asked for, but torch.cuda.is_available() is False")
    return device


def search_plan(
    measure: Measurements,
    *,
    global_batch_size: int,
    memory_budget_bytes: int,
    candidates: Sequence[int] | None = None,
    probes: int = 4,
    safety_margin: float = 0.05,
    device: str = "cpu",
) -> Plan:
    """The planning algorithm, in two phases, on whatever ``measure`` measures.

    1. *Probe* (:func:`_probe_phase`) micro-batch sizes, smallest first, each
       as a window of two micro-batches (the forward/backward peak of any
       N >= 2 window depends only on the micro-batch, and two micro-steps are
       cheap), timing the micro-steps and the optimizer update apart.  The two
       smallest come first; then the largest size the memory line predicts to
       fit (at least ``safety_margin`` below the budget) and one between, up
       to ``probes``.  A probe over budget rules its size out and the line is
       refitted.
    2. *Confirm* (:func:`_confirm_phase`): predict every candidate N from the
       fitted lines and take the fastest that fits; run its whole step to
       confirm (measured peak and samples/s); if it does not fit after all,
       take the next.  Then measure the pick's neighbouring candidates (those
       predicted to fit) as whole steps and move to a faster one that fits,
       while there is one: the recommendation is the fastest *measured* step
       around the predicted optimum, not the line's guess.
    """
    _check_search(global_batch_size, memory_budget_bytes, safety_margin, probes)
    size_of = _sizes_of(candidates, global_batch_size)
    candidates = list(size_of)
    budget = _Budget(memory_budget_bytes, memory_budget_bytes * (1 - safety_margin))
    sizes = sorted(set(size_of.values()))
    probed = _probe_phase(measure, sizes, global_batch_size, budget, probes, max(candidates))
    recommended, confirmed, memory_model, time_model = _confirm_phase(
        measure, probed, candidates, size_of, global_batch_size, budget
    )

    rows = []
    for n, m in size_of.items():
        predicted = PlanRow(
            n_micro_batches=n,
            micro_batch_size=m,
            predicted_peak_bytes=memory_model.peak_bytes(m),
            predicted_samples_per_s=time_model.samples_per_s(n, global_batch_size),
            fits=budget.fits(m, probed, memory_model),
            probed_peak_bytes=probed[m].memory.peak_bytes if m in probed else None,
        )
        rows.append(_measured(predicted, confirmed[n], global_batch_size, budget) if n in confirmed else predicted)
    return Plan(
        global_batch_size=global_batch_size,
        memory_budget_bytes=memory_budget_bytes,
        device=device,
        recommended_n=recommended,
        rows=rows,
        memory_model=memory_model,
        time_model=time_model,
        probed_micro_batch_sizes=list(probed),
    )


def _check_search(global_batch_size: int, memory_budget_bytes: int, safety_margin: float, probes: int) -> None:
    """:func:`search_plan`'s arguments, refused before anything is measured."""
    if global_batch_size < 1:
        raise ValueError(f"global_batch_size must be >= 1, got {global_batch_size}")
    if memory_budget_bytes <= 0:
        raise ValueError(f"memory_budget_bytes must be > 0, got {memory_budget_bytes}")
    if not 0 <= safety_margin < 1:
        raise ValueError(f"safety_margin must be in [0, 1), got {safety_margin}")
    if probes < 2:
        raise ValueError(f"probes must be >= 2 (a line needs two points), got {probes}")


def _sizes_of(candidates: Sequence[int] | None, global_batch_size: int) -> dict[int, int]:
    """The micro-batch size of each candidate N (default: :func:`default_candidates`), in
    increasing N; candidates out of range or giving fewer than two sizes (no line through
    them) are refused."""
    ordered = sorted(set(candidates if candidates is not None else default_candidates(global_batch_size)))
    bad = [n for n in ordered if not 1 <= n <= global_batch_size]
    if bad:
        raise ValueError(f"candidates must be in 1..{global_batch_size} (the global batch size), got {bad}")
    size_of = {n: _micro_batch_size(global_batch_size, n) for n in ordered}
    if len(set(size_of.values())) < 2:
        raise ValueError(f"candidates {ordered} give fewer than 2 micro-batch sizes; nothing to fit")
    return size_of


def _measured(predicted: PlanRow, whole: StepMeasurement, global_batch_size: int, budget: _Budget) -> PlanRow:
    """A row whose whole step was measured: it fits as measured, not as predicted."""
    return dataclasses.replace(
        predicted,
        fits=whole.memory.peak_bytes <= budget.budget_bytes,
        measured_peak_bytes=whole.memory.peak_bytes,
        measured_forward_backward_peak_bytes=whole.memory.forward_backward_peak_bytes,
        measured_optimizer_step_peak_bytes=whole.memory.optimizer_step_peak_bytes,
        measured_samples_per_s=global_batch_size / whole.median_step_seconds,
    )


@dataclass(frozen=True, slots=True)
class _Budget:
    budget_bytes: int
    #: The budget less the safety margin: what a *predicted* peak must stay under.
    allowed_bytes: float

    def fits(self, m: int, probed: dict[int, Probe], memory_model: MemoryModel) -> bool:
        """Measured where probed (exact); known where a larger micro-batch's
        two-micro-batch window measured within budget (the forward/backward peak
        grows with the micro-batch, the optimizer step's does not depend on it);
        predicted with the margin elsewhere."""
        if m in probed:
            return probed[m].memory.peak_bytes <= self.budget_bytes
        if any(p.window == 2 and size > m and p.memory.peak_bytes <= self.budget_bytes for size, p in probed.items()):
            return True
        return memory_model.peak_bytes(m) <= self.allowed_bytes


def _probe_phase(
    measure: Measurements, sizes: list[int], global_batch_size: int, budget: _Budget, probes: int, largest_n: int
) -> dict[int, Probe]:
    """Probe micro-batch sizes, smallest first, until ``probes`` ran or no
    unprobed size is predicted to fit; returns them in the order they ran."""
    probed: dict[int, Probe] = {}

    def probe(m: int) -> Probe:
        # Two micro-batches of m (one when m is the whole batch: that is N=1 exactly).
        probed[m] = measure.probe(m, 2 if 2 * m <= global_batch_size else 1)
        return probed[m]

    smallest = probe(sizes[0])
    if smallest.memory.peak_bytes > budget.budget_bytes:
        raise NothingFitsError(
            f"no N fits: even micro-batch {sizes[0]} (N={largest_n}) peaks at "
            f"{smallest.memory.peak_bytes} bytes > budget {budget.budget_bytes} bytes "
            f"(optimizer step alone: {smallest.memory.optimizer_step_peak_bytes} bytes)"
        )
    probe(sizes[1])
    while len(probed) < probes:
        memory_model = _fit_memory(probed)
        fitting = [m for m in sizes if budget.fits(m, probed, memory_model)]
        unprobed = [m for m in fitting if m not in probed]
        if unprobed and unprobed[-1] > max(probed):
            probe(unprobed[-1])  # the largest size predicted to fit: the likely pick
            continue
        # Sizes the line puts inside the safety margin (at most the budget, but
        # not the margin below it): a probe measures exactly what the line can
        # only guess, and a micro-batch there is the fastest that may fit.
        largest_fitting = max(m for m, p in probed.items() if p.memory.peak_bytes <= budget.budget_bytes)
        borderline = [
            m
            for m in sizes
            if m not in probed and m > largest_fitting and memory_model.peak_bytes(m) <= budget.budget_bytes
        ]
        if borderline:
            probe(borderline[-1])
        elif unprobed:
            # One between the small probes and the largest that fits, so the time line spans the range.
            middle = math.sqrt(sizes[1] * max(m for m in probed if m in fitting))
            probe(min(unprobed, key=lambda m: abs(math.log(m / middle))))
        else:
            break
    return probed


def _confirm_phase(
    measure: Measurements,
    probed: dict[int, Probe],
    candidates: list[int],
    size_of: dict[int, int],
    global_batch_size: int,
    budget: _Budget,
) -> tuple[int | None, dict[int, StepMeasurement], MemoryModel, TimeModel]:
    """Take the fastest N predicted to fit and measure its whole step; the
    first that fits when measured is the recommendation (None: none did)."""
    memory_model = _fit_memory(probed)
    time_model = fit_micro_steps([p.point for p in probed.values()])
    confirmed: dict[int, StepMeasurement] = {}

    def fits(n: int) -> bool:
        return confirmed[n].memory.peak_bytes <= budget.budget_bytes

    while True:
        feasible = [n for n in candidates if n not in confirmed and budget.fits(size_of[n], probed, memory_model)]
        if not feasible:
            return None, confirmed, memory_model, time_model
        best = max(feasible, key=lambda n: (time_model.samples_per_s(n, global_batch_size), -n))
        confirmed[best] = measure.whole_step(best)
        if fits(best):
            break
    # The time line misranks neighbouring N: it is fitted on two-micro-batch
    # probes, while a whole step's time also moves with what the line leaves out
    # (cache effects of the micro-batch size, launch overheads on a GPU).  So the
    # pick's neighbours among the candidates predicted to fit are measured as
    # whole steps too, and the search walks to a faster one while there is one:
    # a step's time is close to unimodal in N, and every step it takes is measured.
    predicted_fit = [n for n in candidates if budget.fits(size_of[n], probed, memory_model) or n in confirmed]
    for _ in range(_NEIGHBOUR_STEPS):
        position = predicted_fit.index(best)
        neighbours = [
            predicted_fit[i]
            for i in (position - 1, position + 1)
            if 0 <= i < len(predicted_fit) and predicted_fit[i] not in confirmed
        ]
        if not neighbours:
            break
        for n in neighbours:
            confirmed[n] = measure.whole_step(n)
        faster = min((n for n in confirmed if fits(n)), key=lambda n: (confirmed[n].median_step_seconds, n))
        if faster == best:
            break
        best = faster
    return best, confirmed, memory_model, time_model


#: Rounds of the walk from the predicted pick to a measured-faster neighbour
#: (each measures at most two whole steps; the walk usually stops after one).
_NEIGHBOUR_STEPS = 3


def _micro_batch_size(global_batch_size: int, n: int) -> int:
    return -(-global_batch_size // n)  # ceil: the largest piece sets the peak


def _fit_memory(probed: dict[int, Probe]) -> MemoryModel:
    """The memory line through the two-micro-batch probes.  An N=1 probe has no
    gradient temporary (backward's gradients become ``.grad`` directly), so it
    would bend the line: it is left out while two others exist."""
    windows = {m: p for m, p in probed.items() if p.window == 2}
    chosen = windows if len(windows) >= 2 else probed
    return fit_memory(
        [
            MemoryPoint(
                micro_batch_size=m,
                forward_backward_peak_bytes=p.memory.forward_backward_peak_bytes,
                optimizer_step_peak_bytes=p.memory.optimizer_step_peak_bytes,
            )
            for m, p in sorted(chosen.items())
        ]
    )


def _default_loss_sum(targets: Tensor) -> LossSum:
    if targets.is_floating_point():
        return lambda output, target: torch.nn.functional.mse_loss(output, target, reduction="sum")

    def cross_entropy_sum(output: Tensor, target: Tensor) -> Tensor:
        # (batch, ..., classes) against (batch, ...): flatten all but the class dim.
        return torch.nn.functional.cross_entropy(output.flatten(0, -2), target.flatten(), reduction="sum")

    return cross_entropy_sum


def format_plan(result: Plan) -> str:
    """The plan as a table a person reads: predicted and measured, per N."""
    mib = 2**20
    memory, timing = result.memory_model, result.time_model

    def mib_or_dash(value: float | None) -> str:
        return f"{value / mib:.2f}" if value is not None else "-"

    lines = [
        f"global batch {result.global_batch_size}, budget {result.memory_budget_bytes / mib:.1f} MiB, "
        + f"device {result.device}; probed micro-batches {result.probed_micro_batch_sizes}",
        f"memory model: peak = max({memory.static_bytes / mib:.2f} MiB + "
        + f"{memory.activation_bytes_per_sample / mib * 1024:.1f} KiB x micro-batch, "
        + f"optimizer step {memory.optimizer_step_peak_bytes / mib:.2f} MiB)",
        f"time model: step = N x {timing.seconds_per_micro_step * 1e3:.2f} ms + "
        + f"B x {timing.seconds_per_sample * 1e6:.1f} us + update {timing.seconds_per_update * 1e3:.2f} ms",
        "",
        f"{'N':>5} {'micro':>6} {'pred MiB':>9} {'probe MiB':>9} {'step MiB':>9} "
        + f"{'pred samples/s':>15} {'meas samples/s':>15}  fits",
    ]
    for row in result.rows:
        measured_rate = f"{row.measured_samples_per_s:.0f}" if row.measured_samples_per_s is not None else "-"
        marker = "  <- recommended" if row.n_micro_batches == result.recommended_n else ""
        lines.append(
            f"{row.n_micro_batches:>5} {row.micro_batch_size:>6} {row.predicted_peak_bytes / mib:>9.2f} "
            f"{mib_or_dash(row.probed_peak_bytes):>9} {mib_or_dash(row.measured_peak_bytes):>9} "
            f"{row.predicted_samples_per_s:>15.0f} {measured_rate:>15}  {'yes' if row.fits else 'no'}{marker}"
        )
    if result.recommended_n is None:
        lines.append("no N fits the budget: every candidate was measured or predicted over it")
    return "\n".join(lines)

"""Judge a whole run (a peer's, or a failing step's against a kind of failure) with the checker of :func:`equiv.check`.

A peer driven over whole epochs (or one window per call) leaves a trajectory:
its weights and optimizer state after every optimizer step it takes.  It is
judged as :func:`equiv.check` judges a candidate, and as
:mod:`equiv.auditing.replay` judges a recorded window: against a float64
*reference* run from the same start (the full batch of each window, or the
step of one kind of failure), tensor by tensor and step by step, by the
engine's :class:`~equiv.judging.judge.Judge`: the reference is the run source,
its roundings each window's micro-batches in order, reversed and rotated, and
the floor plan (:mod:`equiv.judging.floors`) runs it in float32 (feeding both
tiers), in float64 reversed and rotated (exact tier), in both tiers:

* exact: the peer's float64 run against the truth;
* noise: the peer's run in the working dtype (float32) against the truth.

Precision is told apart as :func:`equiv.check` tells it
(:func:`~equiv.judging.judge.float32_sized`): a step whose only differences
are in the float64 run, float32-sized, where the float32 run matched, fails
nothing a user training in float32 could see (a model that computes part of
its step in float32, as Llama's RMSNorm and the transformers loss do); it is
reported as a precision note, never as a pass of a mathematical mismatch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor, nn

from equiv.judging.floors import Order, Rounding
from equiv.judging.judge import Judge, OnSnapshot, float32_sized
from equiv.judging.runs import Snapshot, snapshot_of
from equiv.outcomes import Outcome
from equiv.results.protocol import ResultBase, headed
from equiv.results.verdict import PrecisionFinding, TensorDiff, Tier
from equiv.zoo.kinds import ORDERS

__all__ = [
    "ReferenceRun",
    "References",
    "RunVerdict",
    "StepMagnitude",
    "Trajectories",
    "flat_params",
    "magnitude",
    "record",
    "step_scales",
    "trajectory_verdict",
    "update_gap",
]

#: Runs a reference from the start in ``dtype``, each window's micro-batches in
#: ``order`` (one of :data:`equiv.zoo.kinds.ORDERS`), handing over a snapshot
#: before the first step (step 0) and after each optimizer step.
ReferenceRun = Callable[[torch.dtype, str, Callable[[int, Snapshot], None]], None]


def flat_params(params: dict[str, Tensor]) -> Tensor:
    """Every parameter in one float64 vector (a copy): for the update's scale and direction."""
    return torch.cat([p.detach().reshape(-1).to(torch.float64) for p in params.values()])


@dataclass(frozen=True)
class Trajectories:
    """A peer's two runs of the same problem, a snapshot per optimizer step (step 0 first)."""

    #: the float64 run (exact tier)
    exact: list[Snapshot]
    #: the run in the working dtype (noise tier)
    noise: list[Snapshot]
    working: torch.dtype

    @property
    def steps(self) -> int:
        return len(self.exact) - 1


def record(model: nn.Module, optimizer: torch.optim.Optimizer, run: Callable[[], None]) -> list[Snapshot]:
    """Float64 copies of ``model`` and ``optimizer`` before ``run`` and after
    every optimizer step it takes, whoever wraps the optimizer (Accelerate,
    Lightning, a Trainer): the step hook sits on the optimizer itself."""
    snapshots = [snapshot_of(model, optimizer)]
    hook = optimizer.register_step_post_hook(lambda *_: snapshots.append(snapshot_of(model, optimizer)))
    try:
        run()
    finally:
        hook.remove()
    return snapshots


class References(Judge):
    """The float64 run of one reference and, per tier, how far the same
    reference rounded other ways lands from it (the floors): the engine's
    :class:`~equiv.judging.judge.Judge` over a peer's run source, whose
    roundings are its windows' micro-batch orders, every floor sample run."""

    def __init__(self, run: ReferenceRun, working: torch.dtype, *, orders: Sequence[str] = ORDERS) -> None:
        #: the truth's parameters after each step, flat (step 0 first): magnitudes only, no verdict
        self.flat: list[Tensor] = []

        def source(dtype: torch.dtype, rounding: Rounding, on_snapshot: OnSnapshot) -> None:
            run(dtype, rounding.order, on_snapshot)

        super().__init__(
            source,
            working=working,
            roundings=[Rounding(cast(Order, order)) for order in orders],
            on_truth=lambda step, snapshot: self.flat.append(flat_params(snapshot.params)),
        )
        self.with_floors()


@dataclass(frozen=True)
class RunVerdict(ResultBase):
    """A peer's run against one reference: every compared tensor's row, both tiers;
    truthy only when equivalent."""

    KIND = "run_verdict"

    diffs: tuple[TensorDiff, ...]
    #: optimizer steps taken / the reference's
    steps: tuple[int, int]

    @property
    def mismatches(self) -> tuple[TensorDiff, ...]:
        return tuple(d for d in self.diffs if not d.ok)

    def failing_steps(self) -> list[int]:
        """Steps with a mismatch that is not a precision finding: one in the
        noise tier, or one in the float64 run larger than float32 rounding."""
        by_step: dict[int, list[TensorDiff]] = {}
        for diff in self.mismatches:
            by_step.setdefault(diff.step, []).append(diff)
        noise_compared = {d.step for d in self.diffs if d.tier == "noise"}
        return sorted(
            step
            for step, rows in by_step.items()
            if any(d.tier == "noise" for d in rows) or step not in noise_compared or not float32_sized(rows)
        )

    @property
    def first_failure(self) -> int | None:
        """The first step that fails: past its allowance (not precision), or the
        first step one run takes and the other does not; None when none does."""
        failing = self.failing_steps()
        if failing:
            return failing[0]
        return min(self.steps) + 1 if self.steps[0] != self.steps[1] else None

    @property
    def equivalent(self) -> bool:
        return self.first_failure is None

    @property
    def precision(self) -> PrecisionFinding | None:
        """The precision finding of an equivalent run with differences inside its
        float64 run only (see :func:`equiv.check`): a note, never a failure here
        (the peers train in float32)."""
        return PrecisionFinding("float32_sized") if self.equivalent and self.mismatches else None

    def precision_note(self) -> str | None:
        finding = self.precision
        if finding is None:
            return None
        return finding.describe(max(self.mismatches, key=lambda d: d.relative_error))

    def first_mismatch(self) -> TensorDiff | None:
        """The first tensor past its allowance at the first failing step (the exact tier's first)."""
        step = self.first_failure
        rows = [d for d in self.mismatches if d.step == step]
        return min(rows, key=lambda d: (d.tier != "exact", d.quantity != "update"), default=None)

    @property
    def status(self) -> Outcome:
        return Outcome.EQUIVALENT if self.equivalent else Outcome.NOT_EQUIVALENT

    def __bool__(self) -> bool:
        return self.equivalent

    def line(self) -> str:
        """One line: the outcome, the steps, and the first failing step's first tensor past its allowance."""
        steps = f"{self.steps[0]} optimizer step(s) against the reference's {self.steps[1]}"
        first = self.first_mismatch()
        if self.equivalent:
            return headed(self.status, steps + (", with a precision note" if self.precision is not None else ""))
        where = (
            ""
            if first is None
            else (
                f": {first.label} at step {first.step}, {first.tier} tier, off by "
                f"{first.relative_error:.3g} of its scale ({first.ratio:.3g} x allowed)"
            )
        )
        return headed(self.status, f"{steps}, first failing at step {self.first_failure}{where}")

    def message(self) -> str:
        first = self.first_mismatch()
        lines = [self.line()]
        if first is not None and not self.equivalent:
            lines.append(first.describe())
        note = self.precision_note()
        return "\n".join(lines + ([f"Precision note: {note}"] if note else []))

    def _fields(self) -> dict[str, Any]:
        return {
            "steps": list(self.steps),
            "first_failure": self.first_failure,
            "mismatches": [d.to_dict() for d in self.mismatches],
        }


def trajectory_verdict(trajectories: Trajectories, references: References) -> RunVerdict:
    """Every step of both of the peer's runs against ``references``, in its tier."""
    diffs: list[TensorDiff] = []
    tiers: tuple[tuple[Tier, list[Snapshot], torch.dtype], ...] = (
        ("exact", trajectories.exact, torch.float64),
        ("noise", trajectories.noise, trajectories.working),
    )
    for tier, run, dtype in tiers:
        if tier in references.tier_names:  # a float64 run has one tier
            assert dtype == references.dtype(tier), (tier, dtype, references.dtype(tier))
            diffs.extend(references.compare(tier, run[: references.steps + 1]))
    return RunVerdict(tuple(diffs), (trajectories.steps, references.steps))


@dataclass(frozen=True)
class StepMagnitude:
    """How far one optimizer step of a run is from the reference's step from the
    same weights, over all parameters: what a NOT verdict's step looks like
    (measured after the checker has judged it, never a verdict itself)."""

    step: int  # 1-based
    #: |Δ - Δ_full| / |Δ_full| over all parameters
    relative: float
    #: |Δ| / |Δ_full|: 3.0 is three times the step, 0.0 no step at all
    scale: float
    #: cos(Δ, Δ_full): 1.0 the right direction, -1.0 a sign flip
    cosine: float

    def describe(self) -> str:
        if self.scale == 0.0:
            return f"step {self.step}: no update where full batch updates"
        if math.isinf(self.scale):
            return f"step {self.step}: an update where full batch skips the step"
        # Words for the direction only (the checker has judged the step): Adam's first step,
        # about lr * sign(g), reads as a flip when the cosine rounds to -1 at two decimals.
        direction = "sign flipped" if round(self.cosine, 2) == -1.0 else f"cos {self.cosine:.2f}"
        # The gap too: under Adam a 3x gradient moves the update only through eps (scale "1x").
        return (
            f"step {self.step}: update {self.scale:.3g}x the full-batch one, {direction}, "
            f"off by {self.relative:.2g} of it"
        )


def update_gap(step: int, before: Tensor, after: Tensor, full_after: Tensor) -> StepMagnitude:
    """The step from ``before`` to ``after`` against the step from ``before`` to ``full_after``."""
    before, after, full_after = (t.to(torch.float64) for t in (before, after, full_after))
    delta, full = after - before, full_after - before
    full_norm, norm = float(full.norm()), float(delta.norm())
    if full_norm == 0.0:  # the reference skipped the step (an overflowing window under loss scaling)
        return StepMagnitude(step, 0.0 if norm == 0.0 else math.inf, 1.0 if norm == 0.0 else math.inf, 1.0)
    cosine = float(delta @ full) / (norm * full_norm) if norm > 0 else 0.0
    return StepMagnitude(step, float((delta - full).norm()) / full_norm, norm / full_norm, cosine)


def magnitude(step: int, run: Sequence[Snapshot], reference: Sequence[Tensor]) -> StepMagnitude:
    """The peer's float64 step ``step`` against the reference's (``reference``: its
    flat parameters after each step, step 0 first) from the reference's weights
    before it (the runs agree up to the first failing step); a step the peer never
    took is no update."""
    before, full_after = reference[step - 1], reference[step]
    after = flat_params(run[step].params) if step < len(run) else before
    return update_gap(step, before, after, full_after)


def step_scales(run: Sequence[Snapshot], reference: Sequence[Tensor]) -> list[float]:
    """Each step's update along the reference's step, over all parameters:
    <Δ, Δ_full> / <Δ_full, Δ_full> (1.0 the full-batch step, 0.333 a third of it),
    for the steps both took (a chart, drawn after the verdict)."""
    scales = []
    for step in range(1, min(len(run), len(reference))):
        delta = flat_params(run[step].params) - flat_params(run[step - 1].params)
        full = reference[step] - reference[step - 1]
        norm = float(full @ full)
        scales.append(float(delta @ full) / norm if norm > 0 else math.nan)
    return scales

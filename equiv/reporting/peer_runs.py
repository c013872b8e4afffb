"""Runs of peers the way their users run them, measured against full batch.

The candidate contract (:func:`equiv.check`) hands a step one window at a
time, so a library that counts micro-batches across an epoch (``step % N``)
or ends a window at the end of its data never shows that logic there.  Here a
library is driven as one run: one DataLoader / one ``fit`` over an epoch of
several windows, for one or more epochs, and every optimizer step it takes is
compared with the full-batch step over the same window (the epoch's
micro-batches grouped N at a time, the last window shorter when the epoch is
not a multiple of N, windows restarting each epoch).

Failures are named by KIND: which wrong weighting of the micro-batches'
mean gradients the library's steps match exactly (float64), so a verdict says
"the tail divided by N" rather than only "different".  The magnitude is
reported as the update's scale and direction (``|Δ|/|Δ_full|`` and the cosine
between the two updates), which Adam's sign-like first step cannot disguise.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from equiv.batches import split_batch
from equiv.cases.case import Case
from equiv.checking.contract import bind
from equiv.checking.trajectory import run_candidate, run_reference
from equiv.losses import Loss
from equiv.zoo.bugs import clip_per_micro_batch

__all__ = [
    "KINDS",
    "PER_MICRO_BATCH_CLIPPING",
    "WINDOW_BOUNDARY",
    "EpochRun",
    "EpochRunner",
    "Kind",
    "Measure",
    "Problem",
    "UpdateGap",
    "classify_step",
    "measure",
    "measure_epochs",
    "update_gap",
    "windows",
]

#: float64 runs of the same mathematics differ by rounding only (~1e-15 of the
#: update); a gap above this fraction of the full-batch update is a real one.
_SAME = 1e-7

MicroBatches = list[tuple[Tensor, Tensor]]


class EpochRunner(Protocol):
    """A library driven over a whole run: every micro-batch of one epoch, in
    order, ``epochs`` times, with whatever N the runner was configured with."""

    def run_epochs(self, model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: MicroBatches,
                   loss_fn: Loss, *, epochs: int) -> None: ...


class Problem(Protocol):
    """What a run trains on: a fresh float64 model, optimizer and one epoch of
    micro-batches each time it is asked, and how to score a micro-batch."""

    @property
    def n(self) -> int: ...

    @property
    def epochs(self) -> int: ...

    @property
    def tolerance(self) -> float:
        """The relative update gap that still counts as the same step."""

    def fresh(self) -> tuple[nn.Module, torch.optim.Optimizer, list[Any]]: ...

    def count(self, micro_batch: Any) -> float: ...

    def mean_loss(self, model: nn.Module, micro_batch: Any) -> Tensor: ...

    def full_batch_loss(self, model: nn.Module, micro_batches: list[Any]) -> Tensor: ...


def windows(micro_batches: int, n: int) -> list[list[int]]:
    """Micro-batch indices of each window of one epoch: N at a time, the last shorter."""
    return [list(range(start, min(start + n, micro_batches))) for start in range(0, micro_batches, n)]


@dataclass(frozen=True)
class EpochRun:
    """One epoch of ``case.micro_batch_sizes`` micro-batches (the case's first
    batch), N per window, repeated ``epochs`` times."""

    case: Case
    n: int
    epochs: int = 1
    tolerance: float = _SAME

    def describe(self) -> str:
        sizes = [len(w) for w in windows(len(self.case.micro_batch_sizes), self.n)]
        epochs = f", {self.epochs} epochs" if self.epochs > 1 else ""
        return f"{len(self.case.micro_batch_sizes)} micro-batches, N={self.n}: windows {'+'.join(map(str, sizes))}{epochs}"

    def fresh(self) -> tuple[nn.Module, torch.optim.Optimizer, list[Any]]:
        """The case's model and optimizer in float64, and one epoch's micro-batches."""
        bundle = self.case.build_model()
        model = bundle.module.to(dtype=torch.float64)
        inputs, targets = self.case.batches(bundle)[0]
        batch = tuple(t.to(torch.float64) if t.is_floating_point() else t for t in (inputs, targets))
        micro = split_batch(batch, self.case.micro_batch_sizes, copy=True)  # type: ignore[arg-type]
        return model, self.case.build_optimizer(model), list(micro)

    def count(self, micro_batch: Any) -> float:
        return float(self.case.build_loss().count(micro_batch[1]))

    def mean_loss(self, model: nn.Module, micro_batch: Any) -> Tensor:
        inputs, targets = micro_batch
        loss: Tensor = self.case.build_loss()(model(inputs), targets)
        return loss

    def full_batch_loss(self, model: nn.Module, micro_batches: list[Any]) -> Tensor:
        batch = (torch.cat([p[0] for p in micro_batches]), torch.cat([p[1] for p in micro_batches]))
        return self.mean_loss(model, batch)


@dataclass(frozen=True)
class UpdateGap:
    """One optimizer step of a run against the full-batch step from the same weights."""

    step: int  # 1-based
    #: |Δ - Δ_full| / |Δ_full| over all parameters
    relative: float
    #: |Δ| / |Δ_full|: 3.0 is three times the step, 0.0 no step at all
    scale: float
    #: cos(Δ, Δ_full): 1.0 the right direction, -1.0 a sign flip
    cosine: float

    def same(self, tolerance: float = _SAME) -> bool:
        return self.relative <= tolerance

    def describe(self) -> str:
        if self.scale == 0.0:
            return f"step {self.step}: no update where full batch updates"
        direction = "sign flipped" if self.cosine < -0.99 else f"cos {self.cosine:.2f}"
        # The gap too: under Adam a 3x gradient moves the update only through eps (scale "1x").
        return (f"step {self.step}: update {self.scale:.3g}x the full-batch one, {direction}, "
                f"off by {self.relative:.2g} of it")


def _flat(params: dict[str, Tensor]) -> Tensor:
    return torch.cat([p.detach().reshape(-1).to(torch.float64) for p in params.values()])


def update_gap(step: int, before: Tensor, after: Tensor, full_after: Tensor) -> UpdateGap:
    """The gap between two updates from the same flat parameters ``before``."""
    before, after, full_after = (t.to(torch.float64) for t in (before, after, full_after))
    delta, full = after - before, full_after - before
    full_norm = float(full.norm())
    if full_norm == 0.0:
        # A skipped step (an overflowing window under loss scaling): no update to measure against, so the
        # run's movement is measured against the weights themselves; rounding-level drift between two runs
        # that agreed so far is no step.
        gap = float((delta - full).norm())
        same = gap <= _SAME * float(before.norm())
        return UpdateGap(step, 0.0 if same else math.inf, 1.0 if same else math.inf, 1.0)
    norm = float(delta.norm())
    cosine = float(delta @ full) / (norm * full_norm) if norm > 0 else 0.0
    return UpdateGap(step, float((delta - full).norm()) / full_norm, norm / full_norm, cosine)


# -- kinds of failure: the weights a window's micro-batch mean gradients get --------------------------

#: (micro-batch item counts, configured N) -> the weight of each micro-batch's MEAN loss.
Weighting = Callable[[list[float], int], list[float]]


@dataclass(frozen=True)
class Kind:
    name: str
    weights: Weighting
    #: what it means, with the upstream reports it matches where one exists
    means: str


def _exact(counts: list[float], n: int) -> list[float]:
    total = sum(counts)
    return [c / total for c in counts]


KINDS: tuple[Kind, ...] = (
    Kind("mean of means", lambda counts, n: [1.0 / len(counts)] * len(counts),
         "each micro-batch's mean weighted 1/len(window), not by its item count "
         "(uneven splits, token losses: transformers #34191, Lightning #20350)"),
    Kind("tail divided by N", lambda counts, n: [1.0 / n] * len(counts),
         "a window of fewer than N micro-batches still divided by N (Lightning #19987)"),
    Kind("sum without division", lambda counts, n: [1.0] * len(counts),
         "the micro-batch means summed, never divided (nanoGPT #168; the MindSpore r1.x tutorial)"),
)


def _weighted_step(weights: Weighting, n: int | None) -> Callable[..., None]:
    """A contract step whose gradient is ``Σ w_i ∇mean_i`` (clipped once): the
    exact step with ``_exact``, one kind of failure with the others.  With a
    ``grad_scaler`` the window is skipped if any micro-batch overflowed and the
    scale updated once, as the full-batch step does, so that under loss
    scaling only the weighting can tell a peer from the kind it reproduces."""

    def step(model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: MicroBatches, loss_fn: Loss, *,
             max_grad_norm: float | None = None, grad_scaler: torch.amp.GradScaler | None = None) -> None:
        counts = [float(loss_fn.count(t)) for _, t in micro_batches]
        for weight, (inputs, targets) in zip(weights(counts, n or len(micro_batches)), micro_batches, strict=True):
            loss = loss_fn(model(inputs), targets) * weight
            (grad_scaler.scale(loss) if grad_scaler is not None else loss).backward()
        if grad_scaler is not None:
            grad_scaler.unscale_(optimizer)
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        if grad_scaler is None:
            optimizer.step()
        else:
            grad_scaler.step(optimizer)
            grad_scaler.update()
        optimizer.zero_grad(set_to_none=True)

    return step


def _first_gap(trajectory: Sequence[Tensor], full: Sequence[Tensor], tolerance: float = _SAME) -> UpdateGap | None:
    """The first step whose update differs from the full-batch update from the
    same weights (both trajectories agree up to it); None when none does."""
    for step in range(1, min(len(trajectory), len(full))):
        gap = update_gap(step, full[step - 1], trajectory[step], full[step])
        if not gap.same(tolerance):
            return gap
    return None


def _flat_trajectory(case: Case, candidate: Callable[..., Any] | None) -> list[Tensor]:
    snapshots = (run_reference(case, torch.float64) if candidate is None
                 else run_candidate(case, candidate, torch.float64))
    return [_flat(s.params) for s in snapshots]


@dataclass(frozen=True)
class Measure:
    """What a run did against full batch: the first differing step, and which
    kind of failure (if any of :data:`KINDS`) its whole trajectory matches."""

    gap: UpdateGap | None
    kind: Kind | None = None
    #: optimizer steps taken / expected (differ: a window boundary in the wrong place)
    steps: tuple[int, int] | None = None
    #: where the run departs from ``kind``'s own trajectory too (a window boundary), if it does
    later_gap: UpdateGap | None = None

    @property
    def equivalent(self) -> bool:
        return self.gap is None and (self.steps is None or self.steps[0] == self.steps[1])

    def kind_name(self) -> str:
        """The kind of failure; "window boundary" added when the run also steps
        at the wrong micro-batches (a window missing, or one spanning epochs)."""
        names = [self.kind.name] if self.kind is not None else []
        if self.boundary and "window boundary" not in names:
            names.append("window boundary")
        return " + ".join(names) or "unclassified"

    @property
    def boundary(self) -> bool:
        return (self.steps is not None and self.steps[0] != self.steps[1]) or self.later_gap is not None

    def describe(self) -> str:
        parts = [self.kind_name()]
        if self.steps is not None and self.steps[0] != self.steps[1]:
            parts.append(f"{self.steps[0]} optimizer steps where full batch takes {self.steps[1]}")
        if self.gap is not None:
            parts.append(self.gap.describe())
        return "; ".join(parts)


def classify_step(candidate: Callable[..., Any], case: Case, *, configured_n: int | None = None) -> Measure:
    """A contract step on ``case`` in float64: its first gap from full batch and
    the kind of failure its trajectory reproduces exactly (None if no listed one)."""
    full = _flat_trajectory(case, None)
    trajectory = _flat_trajectory(case, candidate)
    gap = _first_gap(trajectory, full)
    if gap is None:
        return Measure(None)
    if gap.scale == 0.0:
        return Measure(gap, WINDOW_BOUNDARY)
    suspects = [(kind, _weighted_step(kind.weights, configured_n)) for kind in KINDS]
    for kind, suspect in [*suspects, (PER_MICRO_BATCH_CLIPPING, clip_per_micro_batch)]:
        # A suspect that cannot take the case (per-micro-batch clipping under loss scaling) is no suspect.
        if bind(suspect).not_applicable_reasons(case):
            continue
        if _first_gap(trajectory, _flat_trajectory(case, suspect)) is None:
            return Measure(gap, kind)
    return Measure(gap)


#: Not a weighting: matched by equiv's own bug of that name (correct weights, clipped every micro-batch).
PER_MICRO_BATCH_CLIPPING = Kind("per-micro-batch clipping", _exact,
                                "the running gradient clipped after every micro-batch (transformers #986, #1563)")


#: Not a weighting: a step missing, or taken at the wrong micro-batch (a window spanning epochs).
WINDOW_BOUNDARY = Kind("window boundary", _exact, "an optimizer step missing, or taken at the wrong micro-batch: a "
                       "short window never stepped, or one that spans an epoch boundary")


# -- runs spanning all windows -------------------------------------------------------------------------


def _params(model: nn.Module) -> Tensor:
    return _flat({name: p for name, p in model.named_parameters()})


def _reference(problem: Problem, weights: Weighting) -> list[Tensor]:
    """Parameters before and after each window's step with the given weighting
    of the micro-batches' means (``_exact``: one step on the window's samples as one batch)."""
    model, optimizer, micro = problem.fresh()
    trajectory = [_params(model)]
    for _ in range(problem.epochs):
        for window in windows(len(micro), problem.n):
            pieces = [micro[i] for i in window]
            optimizer.zero_grad(set_to_none=True)
            if weights is _exact:
                problem.full_batch_loss(model, pieces).backward()
            else:
                counts = [problem.count(piece) for piece in pieces]
                for weight, piece in zip(weights(counts, problem.n), pieces, strict=True):
                    (problem.mean_loss(model, piece) * weight).backward()
            optimizer.step()
            trajectory.append(_params(model))
    return trajectory


def measure(drive: Callable[[nn.Module, torch.optim.Optimizer, list[Any]], None], problem: Problem) -> Measure:
    """Let ``drive`` train a fresh model on the problem's epochs in one run and
    compare each optimizer step it takes with the full-batch step over the same window."""
    model, optimizer, micro = problem.fresh()
    trajectory = [_params(model)]
    # Every real optimizer step, whoever wraps the optimizer (Accelerate, Lightning, a Trainer).
    hook = optimizer.register_step_post_hook(lambda *_: trajectory.append(_params(model)))
    try:
        drive(model, optimizer, micro)
    finally:
        hook.remove()
    full = _reference(problem, _exact)
    steps = (len(trajectory) - 1, len(full) - 1)
    gap = _first_gap(trajectory, full, problem.tolerance)
    if gap is None and steps[0] == steps[1]:
        return Measure(None, steps=steps)
    if gap is None:
        # Every step it took was right, but it took fewer or more.
        gap = UpdateGap(min(steps) + 1, 1.0, 0.0 if steps[0] < steps[1] else 1.0, 0.0)
    for kind in KINDS:
        # The kind whose trajectory explains the first wrong step; a later departure
        # from it too is a window in the wrong place (a leak across epochs).
        later = _first_gap(trajectory, _reference(problem, kind.weights), problem.tolerance)
        took_that_step = len(trajectory) > gap.step
        if took_that_step and (later is None or later.step > gap.step):
            return Measure(gap, kind, steps, later)
    return Measure(gap, None, steps)


def measure_epochs(runner: EpochRunner, run: EpochRun) -> Measure:
    """Drive ``runner`` over ``run`` once (its own epoch loop) against full batch."""
    loss_fn = run.case.build_loss()
    return measure(lambda model, optimizer, micro: runner.run_epochs(model, optimizer, micro, loss_fn,
                                                                      epochs=run.epochs), run)


@dataclass(frozen=True)
class TokenRun:
    """A tiny causal LM (:mod:`equiv.zoo.adapters.transformers`) trained with
    SGD on right-padded sequences: ``real_lengths`` holds each micro-batch's
    sequences' real token counts, so micro-batches carry unequal numbers of
    tokens; N per window, ``epochs`` passes.  ``loss_kwargs`` False wraps the
    model in a forward without ``**kwargs``."""

    real_lengths: tuple[tuple[int, ...], ...]
    n: int
    epochs: int = 1
    loss_kwargs: bool = True
    lr: float = 0.5
    #: The model runs in float64 but its RMSNorm computes in float32 (as Llama's does):
    #: runs whose weights differ by float64 rounding drift apart by ~1e-7 per step.
    tolerance: float = 1e-5

    def describe(self) -> str:
        sizes = [len(w) for w in windows(len(self.real_lengths), self.n)]
        tokens = "/".join(str(sum(length - 1 for length in lengths)) for lengths in self.real_lengths)
        return (f"{len(self.real_lengths)} micro-batches of {len(self.real_lengths[0])} sequences, "
                f"{tokens} target tokens, N={self.n}: windows {'+'.join(map(str, sizes))}")

    def fresh(self) -> tuple[nn.Module, torch.optim.Optimizer, list[Any]]:
        from equiv.zoo.adapters.transformers import NoLossKwargs, tiny_causal_lm, token_micro_batches

        model = tiny_causal_lm()
        if not self.loss_kwargs:
            model = NoLossKwargs(model)
        micro = token_micro_batches([list(lengths) for lengths in self.real_lengths])
        return model, torch.optim.SGD(model.parameters(), lr=self.lr), micro

    def count(self, micro_batch: Any) -> float:
        return float((micro_batch["labels"][:, 1:] != -100).sum())

    def mean_loss(self, model: nn.Module, micro_batch: Any) -> Tensor:
        # Computed here, not by the model's own loss: next-token cross-entropy over real targets.
        logits = model(input_ids=micro_batch["input_ids"], attention_mask=micro_batch["attention_mask"]).logits
        targets = micro_batch["labels"][:, 1:]
        loss_sum = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100, reduction="sum")
        return loss_sum / self.count(micro_batch)

    def full_batch_loss(self, model: nn.Module, micro_batches: list[Any]) -> Tensor:
        return self.mean_loss(model, {key: torch.cat([mb[key] for mb in micro_batches]) for key in micro_batches[0]})

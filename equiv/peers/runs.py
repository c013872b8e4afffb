"""Runs of peers the way their users run them, judged against full batch.

The candidate contract (:func:`equiv.check`) hands a step one window at a
time, so a library that counts micro-batches across an epoch (``step % N``)
or ends a window at the end of its data never shows that logic there.  Here a
library is driven as one run: one DataLoader / one ``fit`` over an epoch of
several windows, for one or more epochs, and every optimizer step it takes is
judged against the full-batch step over the same window (the epoch's
micro-batches grouped N at a time, the last window shorter when the epoch is
not a multiple of N, windows restarting each epoch) by :mod:`equiv.judging.trajectories`:
the checker and derived allowances of :func:`equiv.check`, in both tiers.

Failures are named by KIND (:mod:`equiv.zoo.kinds`): the wrong weighting of
the micro-batches' mean gradients that the same checker finds the run
equivalent to.  The magnitude is reported as the update's scale and direction
(``|Δ|/|Δ_full|`` and the cosine between the two updates), which Adam's
sign-like first step cannot disguise.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from equiv.batches import MicroBatches, split_batch
from equiv.cases.case import Case
from equiv.checking.check import check
from equiv.checking.failure_kinds import classify
from equiv.judging.runs import Snapshot, snapshot_of
from equiv.judging.trajectories import (
    References,
    StepMagnitude,
    Trajectories,
    magnitude,
    record,
    step_scales,
    trajectory_verdict,
)
from equiv.losses import Loss
from equiv.results.verdict import TensorDiff, Verdict
from equiv.zoo.kinds import (
    KINDS,
    Kind,
    Weighting,
    exact_weights,
    ordered,
)

__all__ = [
    "EpochRun",
    "EpochRunner",
    "Measure",
    "Problem",
    "TokenRun",
    "classify_step",
    "measure",
    "measure_epochs",
    "windows",
]


class EpochRunner(Protocol):
    """A library driven over a whole run: every micro-batch of one epoch, in
    order, ``epochs`` times, with whatever N the runner was configured with."""

    def run_epochs(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        micro_batches: MicroBatches,
        loss_fn: Loss,
        *,
        epochs: int,
    ) -> None: ...


class Problem(Protocol):
    """What a run trains on: a fresh model in a dtype, its optimizer and one
    epoch of micro-batches each time it is asked, and how to score a micro-batch."""

    @property
    def n(self) -> int: ...

    @property
    def epochs(self) -> int: ...

    @property
    def working_dtype(self) -> torch.dtype:
        """The dtype users train it in: the noise tier's."""

    def fresh(self, dtype: torch.dtype) -> tuple[nn.Module, torch.optim.Optimizer, list[Any]]: ...

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

    def describe(self) -> str:
        sizes = [len(w) for w in windows(len(self.case.micro_batch_sizes), self.n)]
        epochs = f", {self.epochs} epochs" if self.epochs > 1 else ""
        return (
            f"{len(self.case.micro_batch_sizes)} micro-batches, N={self.n}: windows {'+'.join(map(str, sizes))}{epochs}"
        )

    @property
    def working_dtype(self) -> torch.dtype:
        return self.case.working_dtype

    def fresh(self, dtype: torch.dtype) -> tuple[nn.Module, torch.optim.Optimizer, list[Any]]:
        """The case's model and optimizer in ``dtype``, and one epoch's micro-batches."""
        bundle = self.case.build_model()
        model = bundle.module.to(dtype=dtype)
        inputs, targets = self.case.batches(bundle)[0]
        batch = tuple(t.to(dtype) if t.is_floating_point() else t for t in (inputs, targets))
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
class TokenRun:
    """A tiny causal LM (:mod:`equiv.adapters.transformers`) trained with
    SGD on right-padded sequences: ``real_lengths`` holds each micro-batch's
    sequences' real token counts, so micro-batches carry unequal numbers of
    tokens; N per window, ``epochs`` passes.  ``loss_kwargs`` False wraps the
    model in a forward without ``**kwargs``.  Users train it in float32; the
    float64 run is the exact tier's (its RMSNorm and the Trainer's loss still
    compute in float32 there, as Llama's and transformers' code does)."""

    real_lengths: tuple[tuple[int, ...], ...]
    n: int
    epochs: int = 1
    loss_kwargs: bool = True
    lr: float = 0.5

    def describe(self) -> str:
        sizes = [len(w) for w in windows(len(self.real_lengths), self.n)]
        tokens = "/".join(str(sum(length - 1 for length in lengths)) for lengths in self.real_lengths)
        return (
            f"{len(self.real_lengths)} micro-batches of {len(self.real_lengths[0])} sequences, "
            f"{tokens} target tokens, N={self.n}: windows {'+'.join(map(str, sizes))}"
        )

    @property
    def working_dtype(self) -> torch.dtype:
        return torch.float32

    def fresh(self, dtype: torch.dtype) -> tuple[nn.Module, torch.optim.Optimizer, list[Any]]:
        from equiv.adapters.transformers import NoLossKwargs, tiny_causal_lm, token_micro_batches

        model = tiny_causal_lm().to(dtype)  # built in float32: the same start in every dtype
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
            logits[:, :-1].reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100, reduction="sum"
        )
        return loss_sum / self.count(micro_batch)

    def full_batch_loss(self, model: nn.Module, micro_batches: list[Any]) -> Tensor:
        return self.mean_loss(model, {key: torch.cat([mb[key] for mb in micro_batches]) for key in micro_batches[0]})


@dataclass(frozen=True)
class Measure:
    """What a run did against full batch, as the checker judged it: the first
    failing step's magnitude, and which kind of failure (if any of
    :data:`~equiv.zoo.kinds.KINDS`) the checker finds the run equivalent to."""

    gap: StepMagnitude | None
    failure_kind: Kind | None = None
    #: optimizer steps taken / expected (differ: a window boundary in the wrong place)
    steps: tuple[int, int] | None = None
    #: the first step where the run departs from ``failure_kind``'s own steps too (a window boundary), if it does
    later: int | None = None
    #: the first tensor past its allowance (the checker's row: tier, allowance, ratio)
    first: TensorDiff | None = None
    #: the precision note of an equivalent run whose float64 run differs by float32 rounding only
    note: str | None = None
    #: each step's update along the full-batch one (1.0: the same), for the steps both took
    scales: tuple[float, ...] = ()

    @property
    def equivalent(self) -> bool:
        return self.gap is None and (self.steps is None or self.steps[0] == self.steps[1])

    @property
    def kind(self) -> Kind | None:
        """The same as :attr:`failure_kind`; kept for code written before it."""
        return self.failure_kind

    def failure_name(self) -> str:
        """The kind of failure; "window boundary" added when the run also steps
        at the wrong micro-batches (a window missing, or one spanning epochs)."""
        names = [self.failure_kind.name] if self.failure_kind is not None else []
        if self.boundary and "window boundary" not in names:
            names.append("window boundary")
        return " + ".join(names) or "unclassified"

    def kind_name(self) -> str:
        """The same as :meth:`failure_name`; kept for code written before it."""
        return self.failure_name()

    @property
    def boundary(self) -> bool:
        return (self.steps is not None and self.steps[0] != self.steps[1]) or self.later is not None

    def magnitude(self) -> str:
        """What the run did where it failed: steps missing or extra, the first failing step's size and direction."""
        parts = []
        if self.steps is not None and self.steps[0] != self.steps[1]:
            parts.append(f"{self.steps[0]} optimizer steps where full batch takes {self.steps[1]}")
        if self.gap is not None:
            parts.append(self.gap.describe())
        return "; ".join(parts)

    def describe(self) -> str:
        return "; ".join(part for part in (self.failure_name(), self.magnitude()) if part)

    def checker(self) -> str:
        """The checker's own words for the first tensor past its allowance."""
        if self.first is None:
            return "-"
        return f"{self.first.label} at step {self.first.step}, {self.first.tier} tier: {self.first.ratio:.2g} x allowed"


# -- one window per call (the candidate contract) --------------------------------------------------------


def classify_step(
    candidate: Callable[..., Any], case: Case, *, configured_n: int | None = None, verdict: Verdict | None = None
) -> Measure:
    """A contract step on ``case``: :func:`equiv.check`'s verdict (``verdict`` when
    already made), the magnitude of its first failing step in float64, and the kind
    of failure the same checker finds it equivalent to (None if no listed one), as
    :func:`equiv.checking.failure_kinds.classify` finds it for ``equiv check``.
    A step that fails only in the noise tier has no float64 gap (``gap`` None)."""
    verdict = verdict if verdict is not None else check(candidate, case)
    if verdict or not verdict.mismatches:
        return Measure(None, note=verdict.precision_note)
    found = classify(candidate, case, verdict, configured_n=configured_n)
    return Measure(found.gap, found.failure, first=found.first)


# -- runs spanning all windows ---------------------------------------------------------------------------


def _reference_run(
    problem: Problem, weights: Weighting
) -> Callable[[torch.dtype, str, Callable[[int, Snapshot], None]], None]:
    """One step per window with the given weighting of the micro-batches' means
    (:func:`~equiv.zoo.kinds.exact_weights`: one step on the window's samples as one batch)."""

    def run(dtype: torch.dtype, order: str, on_snapshot: Callable[[int, Snapshot], None]) -> None:
        model, optimizer, micro = problem.fresh(dtype)
        on_snapshot(0, snapshot_of(model, optimizer, copy_tensors=False))
        step = 0
        for _ in range(problem.epochs):
            for window in windows(len(micro), problem.n):
                pieces = [micro[i] for i in ordered(window, order)]
                optimizer.zero_grad(set_to_none=True)
                if weights is exact_weights:
                    problem.full_batch_loss(model, pieces).backward()
                else:
                    counts = [problem.count(piece) for piece in pieces]
                    for weight, piece in zip(weights(counts, problem.n), pieces, strict=True):
                        (problem.mean_loss(model, piece) * weight).backward()
                optimizer.step()
                step += 1
                on_snapshot(step, snapshot_of(model, optimizer, copy_tensors=False))

    return run


#: References by (problem, kind): every peer is judged against the same full batch of a column.
_REFERENCES: dict[tuple[str, str], References] = {}


def _references(problem: Problem, failure_kind: Kind | None) -> References:
    key = (repr(problem), failure_kind.name if failure_kind is not None else "full batch")
    if key not in _REFERENCES:
        weights = exact_weights if failure_kind is None else failure_kind.weights
        _REFERENCES[key] = References(_reference_run(problem, weights), problem.working_dtype)
    return _REFERENCES[key]


def _run(
    drive: Callable[[nn.Module, torch.optim.Optimizer, list[Any]], None], problem: Problem, dtype: torch.dtype
) -> list[Snapshot]:
    model, optimizer, micro = problem.fresh(dtype)
    return record(model, optimizer, lambda: drive(model, optimizer, micro))


def measure(drive: Callable[[nn.Module, torch.optim.Optimizer, list[Any]], None], problem: Problem) -> Measure:
    """Let ``drive`` train a fresh model on the problem's epochs in one run, in
    float64 and in the working dtype, and judge each optimizer step it takes
    against the full-batch step over the same window."""
    trajectories = Trajectories(
        _run(drive, problem, torch.float64), _run(drive, problem, problem.working_dtype), problem.working_dtype
    )
    full = _references(problem, None)
    verdict = trajectory_verdict(trajectories, full)
    scales = tuple(step_scales(trajectories.exact, full.flat))
    step = verdict.first_failure
    if step is None:
        return Measure(None, steps=verdict.steps, note=verdict.precision_note(), scales=scales)
    gap = magnitude(step, trajectories.exact, full.flat)
    first = verdict.first_mismatch()
    for failure_kind in KINDS:
        # The kind whose steps explain the first failing step; a later departure
        # from it too is a window in the wrong place (a leak across epochs).
        later = trajectory_verdict(trajectories, _references(problem, failure_kind)).first_failure
        if trajectories.steps >= step and (later is None or later > step):
            return Measure(gap, failure_kind, verdict.steps, later, first, scales=scales)
    return Measure(gap, None, verdict.steps, first=first, scales=scales)


def measure_epochs(runner: EpochRunner, run: EpochRun) -> Measure:
    """Drive ``runner`` over ``run`` once (its own epoch loop) against full batch."""
    loss_fn = run.case.build_loss()
    return measure(
        lambda model, optimizer, micro: runner.run_epochs(model, optimizer, micro, loss_fn, epochs=run.epochs), run
    )

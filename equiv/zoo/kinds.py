"""Kinds of failure: the wrong weightings of a window's micro-batch means that steps are found to reproduce.

A kind is named by the step it amounts to (``Σ w_i ∇mean_i`` with its own
weights ``w``), so a verdict can say "the tail divided by N" rather than only
"different".  A run is said to be of a kind when the same checker that judges
it against the full batch (:mod:`equiv.judging.trajectories`) finds it equivalent to
that kind's step instead: :mod:`equiv.checking.failure_kinds` asks, for
``equiv check``'s verdicts and the peers survey alike.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from equiv.batches import MicroBatches
from equiv.losses import Loss

__all__ = [
    "KINDS",
    "ORDERS",
    "PER_MICRO_BATCH_CLIPPING",
    "WINDOW_BOUNDARY",
    "Kind",
    "Weighting",
    "exact_weights",
    "ordered",
    "weighted_step",
]

#: (micro-batch item counts, configured N) -> the weight of each micro-batch's MEAN loss.
Weighting = Callable[[list[float], int], list[float]]


#: How a reference orders a window's micro-batches: the same mathematics rounded
#: another way (a floor sample), never another result.
ORDERS = ("in order", "reversed", "rotated")


@dataclass(frozen=True)
class Kind:
    name: str
    weights: Weighting
    #: what it means, with the upstream reports it matches where one exists
    means: str
    #: told apart only by a configured N (a window shorter than N): without one it is another kind's step
    needs_configured_n: bool = False


def exact_weights(counts: list[float], n: int) -> list[float]:
    """The full batch's: each micro-batch's mean weighted by its share of the window's items."""
    total = sum(counts)
    return [c / total for c in counts]


KINDS: tuple[Kind, ...] = (
    Kind(
        "mean of means",
        lambda counts, n: [1.0 / len(counts)] * len(counts),
        "each micro-batch's mean weighted 1/len(window), not by its item count "
        "(uneven splits, token losses: transformers #34191, Lightning #20350)",
    ),
    Kind(
        "tail divided by N",
        lambda counts, n: [1.0 / n] * len(counts),
        "a window of fewer than N micro-batches still divided by N (Lightning #19987)",
        needs_configured_n=True,
    ),
    Kind(
        "sum without division",
        lambda counts, n: [1.0] * len(counts),
        "the micro-batch means summed, never divided (nanoGPT #168; the MindSpore r1.x tutorial)",
    ),
)

#: Not a weighting: matched by equiv's own bug of that name (correct weights, clipped every micro-batch).
PER_MICRO_BATCH_CLIPPING = Kind(
    "per-micro-batch clipping",
    exact_weights,
    "the running gradient clipped after every micro-batch (transformers #986, #1563)",
)

#: Not a weighting: a step missing, or taken at the wrong micro-batch (a window spanning epochs).
WINDOW_BOUNDARY = Kind(
    "window boundary",
    exact_weights,
    "an optimizer step missing, or taken at the wrong "
    "micro-batch: a short window never stepped, or one that spans an epoch boundary",
)


def ordered(items: Sequence[int], order: str) -> list[int]:
    """``items`` in one of :data:`ORDERS` (reversed, or rotated left by one)."""
    if order == "in order":
        return list(items)
    if order == "reversed":
        return list(items)[::-1]
    if order == "rotated":
        return [*items[1:], *items[:1]]
    raise ValueError(f"order must be one of {ORDERS}, got {order!r}")


def weighted_step(weights: Weighting, n: int | None, order: str = "in order") -> Callable[..., None]:
    """A contract step whose gradient is ``Σ w_i ∇mean_i`` (clipped once): one
    kind of failure, back-propagating the micro-batches in ``order``.  With a
    ``grad_scaler`` the window is skipped if any micro-batch overflowed and the
    scale updated once, as the full-batch step does, so that under loss
    scaling only the weighting can tell a peer from the kind it reproduces."""

    def step(
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        micro_batches: MicroBatches,
        loss_fn: Loss,
        *,
        max_grad_norm: float | None = None,
        grad_scaler: torch.amp.GradScaler | None = None,
    ) -> None:
        counts = [float(loss_fn.count(t)) for _, t in micro_batches]
        window_weights = weights(counts, n or len(micro_batches))
        for position in ordered(range(len(micro_batches)), order):
            inputs, targets = micro_batches[position]
            loss = loss_fn(model(inputs), targets) * window_weights[position]
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

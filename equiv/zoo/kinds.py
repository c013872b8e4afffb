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
    "FULL_BATCH",
    "KINDS",
    "NORMALISERS",
    "ORDERS",
    "PER_MICRO_BATCH_CLIPPING",
    "WINDOW_BOUNDARY",
    "Kind",
    "Normaliser",
    "SumWeighting",
    "Weighting",
    "Window",
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


# --- The witness's table: the weight each micro-batch's loss SUM got -----------------------------------------------
#
# KINDS above are the weightings ``equiv check``'s classifier tries, as weights of micro-batch MEANS; the witness
# (equiv.judging.witness, issue 44) reads the weights a run applied to each micro-batch's loss SUM, recovered from
# its accumulated gradient, and names them from NORMALISERS below: KINDS converted (a mean's weight / n_i is its
# sum's weight), so that the two speak of the same kinds by the same names, and the normalisers no check's kind
# is (the full batch, a per-rank mean, a count off by one per row, a uniform scale).  KINDS itself is unchanged:
# it feeds reports/peers.md and equiv check's failure kinds.


@dataclass(frozen=True)
class Window:
    """What a normaliser may read of an accumulation window."""

    #: the items (samples, tokens) of each micro-batch's loss
    counts: tuple[float, ...]
    #: the micro-batches per optimizer step the run was configured with (None: not known)
    configured_n: int | None = None
    #: the rank each micro-batch ran on (None: one process, or not known)
    ranks: tuple[int, ...] | None = None
    #: the rows (sequences) of each micro-batch (None: not known), for a count off by one per row
    rows: tuple[int, ...] | None = None


#: A window -> the weight of each micro-batch's loss SUM, or None where the normaliser cannot apply to it.
SumWeighting = Callable[[Window], "list[float] | None"]


@dataclass(frozen=True)
class Normaliser:
    """One way a loop normalises a window's loss: the weight it gives each micro-batch's loss sum."""

    name: str
    weights: SumWeighting
    #: what the loop did, in one short clause (a verdict's line carries it)
    means: str
    #: the weight of micro-batch i's loss sum, as a formula (n_i its items, N the window's, k its micro-batches)
    formula: str
    #: compared up to one common factor, which the fit supplies (a family: "uniform scale x c")
    up_to_scale: bool = False


def _full_batch_sums(window: Window) -> list[float]:
    """The full batch's: every item weighted 1/N, so each micro-batch's sum 1/N."""
    total = sum(window.counts)
    return [1.0 / total] * len(window.counts)


def _kind_sums(failure_kind: Kind) -> SumWeighting:
    """A kind's weights of micro-batch means as weights of their sums (a mean is its sum / n_i)."""

    def weights(window: Window) -> list[float] | None:
        steps = len(window.counts)
        if failure_kind.needs_configured_n and (window.configured_n is None or steps >= window.configured_n):
            return None  # a full window divided by N is the mean of means: only a shorter one is this kind
        of_means = failure_kind.weights(list(window.counts), window.configured_n or steps)
        return [weight / count for weight, count in zip(of_means, window.counts, strict=True)]

    return weights


def _per_rank_mean_sums(window: Window) -> list[float] | None:
    """Each rank normalised by its own items, the ranks' gradients then averaged (DDP's all-reduce mean)."""
    if window.ranks is None or len(set(window.ranks)) < 2:
        return None
    rank_items: dict[int, float] = {}
    for rank, count in zip(window.ranks, window.counts, strict=True):
        rank_items[rank] = rank_items.get(rank, 0.0) + count
    return [1.0 / (len(rank_items) * rank_items[rank]) for rank in window.ranks]


def _counted_before_the_shift_sums(window: Window) -> list[float] | None:
    """The full batch's divisor counted from the labels before the causal shift: one item too many per row."""
    if window.rows is None:
        return None
    total = sum(window.counts) + sum(window.rows)
    return [1.0 / total] * len(window.counts)


#: The short clause and formula of each of KINDS' weightings as weights of sums.
_KIND_CLAUSES: dict[str, tuple[str, str]] = {
    "mean of means": ("each micro-batch's mean averaged over the window", "1/(k n_i)"),
    "tail divided by N": ("a short window's micro-batch means divided by the configured N", "1/(N_cfg n_i)"),
    "sum without division": ("each micro-batch's mean summed, never divided", "1/n_i"),
}

FULL_BATCH = Normaliser("full batch", _full_batch_sums, "every item weighted alike", "1/N")

#: Every normaliser the witness names, in the order it prefers one when several fit the same weights; KINDS'
#: weightings under their own names (what equiv check's classifier calls them), the rest after them.
NORMALISERS: tuple[Normaliser, ...] = (
    FULL_BATCH,
    *(Normaliser(failure.name, _kind_sums(failure), *_KIND_CLAUSES[failure.name]) for failure in KINDS),
    Normaliser(
        "per-rank mean",
        _per_rank_mean_sums,
        "each rank's loss divided by its own items, the ranks then averaged",
        "1/(R N_r)",
    ),
    Normaliser(
        "count off by one per row",
        _counted_before_the_shift_sums,
        "the items counted from the labels before the shift, one too many per row",
        "1/(N + rows)",
    ),
    Normaliser(
        "uniform scale",
        _full_batch_sums,
        "the full batch's weights times one factor (a loss scale left in, a world size applied twice)",
        "c/N",
        up_to_scale=True,
    ),
)

"""The one floor plan: which roundings of the same mathematics measure a tier's floor.

A tier's allowance is a multiple of its *floor*: how far the full-batch step,
computed in the tier's dtype, lands from the float64 truth (see
:mod:`equiv.judging.tolerances`).  One sample of that distance is a draw from a
heavy-tailed distribution, so several are taken, each the same mathematics
rounded another way: a :class:`Rounding`.  Every run source names the roundings
it can make (a check shuffles its batch; a peer's run and an audited window
replay their micro-batches reversed or rotated; any of them can normalise after
backward) and :func:`floor_plan` turns them into the samples to run, for every
front door alike:

- each rounding in float32 (and in the working dtype when that is lower):
  float32 measures the float32 tier's floor as it is and, scaled by
  u(float64)/u(float32), the float64 tier's (rounding error grows linearly with
  the unit roundoff);
- the first :data:`FLOAT64_SAMPLES` roundings other than the truth's own in
  float64 (the truth's own, in float64, *is* the truth: distance 0);
- cheapest first: a passing tier stops at the first sample that settles it
  (:meth:`equiv.judging.judge.Judge.judge_tier`), so the working precisions'
  samples of the first two roundings run, then the first float64 sample, then
  the rest.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from equiv.judging.tolerances import unit_roundoff
from equiv.results.verdict import Tier

__all__ = ["FLOAT64_SAMPLES", "IN_ORDER", "TIERS", "FloorSample", "Order", "Rounding", "floor_plan"]

TIERS: tuple[Tier, ...] = ("exact", "noise")
#: How many roundings (besides the truth's own) are also run in float64 for the exact tier's floor.
FLOAT64_SAMPLES = 2
#: The orders a run source may feed its items in.
Order = Literal["in order", "reversed", "rotated", "shuffled"]


@dataclass(frozen=True, slots=True)
class Rounding:
    """One way to round the full-batch step's sums without changing its mathematics.

    ``order``: the order the run source feeds its items in: ``"in order"`` (the
    truth's own), ``"reversed"``, ``"rotated"`` (micro-batches of a window, left
    by one), or ``"shuffled"`` (the batch permuted with ``seed``).
    ``after_backward``: the loss summed and the gradients divided by the item
    count after backward (an accumulator's own rounding pattern) instead of
    the mean loss backpropagated.
    """

    order: Order = "in order"
    seed: int | None = None
    after_backward: bool = False

    def __post_init__(self) -> None:
        if (self.order == "shuffled") != (self.seed is not None):
            raise ValueError(f"a shuffled rounding needs a seed and only it takes one, got {self!r}")

    @property
    def is_truth(self) -> bool:
        """Whether this is the truth's own rounding (in float64 it is the truth)."""
        return self.order == "in order" and not self.after_backward


IN_ORDER = Rounding()


@dataclass(frozen=True, slots=True)
class FloorSample:
    """One floor run: ``rounding`` in ``dtype``; per tier whose floor it measures,
    the factor its distance from the truth is scaled by."""

    dtype: torch.dtype
    rounding: Rounding = IN_ORDER
    feeds: Mapping[str, float] = dataclasses.field(default_factory=dict)


def floor_plan(working: torch.dtype, tiers: Sequence[Tier], roundings: Sequence[Rounding]) -> tuple[FloorSample, ...]:
    """The floor samples of a run judged in ``tiers`` whose working dtype is
    ``working``, from the ``roundings`` its run source can make, in the order
    they run (see the module's docstring).  The exact tier is float64; the
    noise tier the working dtype (none when that is float64)."""
    exact, float32 = torch.float64, torch.float32
    float32_feeds: dict[str, float] = (
        {"exact": unit_roundoff(exact) / unit_roundoff(float32)} if "exact" in tiers else {}
    )
    noise = "noise" in tiers and working != exact
    if noise and working == float32:
        float32_feeds["noise"] = 1.0
    lower: list[FloorSample] = []  # float32 and the working dtype, rounding by rounding
    for rounding in roundings:
        if float32_feeds:
            lower.append(FloorSample(float32, rounding, float32_feeds))
        if noise and working != float32:
            lower.append(FloorSample(working, rounding, {"noise": 1.0}))
    float64 = (
        [
            FloorSample(exact, rounding, {"exact": 1.0})
            for rounding in [r for r in roundings if not r.is_truth][:FLOAT64_SAMPLES]
        ]
        if "exact" in tiers
        else []
    )
    first_two = sum(1 for sample in lower if sample.rounding in roundings[:2])
    return (*lower[:first_two], *float64[:1], *lower[first_two:], *float64[1:])

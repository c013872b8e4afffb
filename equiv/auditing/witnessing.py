"""The witness of a failing audited window (issue 44): the weight the run gave each micro-batch's loss.

Run only after a window's verdict says it is not equivalent, so a passing window pays nothing.
``G`` is the gradient the run accumulated, read from the user's parameters after the step (the
audit judges inside the optimizer's post-step hook, before the loop's ``zero_grad``; a stock
optimizer leaves ``.grad`` as its pre-step hook saw it).  ``g_i`` is the float64 gradient of each
recorded micro-batch's loss SUM (the declared ``loss=``), replayed one micro-batch at a time at
the window's starting parameters; :func:`equiv.judging.witness.recover_weights` solves
``G ≈ Σ w_i g_i`` and :func:`equiv.judging.witness.witness` names ``w``.

Under DDP every rank holds the same ``G`` and its own micro-batches: the ranks' ``g_i`` are summed
into one zero-padded stack by the audit's own all-reduce, each rank then takes the Gram of one
slice of the elements and the slices' Gram sums are reduced with the same all-reduce, so every
rank names the same weights (none when the ranks hold different gradients: a sync left off).  A micro-batch with no item to count has a zero gradient (any weight
fits it): it is left out.  An FSDP2 run (sharded replica) gets no witness yet.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from equiv.auditing.ranks import Ranks
from equiv.auditing.replay import RecordedWindow, WindowReplay, model_at
from equiv.auditing.replay import _cast as cast_to  # floating tensors only, as the truth's replay casts
from equiv.judging.witness import recover_weights, witness
from equiv.results.witness import Witness

__all__ = ["window_witness"]

#: A run's clipped gradient norm is the limit up to its rounding; a norm this far below it was not clipped.
_CLIP_ACTIVE_TOLERANCE = 1e-3


def _flat_gradient(params: list[nn.Parameter]) -> Tensor:
    """The parameters' gradients as one float64 vector (zeros where a parameter got none)."""
    return torch.cat(
        [
            (torch.zeros_like(p, dtype=torch.float64) if p.grad is None else p.grad.detach().to(torch.float64)).reshape(
                -1
            )
            for p in params
        ]
    )


def _zero_or(gradient: Tensor | None, param: Tensor) -> Tensor:
    return torch.zeros_like(param, dtype=torch.float64) if gradient is None else gradient


def _micro_batch_gradients(
    window: RecordedWindow, replay: WindowReplay
) -> tuple[list[list[Tensor | None]], list[float]]:
    """Each micro-batch's float64 gradient of its loss sum at the window's start (its own tensors, one per
    parameter: set to None before each backward, so none is copied), and its items; micro-batches with no
    item to count left out."""
    model = model_at(replay.template, window, torch.float64)
    params = list(model.parameters())
    gradients: list[list[Tensor | None]] = []
    items: list[float] = []
    for call in window.calls:
        target = cast_to(replay.targets_of(call), torch.float64)
        count = float(replay.loss.count(target))
        if not count > 0:
            continue
        model.zero_grad(set_to_none=True)
        output = replay.output_of(replay.call_model(model, cast_to(call, torch.float64)))
        replay.loss.sum(output.to(torch.float64), target).backward()
        gradients.append([p.grad for p in params])
        items.append(count)
    return gradients, items


def _gathered(ranks: Ranks, gradients: list[Tensor], items: list[float], size: int) -> tuple[Tensor, Tensor, list[int]]:
    """Every rank's micro-batch gradients stacked in rank order (one all-reduce of a zero-padded stack),
    their items, and the rank of each."""
    counts = torch.zeros(ranks.world_size, dtype=torch.float64)
    counts[ranks.rank] = len(gradients)
    ranks.all_reduce(counts)
    per_rank = [int(count) for count in counts.tolist()]
    offset, total = sum(per_rank[: ranks.rank]), sum(per_rank)
    stack = torch.zeros(total, size + 1, dtype=torch.float64)  # the last column: each micro-batch's items
    for index, (gradient, count) in enumerate(zip(gradients, items, strict=True)):
        stack[offset + index, :size] = gradient
        stack[offset + index, size] = count
    ranks.all_reduce(stack)
    owners = [rank for rank, count in enumerate(per_rank) for _ in range(count)]
    return stack[:, :size], stack[:, size], owners


def _same_on_every_rank(ranks: Ranks, accumulated: Tensor) -> bool:
    """Whether every rank holds the same accumulated gradient (DDP's all-reduce ran), by one projection on a
    fixed random direction: R Σ x_r² = (Σ x_r)² only when every x_r is the same (two numbers sent)."""
    direction = torch.randn(accumulated.numel(), generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    projection = float(direction @ accumulated)
    sums = torch.tensor([projection, projection * projection], dtype=torch.float64)
    ranks.all_reduce(sums)
    spread = ranks.world_size * float(sums[1]) - float(sums[0]) ** 2  # R² times the projections' variance
    return spread <= 1e-12 * ranks.world_size * float(sums[1])


def window_witness(window: RecordedWindow, replay: WindowReplay, *, configured_n: int | None) -> Witness | None:
    """The witness of a failing window: the weights the run applied to its micro-batches, named.

    Args:
        window: the window just stepped (its calls, its start).
        replay: how the run is replayed (the user's model, whose ``.grad`` still holds the run's ``G``).
        configured_n: the run's usual micro-batches per step (a shorter window may be "tail divided by N").

    Returns:
        The :class:`~equiv.results.witness.Witness`, or None where none is made: an FSDP2 run (sharded
        parameters), or a window with no item to count.  Under DDP every rank must call it together.
    """
    ranks = replay.ranks
    if ranks is not None and ranks.sharded:
        return None
    gradients, items = _micro_batch_gradients(window, replay)
    run_params = list(replay.model.parameters())
    norm = math.sqrt(sum(float(p.grad.detach().double().square().sum()) for p in run_params if p.grad is not None))
    # A clip by norm leaves G at exactly the limit when it acts: below it (0.1 % for the run's rounding) it did
    # not, and the weights are compared as they are, not only in direction (the scale is the clip's only then).
    clipped = replay.max_grad_value is not None or (
        replay.max_grad_norm is not None and norm >= replay.max_grad_norm * (1 - _CLIP_ACTIVE_TOLERANCE)
    )
    if ranks is None:
        if not gradients:
            return None
        recovered = recover_weights(gradients, [p.grad for p in run_params])  # per parameter: nothing copied
        return witness(recovered, items, configured_n=configured_n, clipped=clipped)
    accumulated = _flat_gradient(run_params)
    if not _same_on_every_rank(ranks, accumulated):
        return None  # the ranks stepped different gradients (a sync left off): no one G to re-weight
    flat = [
        torch.cat([_zero_or(g, p).reshape(-1) for g, p in zip(pieces, run_params, strict=True)]) for pieces in gradients
    ]
    stack, counts, owners = _gathered(ranks, flat, items, accumulated.numel())
    if not owners:
        return None
    # each rank the Gram of its slice of the elements, the slices' sums reduced by the audit's all-reduce
    size = accumulated.numel()
    low, high = size * ranks.rank // ranks.world_size, size * (ranks.rank + 1) // ranks.world_size
    recovered = recover_weights([row[low:high] for row in stack], accumulated[low:high], all_reduce=ranks.all_reduce)
    return witness(recovered, counts.tolist(), configured_n=None, ranks=owners, clipped=clipped)

"""Clipping mistakes under tensor parallelism (``engine="tp"`` and ``"fsdp2+tp"``).

Under TP every rank of a TP group holds a shard of each parallelised weight
and a full copy of each replicated one (the row-wise layer's bias), as
DTensors.  The window's gradient norm must be taken over every shard of every
parameter, each replicated one counted once, and once per window:
``torch.nn.utils.clip_grad_norm_`` on the DTensor gradients does that (the
norm comes back replicated).  The steps here weight the micro-batches by
this rank's samples, which is right under TP (every TP rank sees the same
micro-batches) and under FSDP2+TP when the data ranks hold equal shards
(FSDP2's reduce-scatter averages them): only their clipping differs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from equiv.accumulator import accumulator_step
from equiv.batches import MicroBatches
from equiv.outcomes import Outcome
from equiv.zoo.bugs import _sample_weighted_backward, clip_per_micro_batch

__all__ = [
    "TP_ZOO",
    "TensorParallelEntry",
    "clip_dtensor_norm_once",
    "clip_tp_shard_with_local_norm",
    "clip_with_replicated_counted_per_rank",
]


def _local_gradients(model: nn.Module) -> list[Tensor]:
    return [
        p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in model.parameters() if p.grad is not None
    ]


def _clip_by(gradients: list[Tensor], max_grad_norm: float, norm: Tensor) -> None:
    torch._foreach_mul_(gradients, torch.clamp(max_grad_norm / (norm + 1e-6), max=1.0))


def clip_dtensor_norm_once(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: MicroBatches,
    loss_fn: Callable[..., Tensor],
    *,
    max_grad_norm: float | None = None,
) -> None:
    """Correct, for contrast: ``clip_grad_norm_`` on the DTensor gradients once per
    window (the norm over every shard of every parameter, replicated ones once)."""
    optimizer.zero_grad(set_to_none=True)
    _sample_weighted_backward(model, micro_batches, loss_fn)
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm, foreach=True)
    optimizer.step()


def clip_tp_shard_with_local_norm(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: MicroBatches,
    loss_fn: Callable[..., Tensor],
    *,
    max_grad_norm: float | None = None,
) -> None:
    """Clips each rank's gradient shards by the norm of those shards alone (the
    local tensors): TP ranks scale their shards by different coefficients, none
    of them the full-batch one (torchtune #2420: ``clip_grad_norm`` does not work
    with tensor parallelism)."""
    optimizer.zero_grad(set_to_none=True)
    _sample_weighted_backward(model, micro_batches, loss_fn)
    if max_grad_norm is not None:
        local = _local_gradients(model)
        _clip_by(local, max_grad_norm, torch.nn.utils.get_total_norm(local, 2.0))  # BUG: this rank's shards only
    optimizer.step()


def clip_with_replicated_counted_per_rank(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: MicroBatches,
    loss_fn: Callable[..., Tensor],
    *,
    max_grad_norm: float | None = None,
) -> None:
    """Sums every rank's local squared norm over all ranks: right for sharded
    gradients, but a gradient replicated on the T ranks of a TP group (the
    row-wise bias) counts T times, so the norm is too large and clipping fires
    too hard (NeMo RL PR #3788, "count TP-replicated gradients once")."""
    optimizer.zero_grad(set_to_none=True)
    _sample_weighted_backward(model, micro_batches, loss_fn)
    if max_grad_norm is not None:
        local = _local_gradients(model)
        squares = torch.nn.utils.get_total_norm(local, 2.0) ** 2
        dist.all_reduce(squares)  # BUG: replicated shards summed once per rank
        _clip_by(local, max_grad_norm, squares.sqrt())
    optimizer.step()


@dataclass(frozen=True, slots=True)
class TensorParallelEntry:
    """A step for the TP checks: what it must come to, and where its mistake was reported."""

    step: Callable[..., Any]
    expected: Outcome
    #: The upstream report it reproduces ("" for a correct step).
    upstream: str
    what: str


#: The TP zoo: each step checked under "tp" and "fsdp2+tp" with active clipping.
TP_ZOO: dict[str, TensorParallelEntry] = {
    "accumulator_step": TensorParallelEntry(accumulator_step, Outcome.EQUIVALENT, "", "the reference accumulator"),
    "clip_dtensor_norm_once": TensorParallelEntry(
        clip_dtensor_norm_once, Outcome.EQUIVALENT, "", "clip_grad_norm_ on the DTensor gradients, once per window"
    ),
    "clip_tp_shard_with_local_norm": TensorParallelEntry(
        clip_tp_shard_with_local_norm,
        Outcome.NOT_EQUIVALENT,
        "torchtune #2420",
        "each rank clips its shards by their own norm",
    ),
    "clip_with_replicated_counted_per_rank": TensorParallelEntry(
        clip_with_replicated_counted_per_rank,
        Outcome.NOT_EQUIVALENT,
        "NeMo RL PR #3788",
        "local squared norms summed over ranks: replicated gradients counted once per TP rank",
    ),
    "clip_per_micro_batch": TensorParallelEntry(
        clip_per_micro_batch,
        Outcome.NOT_EQUIVALENT,
        "transformers #986 / #1563",
        "the running DTensor gradient clipped after every micro-batch",
    ),
}

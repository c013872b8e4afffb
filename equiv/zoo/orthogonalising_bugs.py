"""Orthogonalising optimizers fed a gradient that is not yet the window's, under DDP.

``torch.optim.Muon`` replaces each weight matrix's momentum by its orthogonalised form (a
Newton-Schulz iteration): not linear in the gradient, so orthogonalising each rank's part and
averaging the results is not orthogonalising the average.  DeepSpeed #7807 (ZeRO-1/2 hand Muon a
reduce-scattered partition, orthogonalised before/without the whole matrix) and Megatron-LM PR
#6425 (the distributed optimizer's shards) are that class; here it is as a DDP user writes it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from equiv.batches import MicroBatches
from equiv.losses import item_count, loss_sum_and_count

__all__ = ["updates_averaged_over_ranks"]


def updates_averaged_over_ranks(
    model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: MicroBatches, loss_fn: Callable[..., Tensor]
) -> None:
    """Every micro-batch under ``no_sync`` (each rank's gradient never all-reduced), weighted
    correctly by the window's all-reduced item count; the optimizer steps on this rank's
    local gradient, then the parameters (so the updates: every rank starts a step from the
    same weights) are averaged over the ranks, as local-SGD recipes do.  Exact for SGD (linear
    in the gradient); under Muon each rank orthogonalises its own partial gradient, and the
    mean of orthogonalised parts is not the orthogonalised mean (DeepSpeed #7807, Megatron-LM PR #6425)."""
    assert isinstance(model, DistributedDataParallel)
    optimizer.zero_grad(set_to_none=True)
    items = torch.tensor(float(sum(item_count(loss_fn, targets) for _, targets in micro_batches)), dtype=torch.float64)
    dist.all_reduce(items)
    world = dist.get_world_size()
    scale = world / float(items)  # the rank's share of the window's mean, times W: the ranks' mean is the window's
    with model.no_sync():
        for inputs, targets in micro_batches:
            loss_sum, _ = loss_sum_and_count(loss_fn, model(inputs), targets)
            (loss_sum * scale).backward()
    optimizer.step()  # BUG under Muon: orthogonalises this rank's gradient, not the window's
    with torch.no_grad():
        for param in model.parameters():
            dist.all_reduce(param)
            param.div_(world)

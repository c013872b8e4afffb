"""Bugs that need several ranks or dynamic loss scaling to exist.

Like :mod:`equiv.zoo.bugs`, each follows the candidate contract and is wrong in one
way, named for it.  The DDP ones receive a ``DistributedDataParallel`` model
(see :mod:`equiv.checking.distributed`); the loss-scaling one a ``grad_scaler``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

__all__ = [
    "DISTRIBUTED_BUGS",
    "LOSS_SCALE_BUGS",
    "forward_outside_no_sync",
    "local_mean_per_rank",
    "no_sync_missing",
    "overflow_checked_on_last_micro_batch",
]

Batches = list[tuple[Tensor, Tensor]]


def _sample_weighted_backward(model: nn.Module, micro_batches: Batches, loss_fn: Callable[..., Tensor],
                              index: int, rank_samples: int) -> None:
    inputs, targets = micro_batches[index]
    (loss_fn(model(inputs), targets) * len(targets) / rank_samples).backward()


def local_mean_per_rank(model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: Batches,
                        loss_fn: Callable[..., Tensor]) -> None:
    """Each rank normalises by its OWN sample count and DDP averages the ranks:
    a mean of rank means, wrong whenever ranks hold different numbers of
    samples (the per-device normalisation behind transformers #34191)."""
    assert isinstance(model, DistributedDataParallel)
    optimizer.zero_grad(set_to_none=True)
    rank_samples = sum(len(targets) for _, targets in micro_batches)
    for index in range(len(micro_batches) - 1):
        with model.no_sync():
            _sample_weighted_backward(model, micro_batches, loss_fn, index, rank_samples)
    _sample_weighted_backward(model, micro_batches, loss_fn, len(micro_batches) - 1, rank_samples)
    optimizer.step()


def _global_weighted_step(model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: Batches,
                          loss_fn: Callable[..., Tensor], *, forward_in_no_sync: bool | None) -> None:
    """Correctly weighted by the global sample count (equal-shard assumption
    removed by an all-reduce of the count); ``forward_in_no_sync`` None: no
    no_sync at all; False: only the backward inside no_sync."""
    assert isinstance(model, DistributedDataParallel)
    optimizer.zero_grad(set_to_none=True)
    samples = torch.tensor(sum(len(targets) for _, targets in micro_batches), dtype=torch.float64)
    torch.distributed.all_reduce(samples)
    world = torch.distributed.get_world_size()
    for index, (inputs, targets) in enumerate(micro_batches):
        last = index == len(micro_batches) - 1
        scale = len(targets) * world / float(samples)
        if forward_in_no_sync is None or last:
            (loss_fn(model(inputs), targets) * scale).backward()
        else:
            output = model(inputs)  # DDP decides here, outside no_sync, that this backward all-reduces
            with model.no_sync():
                (loss_fn(output, targets) * scale).backward()
    optimizer.step()


def no_sync_missing(model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: Batches,
                    loss_fn: Callable[..., Tensor]) -> None:
    """Numerically right, but all-reduces after every micro-batch: N times the
    communication of a window (no ``no_sync``)."""
    _global_weighted_step(model, optimizer, micro_batches, loss_fn, forward_in_no_sync=None)


def forward_outside_no_sync(model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: Batches,
                            loss_fn: Callable[..., Tensor]) -> None:
    """``no_sync`` wraps only the backward, so DDP still all-reduces every
    micro-batch: it decides at forward time (accelerate #1726)."""
    _global_weighted_step(model, optimizer, micro_batches, loss_fn, forward_in_no_sync=False)


def overflow_checked_on_last_micro_batch(model: nn.Module, optimizer: torch.optim.Optimizer,
                                         micro_batches: Batches, loss_fn: Callable[..., Tensor], *,
                                         grad_scaler: torch.amp.GradScaler,
                                         max_grad_norm: float | None = None) -> None:
    """The overflow flag assigned instead of OR-accumulated (MindSpore r1.3's
    parallel-mode loss-scale tutorial ORs it over the window as ``accu_overflow``)
    (``overflow = this_micro_batch`` for ``accu_overflow |= ...``): a micro-batch
    that overflowed before the last is dropped, and the window steps on the
    rest instead of being skipped.  Correctly weighted otherwise."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer.zero_grad(set_to_none=True)
    total = sum(len(targets) for _, targets in micro_batches)
    sums = [torch.zeros_like(p) for p in params]
    overflow = False
    for inputs, targets in micro_batches:
        loss = loss_fn(model(inputs), targets) * len(targets) / total
        grads = torch.autograd.grad(grad_scaler.scale(loss), params)
        overflow = not all(bool(torch.isfinite(g).all()) for g in grads)  # BUG: '=' where the tutorial ORs
        if not overflow:
            torch._foreach_add_(sums, list(grads))
    for p, total_grad in zip(params, sums, strict=True):
        p.grad = total_grad
    if overflow:  # only the last micro-batch's flag decides
        p_grad = params[0].grad
        assert p_grad is not None
        p_grad.fill_(float("inf"))  # let GradScaler see the overflow it was told about
    grad_scaler.unscale_(optimizer)
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    grad_scaler.step(optimizer)
    grad_scaler.update()


#: name -> candidate, for suites and reports.
DISTRIBUTED_BUGS: dict[str, Callable[..., Any]] = {
    "local_mean_per_rank": local_mean_per_rank,
    "no_sync_missing": no_sync_missing,
    "forward_outside_no_sync": forward_outside_no_sync,
}
LOSS_SCALE_BUGS: dict[str, Callable[..., Any]] = {
    "overflow_checked_on_last_micro_batch": overflow_checked_on_last_micro_batch,
}

"""Candidates (steps following the public contract) that equiv ships as references.

``accumulator_step`` is the correct one, built on :class:`equiv.Accumulator`;
the known bugs live in :mod:`equiv.zoo`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from equiv.accumulator import Accumulator

__all__ = ["accumulator_step", "item_count", "loss_sum_and_count"]


def loss_sum_and_count(loss_fn: Callable[..., Tensor], output: Tensor, target: Tensor) -> tuple[Tensor, int | Tensor]:
    """The micro-batch's SUMMED loss and how many items it sums over.

    Uses ``loss_fn.sum`` / ``loss_fn.count`` when the loss offers them (every
    :mod:`equiv.losses` loss does); a plain mean loss is taken as a mean over
    samples: ``mean * samples``.
    """
    if hasattr(loss_fn, "sum") and hasattr(loss_fn, "count"):
        return loss_fn.sum(output, target), loss_fn.count(target)
    samples = int(target.shape[0])
    return loss_fn(output, target) * samples, samples


def item_count(loss_fn: Callable[..., Tensor], target: Tensor) -> int | Tensor:
    """How many items ``loss_fn`` averages over in ``target`` (samples for a plain mean loss)."""
    return loss_fn.count(target) if hasattr(loss_fn, "count") else int(target.shape[0])


def accumulator_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: list[tuple[Tensor, Tensor]],
    loss_fn: Callable[..., Tensor],
    *,
    max_grad_norm: float | None = None,
    scheduler: Any | None = None,
    grad_scaler: torch.amp.GradScaler | None = None,
) -> None:
    """The reference candidate: sum each micro-batch's loss, normalise once by
    the window's item count, clip once, step once (skipped for the whole
    window if dynamic loss scaling finds an overflow).  Works unchanged on
    one process and, given a ``DistributedDataParallel`` model, on many."""
    accumulator = Accumulator(
        model, optimizer, max_grad_norm=max_grad_norm, scheduler=scheduler, grad_scaler=grad_scaler
    )
    for index, (inputs, targets) in enumerate(micro_batches):
        # Under DDP: no_sync for all but the last micro-batch (forward included).
        with accumulator.micro_batch(last=index == len(micro_batches) - 1):
            loss_sum, items = loss_sum_and_count(loss_fn, model(inputs), targets)
            accumulator.backward(loss_sum, items=items)
    accumulator.step()

"""Accumulation steps that weight a model-provided MoE auxiliary loss wrongly.

They need a loss that hands the task and aux parts apart
(:class:`equiv.losses.MSEWithAux`, the ``"moe"`` model family); with any
other loss there is no aux loss to misweight, so they are not in
:data:`equiv.zoo.bugs.BUGS`, whose search draws every loss.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from equiv.batches import MicroBatches
from equiv.losses import MSEWithAux
from equiv.zoo.bugs import _clip_and_step  # one clip-then-step for every zoo

__all__ = ["MOE_BUGS", "aux_divided_by_micro_batches", "aux_loss_per_micro_batch"]


def _aux_loss(loss_fn: Callable[..., Tensor]) -> MSEWithAux:
    if not isinstance(loss_fn, MSEWithAux):
        raise TypeError(f"this step needs loss 'mse_aux' (the task and aux parts apart), got {loss_fn!r}")
    return loss_fn


def _backward_with_aux_weight(
    model: nn.Module, micro_batches: MicroBatches, loss_fn: Callable[..., Tensor], aux_weight: Callable[[int], float]
) -> None:
    """The task loss normalised over the window's samples (right), the aux loss
    of micro-batch k weighted by ``aux_weight(k)``."""
    loss = _aux_loss(loss_fn)
    samples = sum(int(targets.shape[0]) for _, targets in micro_batches)
    for index, (inputs, targets) in enumerate(micro_batches):
        output = model(inputs)
        (loss.task_sum(output, targets) / samples + aux_weight(index) * loss.aux_mean(output)).backward()


def aux_loss_per_micro_batch(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: MicroBatches,
    loss_fn: Callable[..., Tensor],
    *,
    max_grad_norm: float | None = None,
) -> None:
    """The task loss normalised for the whole window, but each micro-batch's
    aux loss added at full weight: with M micro-batches the aux gradient is
    M times too large (NeMo Automodel PR #3359)."""
    optimizer.zero_grad(set_to_none=True)
    _backward_with_aux_weight(model, micro_batches, loss_fn, lambda index: 1.0)
    _clip_and_step(model, optimizer, max_grad_norm)


def aux_divided_by_micro_batches(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: MicroBatches,
    loss_fn: Callable[..., Tensor],
    *,
    max_grad_norm: float | None = None,
) -> None:
    """Each micro-batch's aux loss divided by the micro-batch count M (the
    normalisation of NeMo Automodel PR #3359): exact when the micro-batches are
    equal, a mean of per-micro-batch means when they are not (a sequence-wise
    aux loss is a mean over samples, so micro-batch k weighs n_k / N)."""
    optimizer.zero_grad(set_to_none=True)
    _backward_with_aux_weight(model, micro_batches, loss_fn, lambda index: 1.0 / len(micro_batches))
    _clip_and_step(model, optimizer, max_grad_norm)


#: name -> step, for the MoE section of the report and its tests.
MOE_BUGS: dict[str, Callable[..., Any]] = {
    "aux_loss_per_micro_batch": aux_loss_per_micro_batch,
    "aux_divided_by_micro_batches": aux_divided_by_micro_batches,
}

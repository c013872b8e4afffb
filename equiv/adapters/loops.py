"""Hand-written loops: nanoGPT's, and equiv's own in torchtitan's style."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from equiv.batches import MicroBatches
from equiv.losses import item_count, loss_sum_and_count

__all__ = ["textbook_step", "torchtitan_step"]


def textbook_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: MicroBatches,
    loss_fn: Callable[..., Tensor],
    *,
    max_grad_norm: float | None = None,
) -> None:
    """nanoGPT's ``train.py`` loop: ``loss = loss / gradient_accumulation_steps``,
    backward per micro-batch, clip once, step, ``zero_grad(set_to_none=True)``.
    Exact for equal micro-batches of a sample mean; a mean of means otherwise.

    Args:
        model, optimizer: what the step trains (the candidate contract's).
        micro_batches: the window's ``(inputs, targets)`` pairs, in order.
        loss_fn: the loss (a mean over the micro-batch's items).
        max_grad_norm: clip the gradients' total norm to this once per step (None: no clipping).
    """
    steps = len(micro_batches)
    for inputs, targets in micro_batches:
        loss = loss_fn(model(inputs), targets)
        loss = loss / steps  # scale the loss to account for gradient accumulation
        loss.backward()
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def torchtitan_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: MicroBatches,
    loss_fn: Callable[..., Tensor],
    *,
    max_grad_norm: float | None = None,
) -> None:
    """equiv's own loop written in torchtitan's style (it calls equiv's
    ``item_count`` / ``loss_sum_and_count``, not torchtitan's code): count the
    window's valid items first (torchtitan's ``global_valid_tokens``), then each
    micro-batch's loss is its SUM over items divided by that global count, so
    no later rescaling is needed.  A reference point, not a peer.

    Args:
        model, optimizer: what the step trains (the candidate contract's).
        micro_batches: the window's ``(inputs, targets)`` pairs, in order.
        loss_fn: the loss (a mean over the micro-batch's items; its ``sum`` and ``count`` used when it offers them, as every :mod:`equiv.losses` loss does).
        max_grad_norm: clip the gradients' total norm to this once per step (None: no clipping).
    """
    optimizer.zero_grad(set_to_none=True)
    global_valid_items = sum(item_count(loss_fn, targets) for _, targets in micro_batches)
    for inputs, targets in micro_batches:
        loss_sum, _ = loss_sum_and_count(loss_fn, model(inputs), targets)
        # The returned loss here is local SUM loss / global_valid_tokens.
        (loss_sum / global_valid_items).backward()
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()

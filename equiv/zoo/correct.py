"""Correct accumulation steps written the way real training code writes them.

Each is the full-batch step in exact arithmetic, written with float32 tensors
inside equiv's float64 run: a tensor made in torch's default dtype, or float32
chosen on purpose.  Where that float32 reaches the gradient (the two in
:data:`FLOAT32_ON_THE_GRADIENT`) it costs nothing in float32, bfloat16 or
float16 training, so equiv must pass them with a precision note, and fail them
(class "precision") only for float64 training or strict precision; where it
only holds a forward value (a running loss in ``torch.zeros(1)``: backward
passes the gradient through the cast exactly) they are simply equivalent.  The
quality suites hold the search to that.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from equiv.batches import MicroBatches
from equiv.losses import item_count, loss_sum_and_count
from equiv.zoo.bugs import _buffered_step  # one buffered accumulation for both zoos

__all__ = [
    "CORRECT_STEPS",
    "FLOAT32_ON_THE_GRADIENT",
    "accumulates_into_zeros",
    "clips_in_float32",
    "float32_buffer",
    "scales_by_inverse_item_count",
]


def scales_by_inverse_item_count(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: MicroBatches,
    loss_fn: Callable[..., Tensor],
    *,
    max_grad_norm: float | None = None,
) -> None:
    """Backward of each micro-batch's summed loss, then the summed gradient scaled
    by ``1.0 / num_tokens`` where ``num_tokens`` is a tensor of counts (a
    fine-tuning recipe's normalisation): the quotient is in torch's default dtype."""
    optimizer.zero_grad(set_to_none=True)
    num_items = torch.tensor(0)
    for inputs, targets in micro_batches:
        loss_sum, count = loss_sum_and_count(loss_fn, model(inputs), targets)
        loss_sum.backward()
        num_items = num_items + count
    scale = 1.0 / num_items
    for param in model.parameters():
        if param.grad is not None:
            param.grad.mul_(scale)
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()


def accumulates_into_zeros(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: MicroBatches,
    loss_fn: Callable[..., Tensor],
    *,
    max_grad_norm: float | None = None,
) -> None:
    """Adds each micro-batch's weighted loss into ``torch.zeros(size=(1,))`` and
    calls backward once on the total (a trainer's running loss): the buffer is in
    the default dtype, and a 1-element tensor sets the dtype of the sum, so the
    loss value is float32; its gradient (1, then / total in the loss's dtype) is not."""
    optimizer.zero_grad(set_to_none=True)
    total = sum(item_count(loss_fn, targets) for _, targets in micro_batches)
    accumulated = torch.zeros(size=(1,))
    for inputs, targets in micro_batches:
        loss_sum, _ = loss_sum_and_count(loss_fn, model(inputs), targets)
        accumulated = accumulated + loss_sum / total
    accumulated.sum().backward()
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()


def clips_in_float32(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: MicroBatches,
    loss_fn: Callable[..., Tensor],
    *,
    max_grad_norm: float | None = None,
) -> None:
    """Correct weighting; the global gradient norm and the clip coefficient computed
    in float32 on purpose (code written for mixed-precision training)."""
    optimizer.zero_grad(set_to_none=True)
    total = sum(item_count(loss_fn, targets) for _, targets in micro_batches)
    for inputs, targets in micro_batches:
        loss_sum, _ = loss_sum_and_count(loss_fn, model(inputs), targets)
        (loss_sum / total).backward()
    if max_grad_norm is not None:
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.to(torch.float32)) for g in grads]))
        coefficient = torch.clamp(max_grad_norm / (norm + 1e-6), max=1.0)
        for grad in grads:
            grad.mul_(coefficient.to(grad.dtype))
    optimizer.step()


#: name -> a correct step that does some float32 arithmetic of its own.
def float32_buffer(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: MicroBatches,
    loss_fn: Callable[..., Tensor],
    *,
    max_grad_norm: float | None = None,
) -> None:
    """Accumulates the micro-batch gradients in a float32 buffer (``dtype=torch.float32``,
    as Megatron-FSDP's float32 main-grad buffers): exact in float32 training, float32-sized
    inside equiv's float64 run, the step :func:`equiv.zoo.bugs.low_precision_buffer` is told apart from."""
    _buffered_step(model, optimizer, micro_batches, loss_fn, torch.float32, max_grad_norm)


CORRECT_STEPS: dict[str, Callable[..., Any]] = {
    "scales_by_inverse_item_count": scales_by_inverse_item_count,
    "accumulates_into_zeros": accumulates_into_zeros,
    "clips_in_float32": clips_in_float32,
    "float32_buffer": float32_buffer,
}

#: The correct steps whose float32 arithmetic reaches the gradient: a precision note in float64 runs.
FLOAT32_ON_THE_GRADIENT: frozenset[str] = frozenset(
    {"scales_by_inverse_item_count", "clips_in_float32", "float32_buffer"}
)

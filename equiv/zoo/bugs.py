"""The bug zoo: accumulation steps with the mistakes people really made.

Each follows the candidate contract and is wrong in exactly one way, named for
it; the docstring cites where the bug was reported (upstream issue numbers).
The quality suites check that equiv finds every one of them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

__all__ = [
    "BUGS",
    "ITEM_WEIGHTED_BUGS",
    "clip_per_micro_batch",
    "counts_padding_tokens",
    "divides_twice",
    "drops_last_micro_batch",
    "leaks_gradients",
    "low_precision_buffer",
    "mean_of_means",
    "sample_weighted_token_loss",
    "scheduler_per_micro_batch",
    "step_per_micro_batch",
    "unscaled_sum",
    "zero_grad_inside_loop",
]

Batches = list[tuple[Tensor, Tensor]]


def unscaled_sum(model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: Batches,
                 loss_fn: Callable[..., Tensor], *, max_grad_norm: float | None = None) -> None:
    """Sums the micro-batch means without dividing by N (nanoGPT #168): N times
    the gradient; Adam absorbs it except through eps, clipping can mask it."""
    optimizer.zero_grad(set_to_none=True)
    for inputs, targets in micro_batches:
        loss_fn(model(inputs), targets).backward()
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()


def mean_of_means(model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: Batches,
                  loss_fn: Callable[..., Tensor], *, max_grad_norm: float | None = None) -> None:
    """The textbook ``loss / N``: exact for equal splits, a mean of means for
    uneven ones (short tail windows: Lightning #19987, transformers #38872)."""
    optimizer.zero_grad(set_to_none=True)
    for inputs, targets in micro_batches:
        (loss_fn(model(inputs), targets) / len(micro_batches)).backward()
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()


def clip_per_micro_batch(model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: Batches,
                         loss_fn: Callable[..., Tensor], *, max_grad_norm: float | None = None) -> None:
    """Clips the running gradient after every micro-batch instead of once
    (transformers #986, #1563).  Correctly weighted otherwise."""
    optimizer.zero_grad(set_to_none=True)
    total = sum(len(targets) for _, targets in micro_batches)
    for inputs, targets in micro_batches:
        (loss_fn(model(inputs), targets) * len(targets) / total).backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()


def leaks_gradients(model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: Batches,
                    loss_fn: Callable[..., Tensor], *, max_grad_norm: float | None = None) -> None:
    """Correctly weighted, but never clears ``.grad``: the next step starts
    from this step's gradient (a zero_grad forgotten after the step)."""
    total = sum(len(targets) for _, targets in micro_batches)
    for inputs, targets in micro_batches:
        (loss_fn(model(inputs), targets) * len(targets) / total).backward()
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()


def _sample_weighted_backward(model: nn.Module, micro_batches: Batches, loss_fn: Callable[..., Tensor]) -> None:
    """Backward of each micro-batch's mean weighted by its share of the samples:
    exact for sample-mean losses, the weighting the bugs below get right."""
    total = sum(len(targets) for _, targets in micro_batches)
    for inputs, targets in micro_batches:
        (loss_fn(model(inputs), targets) * len(targets) / total).backward()


def _clip_and_step(model: nn.Module, optimizer: torch.optim.Optimizer, max_grad_norm: float | None) -> None:
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()


def zero_grad_inside_loop(model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: Batches,
                          loss_fn: Callable[..., Tensor], *, max_grad_norm: float | None = None) -> None:
    """Calls ``zero_grad`` before every micro-batch's backward, so only the last
    micro-batch's gradient reaches the step (accumulation silently off)."""
    total = sum(len(targets) for _, targets in micro_batches)
    for inputs, targets in micro_batches:
        optimizer.zero_grad(set_to_none=True)
        (loss_fn(model(inputs), targets) * len(targets) / total).backward()
    _clip_and_step(model, optimizer, max_grad_norm)


def step_per_micro_batch(model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: Batches,
                         loss_fn: Callable[..., Tensor], *, max_grad_norm: float | None = None) -> None:
    """Steps the optimizer after every micro-batch (the accumulation boundary
    check forgotten): N small steps instead of one."""
    total = sum(len(targets) for _, targets in micro_batches)
    for inputs, targets in micro_batches:
        optimizer.zero_grad(set_to_none=True)
        (loss_fn(model(inputs), targets) * len(targets) / total).backward()
        _clip_and_step(model, optimizer, max_grad_norm)


def drops_last_micro_batch(model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: Batches,
                           loss_fn: Callable[..., Tensor], *, max_grad_norm: float | None = None) -> None:
    """An off-by-one in the window loop: the last micro-batch never contributes
    (normalised correctly over the ones used).  Exact for a single micro-batch."""
    used = micro_batches[:-1] or micro_batches
    optimizer.zero_grad(set_to_none=True)
    _sample_weighted_backward(model, used, loss_fn)
    _clip_and_step(model, optimizer, max_grad_norm)


def low_precision_buffer(model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: Batches,
                         loss_fn: Callable[..., Tensor], *, max_grad_norm: float | None = None) -> None:
    """Accumulates the micro-batch gradients in a bfloat16 buffer (to save
    memory) and steps on its sum: every gradient loses all but 8 bits."""
    total = sum(len(targets) for _, targets in micro_batches)
    params = [p for p in model.parameters() if p.requires_grad]
    buffers = [torch.zeros_like(p, dtype=torch.bfloat16) for p in params]
    for inputs, targets in micro_batches:
        optimizer.zero_grad(set_to_none=True)
        (loss_fn(model(inputs), targets) * len(targets) / total).backward()
        for param, buffer in zip(params, buffers, strict=True):
            if param.grad is not None:
                buffer += param.grad.to(torch.bfloat16)
    for param, buffer in zip(params, buffers, strict=True):
        param.grad = buffer.to(param.dtype)
    _clip_and_step(model, optimizer, max_grad_norm)


def divides_twice(model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: Batches,
                  loss_fn: Callable[..., Tensor], *, max_grad_norm: float | None = None) -> None:
    """Weights each micro-batch correctly, then divides by N once more (the
    user's ``loss / N`` on top of a library that already scales: accelerate
    #3533, transformers #40052).  Exact for one micro-batch."""
    optimizer.zero_grad(set_to_none=True)
    _sample_weighted_backward(model, micro_batches, loss_fn)
    with torch.no_grad():
        for param in model.parameters():
            if param.grad is not None:
                param.grad /= len(micro_batches)
    _clip_and_step(model, optimizer, max_grad_norm)


def scheduler_per_micro_batch(model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: Batches,
                              loss_fn: Callable[..., Tensor], *, max_grad_norm: float | None = None,
                              scheduler: Any | None = None) -> None:
    """Correct accumulation, but the LR scheduler is stepped once per
    micro-batch instead of once per optimizer step (Lightning #1476): the
    learning rate decays N times too fast from the second step on."""
    optimizer.zero_grad(set_to_none=True)
    _sample_weighted_backward(model, micro_batches, loss_fn)
    _clip_and_step(model, optimizer, max_grad_norm)
    if scheduler is not None:
        for _ in micro_batches:
            scheduler.step()


def sample_weighted_token_loss(model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: Batches,
                               loss_fn: Callable[..., Tensor], *, max_grad_norm: float | None = None) -> None:
    """Weights each micro-batch's token mean by its share of the SAMPLES, which
    is right for sample losses and wrong for token losses whose micro-batches
    hold different numbers of real tokens (transformers #34191, #34198)."""
    optimizer.zero_grad(set_to_none=True)
    _sample_weighted_backward(model, micro_batches, loss_fn)
    _clip_and_step(model, optimizer, max_grad_norm)


def counts_padding_tokens(model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: Batches,
                          loss_fn: Any, *, max_grad_norm: float | None = None) -> None:
    """Sums the loss over the window and divides by the number of target
    entries, padding included (miscounting the items, transformers #22082):
    right for MSE and per-sample cross-entropy, wrong whenever tokens are padded."""
    optimizer.zero_grad(set_to_none=True)
    entries = sum(targets.numel() for _, targets in micro_batches)
    for inputs, targets in micro_batches:
        (loss_fn.sum(model(inputs), targets) / entries).backward()
    _clip_and_step(model, optimizer, max_grad_norm)


#: name -> candidate, for suites and reports.
BUGS: dict[str, Callable[..., Any]] = {
    "unscaled_sum": unscaled_sum,
    "mean_of_means": mean_of_means,
    "clip_per_micro_batch": clip_per_micro_batch,
    "leaks_gradients": leaks_gradients,
    "zero_grad_inside_loop": zero_grad_inside_loop,
    "step_per_micro_batch": step_per_micro_batch,
    "drops_last_micro_batch": drops_last_micro_batch,
    "low_precision_buffer": low_precision_buffer,
    "divides_twice": divides_twice,
    "scheduler_per_micro_batch": scheduler_per_micro_batch,
    "sample_weighted_token_loss": sample_weighted_token_loss,
    "counts_padding_tokens": counts_padding_tokens,
}

#: The bugs that only an item-weighted (token) loss exposes: exact for sample-mean losses.
ITEM_WEIGHTED_BUGS: frozenset[str] = frozenset({"sample_weighted_token_loss", "counts_padding_tokens"})

"""The bug zoo: accumulation steps with the mistakes people really made.

Each follows the candidate contract and is wrong in exactly one way, named for
it; the docstring cites where the bug was reported (see ../shared/FACTS.md).
The quality suites check that equiv finds every one of them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["BUGS", "clip_per_micro_batch", "leaks_gradients", "mean_of_means", "unscaled_sum"]

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


#: name -> candidate, for suites and reports.
BUGS: dict[str, Callable[..., Any]] = {
    "unscaled_sum": unscaled_sum,
    "mean_of_means": mean_of_means,
    "clip_per_micro_batch": clip_per_micro_batch,
    "leaks_gradients": leaks_gradients,
}

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

from equiv.batches import MicroBatches
from equiv.losses import item_count, loss_sum_and_count

__all__ = [
    "BLIND_SPOT_BUGS",
    "BUGS",
    "GRAD_SCALER_BUGS",
    "ITEM_WEIGHTED_BUGS",
    "STATE_ACROSS_CALLS_BUGS",
    "caches_item_count",
    "clip_per_micro_batch",
    "clips_before_unscaling",
    "clips_first_group_only",
    "clips_only_trained_groups",
    "counts_padding_tokens",
    "decay_per_micro_batch",
    "divides_twice",
    "drops_last_micro_batch",
    "eight_slot_buffer",
    "forget_item_count",
    "leaks_gradients",
    "low_precision_buffer",
    "mean_of_means",
    "no_grad_through_frozen",
    "sample_weighted_token_loss",
    "scheduler_per_micro_batch",
    "scheduler_steps_on_skipped_window",
    "skips_overflowing_micro_batch",
    "step_per_micro_batch",
    "unscaled_sum",
    "unscales_twice",
    "zero_grad_inside_loop",
    "zero_grads_for_frozen",
]


def unscaled_sum(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: MicroBatches,
    loss_fn: Callable[..., Tensor],
    *,
    max_grad_norm: float | None = None,
) -> None:
    """Sums the micro-batch means without dividing by N (nanoGPT #168): N times
    the gradient; Adam absorbs it except through eps, clipping can mask it."""
    optimizer.zero_grad(set_to_none=True)
    for inputs, targets in micro_batches:
        loss_fn(model(inputs), targets).backward()
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()


def mean_of_means(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: MicroBatches,
    loss_fn: Callable[..., Tensor],
    *,
    max_grad_norm: float | None = None,
) -> None:
    """The textbook ``loss / N``: exact for equal splits, a mean of means for
    uneven ones (short tail windows: Lightning #19987, transformers #38872)."""
    optimizer.zero_grad(set_to_none=True)
    for inputs, targets in micro_batches:
        (loss_fn(model(inputs), targets) / len(micro_batches)).backward()
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()


def clip_per_micro_batch(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: MicroBatches,
    loss_fn: Callable[..., Tensor],
    *,
    max_grad_norm: float | None = None,
) -> None:
    """Clips the running gradient after every micro-batch instead of once
    (transformers #986, #1563).  Correctly weighted otherwise."""
    optimizer.zero_grad(set_to_none=True)
    total = sum(len(targets) for _, targets in micro_batches)
    for inputs, targets in micro_batches:
        (loss_fn(model(inputs), targets) * len(targets) / total).backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()


def leaks_gradients(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: MicroBatches,
    loss_fn: Callable[..., Tensor],
    *,
    max_grad_norm: float | None = None,
) -> None:
    """Correctly weighted, but never clears ``.grad``: the next step starts
    from this step's gradient (a zero_grad forgotten after the step)."""
    total = sum(len(targets) for _, targets in micro_batches)
    for inputs, targets in micro_batches:
        (loss_fn(model(inputs), targets) * len(targets) / total).backward()
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()


def _sample_weighted_backward(model: nn.Module, micro_batches: MicroBatches, loss_fn: Callable[..., Tensor]) -> None:
    """Backward of each micro-batch's mean weighted by its share of the samples:
    exact for sample-mean losses, the weighting the bugs below get right."""
    total = sum(len(targets) for _, targets in micro_batches)
    for inputs, targets in micro_batches:
        (loss_fn(model(inputs), targets) * len(targets) / total).backward()


def _clip_and_step(model: nn.Module, optimizer: torch.optim.Optimizer, max_grad_norm: float | None) -> None:
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()


def zero_grad_inside_loop(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: MicroBatches,
    loss_fn: Callable[..., Tensor],
    *,
    max_grad_norm: float | None = None,
) -> None:
    """Calls ``zero_grad`` before every micro-batch's backward, so only the last
    micro-batch's gradient reaches the step (accumulation silently off)."""
    total = sum(len(targets) for _, targets in micro_batches)
    for inputs, targets in micro_batches:
        optimizer.zero_grad(set_to_none=True)
        (loss_fn(model(inputs), targets) * len(targets) / total).backward()
    _clip_and_step(model, optimizer, max_grad_norm)


def step_per_micro_batch(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: MicroBatches,
    loss_fn: Callable[..., Tensor],
    *,
    max_grad_norm: float | None = None,
) -> None:
    """Steps the optimizer after every micro-batch (the accumulation boundary
    check forgotten): N small steps instead of one."""
    total = sum(len(targets) for _, targets in micro_batches)
    for inputs, targets in micro_batches:
        optimizer.zero_grad(set_to_none=True)
        (loss_fn(model(inputs), targets) * len(targets) / total).backward()
        _clip_and_step(model, optimizer, max_grad_norm)


def drops_last_micro_batch(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: MicroBatches,
    loss_fn: Callable[..., Tensor],
    *,
    max_grad_norm: float | None = None,
) -> None:
    """An off-by-one in the window loop: the last micro-batch never contributes
    (normalised correctly over the ones used).  Exact for a single micro-batch."""
    used = micro_batches[:-1] or micro_batches
    optimizer.zero_grad(set_to_none=True)
    _sample_weighted_backward(model, used, loss_fn)
    _clip_and_step(model, optimizer, max_grad_norm)


def _buffered_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: MicroBatches,
    loss_fn: Callable[..., Tensor],
    buffer_dtype: torch.dtype,
    max_grad_norm: float | None,
) -> None:
    """Item-weighted micro-batch gradients (each micro-batch's summed loss over the
    window's items) summed in a buffer of ``buffer_dtype``, then the step on the
    buffer (what a memory-saving accumulation does)."""
    total = sum(item_count(loss_fn, targets) for _, targets in micro_batches)
    params = [p for p in model.parameters() if p.requires_grad]
    buffers = [torch.zeros_like(p, dtype=buffer_dtype) for p in params]
    for inputs, targets in micro_batches:
        optimizer.zero_grad(set_to_none=True)
        (loss_sum_and_count(loss_fn, model(inputs), targets)[0] / total).backward()
        for param, buffer in zip(params, buffers, strict=True):
            if param.grad is not None:
                buffer += param.grad.to(buffer_dtype)
    for param, buffer in zip(params, buffers, strict=True):
        param.grad = buffer.to(param.dtype)
    _clip_and_step(model, optimizer, max_grad_norm)


def low_precision_buffer(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: MicroBatches,
    loss_fn: Callable[..., Tensor],
    *,
    max_grad_norm: float | None = None,
) -> None:
    """Accumulates the micro-batch gradients in a bfloat16 buffer (to save
    memory) and steps on its sum: every gradient loses all but 8 bits (bf16
    accumulation at 3.5e-5 relative where float32 buffers agree to 2.7e-8,
    Megatron-FSDP, ISEEKYAN #149).  A precision finding, not a mathematical
    mismatch: it fails float32 training, passes bfloat16 training."""
    _buffered_step(model, optimizer, micro_batches, loss_fn, torch.bfloat16, max_grad_norm)


def divides_twice(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: MicroBatches,
    loss_fn: Callable[..., Tensor],
    *,
    max_grad_norm: float | None = None,
) -> None:
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


def scheduler_per_micro_batch(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: MicroBatches,
    loss_fn: Callable[..., Tensor],
    *,
    max_grad_norm: float | None = None,
    scheduler: Any | None = None,
) -> None:
    """Correct accumulation, but the LR scheduler is stepped once per
    micro-batch instead of once per optimizer step (Lightning #1476): the
    learning rate decays N times too fast from the second step on."""
    optimizer.zero_grad(set_to_none=True)
    _sample_weighted_backward(model, micro_batches, loss_fn)
    _clip_and_step(model, optimizer, max_grad_norm)
    if scheduler is not None:
        for _ in micro_batches:
            scheduler.step()


def sample_weighted_token_loss(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: MicroBatches,
    loss_fn: Callable[..., Tensor],
    *,
    max_grad_norm: float | None = None,
) -> None:
    """Weights each micro-batch's token mean by its share of the SAMPLES, which
    is right for sample losses and wrong for token losses whose micro-batches
    hold different numbers of real tokens (transformers #34191, #34198)."""
    optimizer.zero_grad(set_to_none=True)
    _sample_weighted_backward(model, micro_batches, loss_fn)
    _clip_and_step(model, optimizer, max_grad_norm)


def counts_padding_tokens(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: MicroBatches,
    loss_fn: Any,
    *,
    max_grad_norm: float | None = None,
) -> None:
    """Sums the loss over the window and divides by the number of target
    entries, padding included (miscounting the items, transformers #22082):
    right for MSE and per-sample cross-entropy, wrong whenever tokens are padded."""
    optimizer.zero_grad(set_to_none=True)
    entries = sum(targets.numel() for _, targets in micro_batches)
    for inputs, targets in micro_batches:
        (loss_fn.sum(model(inputs), targets) / entries).backward()
    _clip_and_step(model, optimizer, max_grad_norm)


# --------------------------------------------------------------------------
# Bugs that only the settings people run at scale expose: more than 8
# micro-batches, several parameter groups, frozen layers, coupled weight decay.
# Each is item-weighted (exact for token losses too), clips once and steps a
# scheduler once, so it is exact wherever its own setting is absent.


def _step_once(
    model: nn.Module, optimizer: torch.optim.Optimizer, max_grad_norm: float | None, scheduler: Any | None
) -> None:
    _clip_and_step(model, optimizer, max_grad_norm)
    if scheduler is not None:
        scheduler.step()


def eight_slot_buffer(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: MicroBatches,
    loss_fn: Callable[..., Tensor],
    *,
    max_grad_norm: float | None = None,
    scheduler: Any | None = None,
) -> None:
    """Keeps each micro-batch's gradient in a preallocated ring of 8 slots (to
    look at per-micro-batch gradients, e.g. their noise scale, sized for the
    accumulation counts "anyone uses") and steps on the slots' sum: from the
    9th micro-batch on, slot ``i % 8`` is overwritten, so the first N - 8
    micro-batches are lost while the item count still covers all of them.
    Exact for N <= 8; no upstream issue, a fixed capacity nobody checks
    against N (a search capped at 6 micro-batches never sees it)."""
    slots = 8
    params = [p for p in model.parameters() if p.requires_grad]
    buffer: list[list[Tensor | None] | None] = [None] * slots
    items: int | Tensor = 0
    for index, (inputs, targets) in enumerate(micro_batches):
        optimizer.zero_grad(set_to_none=True)
        loss_sum, count = loss_sum_and_count(loss_fn, model(inputs), targets)
        loss_sum.backward()
        items = items + count
        buffer[index % slots] = [None if p.grad is None else p.grad.detach().clone() for p in params]
    with torch.no_grad():
        for position, param in enumerate(params):
            grads = [grad for slot in buffer if slot is not None and (grad := slot[position]) is not None]
            if not grads:
                param.grad = None
                continue
            total = grads[0].clone()
            for grad in grads[1:]:  # in micro-batch order, as .grad accumulates
                total += grad
            param.grad = total / (items.to(total.dtype) if isinstance(items, Tensor) else float(items))
    _step_once(model, optimizer, max_grad_norm, scheduler)


def _item_weighted_backward(
    model: nn.Module, micro_batches: MicroBatches, loss_fn: Callable[..., Tensor], *, total: int | Tensor | None = None
) -> None:
    """Backward of each micro-batch's summed loss over the window's item count
    (counted up front): the full batch's mean, for sample and token losses.
    ``total``: divide by this count instead (a bug's)."""
    if total is None:
        total = sum(item_count(loss_fn, targets) for _, targets in micro_batches)
    for inputs, targets in micro_batches:
        loss_sum, _ = loss_sum_and_count(loss_fn, model(inputs), targets)
        (loss_sum / total).backward()


def clips_first_group_only(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: MicroBatches,
    loss_fn: Callable[..., Tensor],
    *,
    max_grad_norm: float | None = None,
    scheduler: Any | None = None,
) -> None:
    """Clips ``optimizer.param_groups[0]["params"]``, code written when the
    optimizer had one group: with two (no weight decay on biases and norms, or
    a head at its own lr) the first group is clipped by its own norm and the
    second not at all.  Exact with one group.  The per-group cousin, clipping
    each group by its own norm instead of the global one: transformers #581
    (fixed in #614)."""
    optimizer.zero_grad(set_to_none=True)
    _item_weighted_backward(model, micro_batches, loss_fn)
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(optimizer.param_groups[0]["params"], max_grad_norm)
    optimizer.step()
    if scheduler is not None:
        scheduler.step()


def clips_only_trained_groups(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: MicroBatches,
    loss_fn: Callable[..., Tensor],
    *,
    max_grad_norm: float | None = None,
    scheduler: Any | None = None,
) -> None:
    """Clips by the norm of the groups that train (``lr > 0``), skipping a group
    parked at ``lr = 0`` whose parameters still require grad: their gradients
    still count in the full batch's global norm (``clip_grad_norm_(model.parameters())``),
    so every other gradient is clipped by too small a norm.  Exact with no parked
    group or no active clip; code that builds the clip list from "the parameters
    being optimised" (a layer warmed up later, a frozen-by-lr embedding)."""
    optimizer.zero_grad(set_to_none=True)
    _item_weighted_backward(model, micro_batches, loss_fn)
    if max_grad_norm is not None:
        trained = [p for group in optimizer.param_groups if group["lr"] > 0 for p in group["params"]]
        torch.nn.utils.clip_grad_norm_(trained, max_grad_norm)
    optimizer.step()
    if scheduler is not None:
        scheduler.step()


def no_grad_through_frozen(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: MicroBatches,
    loss_fn: Callable[..., Tensor],
    *,
    max_grad_norm: float | None = None,
    scheduler: Any | None = None,
) -> None:
    """Runs the layers whose parameters are all frozen under ``torch.no_grad()``
    to save activation memory, layer by layer through an ``nn.Sequential``: right
    for a frozen bottom (nothing below needs a gradient), but a frozen layer with
    trainable layers below it cuts their gradient off, so they never train.
    Exact when only the first layers are frozen (or none); models that are not
    an ``nn.Sequential`` run whole."""
    total = sum(item_count(loss_fn, targets) for _, targets in micro_batches)
    optimizer.zero_grad(set_to_none=True)
    for inputs, targets in micro_batches:
        if isinstance(model, nn.Sequential):
            hidden = inputs
            for layer in model:
                params = list(layer.parameters())
                if params and not any(p.requires_grad for p in params):
                    with torch.no_grad():
                        hidden = layer(hidden)
                else:
                    hidden = layer(hidden)
            output = hidden
        else:
            output = model(inputs)
        loss_sum, _ = loss_sum_and_count(loss_fn, output, targets)
        if loss_sum.requires_grad:  # everything below the head frozen and run without grad: nothing to do
            (loss_sum / total).backward()
    _step_once(model, optimizer, max_grad_norm, scheduler)


def zero_grads_for_frozen(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: MicroBatches,
    loss_fn: Callable[..., Tensor],
    *,
    max_grad_norm: float | None = None,
    scheduler: Any | None = None,
) -> None:
    """Accumulates into its own buffers, allocated for ``model.parameters()``
    (frozen ones too) and handed to the optimizer as ``.grad``: a frozen
    parameter gets an all-zero gradient instead of None, and an optimizer steps
    every parameter that has a gradient, so weight decay shrinks it and
    stateful optimizers start state for it.  Exact when nothing is frozen.
    Frozen weights that still move: fairseq #4702, pytorch #150610,
    S-Prompts #2; all-zero gradients feeding optimizer state:
    curated-transformers #69."""
    params = list(model.parameters())
    buffers = [torch.zeros_like(p) for p in params]
    items: int | Tensor = 0
    for inputs, targets in micro_batches:
        optimizer.zero_grad(set_to_none=True)
        loss_sum, count = loss_sum_and_count(loss_fn, model(inputs), targets)
        loss_sum.backward()
        items = items + count
        with torch.no_grad():
            for param, buffer in zip(params, buffers, strict=True):
                if param.grad is not None:
                    buffer += param.grad
    with torch.no_grad():
        for param, buffer in zip(params, buffers, strict=True):
            param.grad = buffer / (items.to(buffer.dtype) if isinstance(items, Tensor) else float(items))
    _step_once(model, optimizer, max_grad_norm, scheduler)


def _decay_is_coupled(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> bool:
    """Whether the group's weight decay is an L2 term in the gradient (SGD,
    Adam, ...), not a decoupled shrink of the weights (AdamW, Adafactor)."""
    return not group.get("decoupled_weight_decay", False) and not isinstance(optimizer, torch.optim.Adafactor)


def decay_per_micro_batch(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: MicroBatches,
    loss_fn: Callable[..., Tensor],
    *,
    scheduler: Any | None = None,
) -> None:
    """Applies coupled weight decay itself, as a gradient hook
    ``p.register_hook(lambda g: g + wd * p)`` per parameter, with the
    optimizer's own ``weight_decay`` set to 0 for the step: for SGD and Adam
    that is the same L2 term, but a hook fires on every backward, so N
    micro-batches add it N times (as Keras applied decay at every accumulation
    step: keras #19990).  Exact for one micro-batch; leaves decoupled decay
    (AdamW) to the optimizer.  Takes no ``max_grad_norm``: an L2 term in the
    gradient is clipped with it, another regulariser than the optimizer's
    decay even for one micro-batch, so clipping cases are not its to answer."""
    optimizer.zero_grad(set_to_none=True)
    hooks = []
    saved: list[tuple[dict[str, Any], float]] = []
    for group in optimizer.param_groups:
        decay = group.get("weight_decay", 0.0)
        if not decay or not _decay_is_coupled(optimizer, group):
            continue
        saved.append((group, decay))
        group["weight_decay"] = 0.0
        for param in group["params"]:
            if param.requires_grad:
                hooks.append(
                    param.register_hook(lambda grad, param=param, decay=decay: grad.add(param.detach(), alpha=decay))
                )
    try:
        _item_weighted_backward(model, micro_batches, loss_fn)
    finally:
        for hook in hooks:
            hook.remove()
    try:
        optimizer.step()
    finally:
        for group, decay in saved:
            group["weight_decay"] = decay
    if scheduler is not None:
        scheduler.step()


# --------------------------------------------------------------------------
# Dynamic loss scaling (torch.amp.GradScaler) across a window, each bug against
# the rules of PyTorch's AMP examples (docs/source/notes/amp_examples.rst:
# "Gradient accumulation", "Working with unscaled gradients"): scale every
# micro-batch's loss, unscale once after the window's last backward, clip the
# unscaled gradient, skip the whole window if any micro-batch overflowed and
# update the scale once per window.  Each takes a ``grad_scaler`` and is exact
# without the setting that exposes it (so, without a grad_scaler, it is the
# correct item-weighted step).


def _scaled_backward(
    model: nn.Module,
    micro_batches: MicroBatches,
    loss_fn: Callable[..., Tensor],
    grad_scaler: torch.amp.GradScaler | None,
) -> None:
    """Each micro-batch's summed loss over the window's item count, scaled if a scaler is given."""
    total = sum(item_count(loss_fn, targets) for _, targets in micro_batches)
    for inputs, targets in micro_batches:
        loss_sum, _ = loss_sum_and_count(loss_fn, model(inputs), targets)
        loss = loss_sum / total
        (grad_scaler.scale(loss) if grad_scaler is not None else loss).backward()


def _scaled_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    max_grad_norm: float | None,
    scheduler: Any | None,
    grad_scaler: torch.amp.GradScaler | None,
    unscale: bool = True,
    scheduler_on_skip: bool = False,
) -> None:
    """The window's end as the AMP examples write it: unscale, clip, step (skipped
    on an overflow), update once, and step the scheduler only if the optimizer
    stepped.  ``unscale=False``: clip before GradScaler has unscaled (its step()
    unscales afterwards); ``scheduler_on_skip``: step the scheduler regardless."""
    if grad_scaler is None:
        _step_once(model, optimizer, max_grad_norm, scheduler)
        return
    if unscale:
        grad_scaler.unscale_(optimizer)
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    scale_before = grad_scaler.get_scale()
    grad_scaler.step(optimizer)
    grad_scaler.update()
    # GradScaler lowers the scale exactly when it found inf/nan and skipped the step.
    stepped = grad_scaler.get_scale() >= scale_before
    if scheduler is not None and (stepped or scheduler_on_skip):
        scheduler.step()


def unscales_twice(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: MicroBatches,
    loss_fn: Callable[..., Tensor],
    *,
    max_grad_norm: float | None = None,
    scheduler: Any | None = None,
    grad_scaler: torch.amp.GradScaler | None = None,
) -> None:
    """Unscales the gradients by hand (``p.grad /= scaler.get_scale()``, to clip
    or log the true gradient) and then lets ``grad_scaler.step`` unscale them
    again, which it does whenever ``unscale_`` was not called: the update is
    the gradient over scale squared.  The AMP examples allow one unscale per
    step ("unscale_ should only be called once per optimizer per step()");
    dividing by hand is the way round that check.  Exact without a grad_scaler."""
    optimizer.zero_grad(set_to_none=True)
    _scaled_backward(model, micro_batches, loss_fn, grad_scaler)
    if grad_scaler is not None:
        with torch.no_grad():
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            torch._foreach_div_(grads, grad_scaler.get_scale())
    _scaled_step(
        model, optimizer, max_grad_norm=max_grad_norm, scheduler=scheduler, grad_scaler=grad_scaler, unscale=False
    )


def clips_before_unscaling(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: MicroBatches,
    loss_fn: Callable[..., Tensor],
    *,
    max_grad_norm: float | None = None,
    scheduler: Any | None = None,
    grad_scaler: torch.amp.GradScaler | None = None,
) -> None:
    """Clips the SCALED gradient (no ``grad_scaler.unscale_(optimizer)`` before
    ``clip_grad_norm_``), so the clip norm is compared with scale x the norm
    and the update, unscaled by ``step()`` afterwards, is clipped to
    ``max_grad_norm / scale`` (the AMP examples' "Gradient clipping" says to
    unscale first).  Exact without clipping or without a grad_scaler."""
    optimizer.zero_grad(set_to_none=True)
    _scaled_backward(model, micro_batches, loss_fn, grad_scaler)
    _scaled_step(
        model, optimizer, max_grad_norm=max_grad_norm, scheduler=scheduler, grad_scaler=grad_scaler, unscale=False
    )


def skips_overflowing_micro_batch(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: MicroBatches,
    loss_fn: Callable[..., Tensor],
    *,
    max_grad_norm: float | None = None,
    scheduler: Any | None = None,
    grad_scaler: torch.amp.GradScaler | None = None,
) -> None:
    """Checks each micro-batch's gradient for inf/nan as it comes and drops the
    micro-batch that overflowed ("skip the bad batch"), then steps on the rest:
    overflow is judged per micro-batch instead of over the window, so a window
    the full batch skips is stepped, and the scale is never backed off (the
    scaler never sees the inf).  Exact when nothing overflows."""
    optimizer.zero_grad(set_to_none=True)
    params = [p for p in model.parameters() if p.requires_grad]
    total = sum(item_count(loss_fn, targets) for _, targets in micro_batches)
    sums: list[Tensor | None] = [None] * len(params)
    for inputs, targets in micro_batches:
        loss_sum, _ = loss_sum_and_count(loss_fn, model(inputs), targets)
        loss = loss_sum / total
        grads = torch.autograd.grad(
            grad_scaler.scale(loss) if grad_scaler is not None else loss, params, allow_unused=True
        )
        if not all(bool(torch.isfinite(g).all()) for g in grads if g is not None):
            continue  # BUG: the window should be skipped as a whole, and the scaler told
        sums = [g if s is None else (s if g is None else s + g) for s, g in zip(sums, grads, strict=True)]
    if all(grad is None for grad in sums):
        return  # every micro-batch dropped: nothing to step on (and GradScaler.step() needs a gradient)
    for param, grad in zip(params, sums, strict=True):
        param.grad = grad
    _scaled_step(model, optimizer, max_grad_norm=max_grad_norm, scheduler=scheduler, grad_scaler=grad_scaler)


def scheduler_steps_on_skipped_window(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: MicroBatches,
    loss_fn: Callable[..., Tensor],
    *,
    max_grad_norm: float | None = None,
    scheduler: Any | None = None,
    grad_scaler: torch.amp.GradScaler | None = None,
) -> None:
    """Steps the LR scheduler after every window, also one that GradScaler
    skipped for an overflow (torch warns "Detected call of lr_scheduler.step()
    before optimizer.step()" only on the first): the schedule runs one step
    ahead of the updates from then on.  Exact when no window overflows."""
    optimizer.zero_grad(set_to_none=True)
    _scaled_backward(model, micro_batches, loss_fn, grad_scaler)
    _scaled_step(
        model,
        optimizer,
        max_grad_norm=max_grad_norm,
        scheduler=scheduler,
        grad_scaler=grad_scaler,
        scheduler_on_skip=True,
    )


# --------------------------------------------------------------------------
# A bug whose verdict depends on the calls before it: kept out of BUGS, whose
# verdicts are pinned per case and tabulated (they would depend on which test
# or report section ran first in the process).

#: caches_item_count's module-level cache: the item count of its first window.
_FIRST_ITEM_COUNT: list[int | Tensor] = []


def caches_item_count(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: MicroBatches,
    loss_fn: Callable[..., Tensor],
    *,
    max_grad_norm: float | None = None,
    scheduler: Any | None = None,
) -> None:
    """Counts the window's items once, on its first call, and keeps the count
    in a module-level cache for every later call (the items per window
    "never change", so why count them again): each micro-batch's summed loss
    over that count.  Exact for every window as large as the first one it
    saw, so exact for any one case checked alone (its windows all have the
    same size); a later case with another batch size is scaled by the wrong
    count.  State kept across calls, like a normaliser computed once on the
    first batch; no upstream issue cited: it stands for the whole class that
    ``equiv.verify`` reports as failing "only after earlier calls"."""
    if not _FIRST_ITEM_COUNT:
        _FIRST_ITEM_COUNT.append(sum(item_count(loss_fn, targets) for _, targets in micro_batches))
    optimizer.zero_grad(set_to_none=True)
    _item_weighted_backward(model, micro_batches, loss_fn, total=_FIRST_ITEM_COUNT[0])
    _step_once(model, optimizer, max_grad_norm, scheduler)


def forget_item_count() -> None:
    """Empty :func:`caches_item_count`'s cache, as a fresh process would have it."""
    _FIRST_ITEM_COUNT.clear()


#: Bugs that keep state across calls (see above), by name: not in BUGS.
STATE_ACROSS_CALLS_BUGS: dict[str, Callable[..., Any]] = {"caches_item_count": caches_item_count}


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
    "eight_slot_buffer": eight_slot_buffer,
    "clips_first_group_only": clips_first_group_only,
    "zero_grads_for_frozen": zero_grads_for_frozen,
    "decay_per_micro_batch": decay_per_micro_batch,
    "clips_only_trained_groups": clips_only_trained_groups,
    "no_grad_through_frozen": no_grad_through_frozen,
    "unscales_twice": unscales_twice,
    "clips_before_unscaling": clips_before_unscaling,
    "skips_overflowing_micro_batch": skips_overflowing_micro_batch,
    "scheduler_steps_on_skipped_window": scheduler_steps_on_skipped_window,
}

#: The bugs that only an item-weighted (token) loss exposes: exact for sample-mean losses.
ITEM_WEIGHTED_BUGS: frozenset[str] = frozenset({"sample_weighted_token_loss", "counts_padding_tokens"})

#: The bugs that only a setting the search could not draw before exposes, each
#: exact without it: more than 8 micro-batches, two parameter groups (with
#: active clipping), a group parked at lr = 0 under active clipping, frozen
#: layers (a middle one, for no_grad_through_frozen), coupled weight decay over
#: several micro-batches.
BLIND_SPOT_BUGS: frozenset[str] = frozenset(
    {
        "eight_slot_buffer",
        "clips_first_group_only",
        "zero_grads_for_frozen",
        "decay_per_micro_batch",
        "clips_only_trained_groups",
        "no_grad_through_frozen",
    }
)

#: The bugs that only dynamic loss scaling exposes (a step given a
#: ``grad_scaler``), each exact without its setting: a loss scale at all, one
#: with active clipping, a window that overflows (with a scheduler).
GRAD_SCALER_BUGS: frozenset[str] = frozenset(
    {"unscales_twice", "clips_before_unscaling", "skips_overflowing_micro_batch", "scheduler_steps_on_skipped_window"}
)

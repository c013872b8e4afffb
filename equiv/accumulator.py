"""The reference accumulator: gradient accumulation that equals the full-batch step.

Invariant kept across a window of micro-batches::

    accumulated gradient == d/dθ  Σ_over_window  loss_sum(micro_batch)

and at ``step()`` it is divided ONCE by the window's total item count, so the
update equals the one computed from ``Σ loss / Σ items`` over the concatenated
batch, whatever the micro-batch sizes and whatever an "item" is (a sample, a
non-padding token).  Dividing each micro-batch by a count known up front (the
textbook ``loss / N``) is exact only for equal splits of a sample mean; this
class never needs the total before the window closes.

Everything stays on the parameters' device.  Item counts given as tensors are
summed on the device, so no micro-step reads a value back to the host; the
only host reads are once per window (GradScaler's skip decision, and the
zero-count check for tensor counts).

Under data parallelism (DDP, or FSDP2's ``fully_shard``) the invariant holds
for the sum over every rank's micro-batches and the count is all-reduced once
per window, so ranks holding different numbers of items still normalise by the
global total.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from equiv.batches import MicroBatches
from equiv.losses import loss_sum_and_count

__all__ = ["Accumulator", "WindowResult", "accumulator_step"]


@dataclass(frozen=True, slots=True)
class WindowResult:
    """What one ``Accumulator.step()`` did for the window it closed."""

    micro_batches: int
    #: Total items the window was normalised by (int, or a 0-d tensor on the device).
    items: int | Tensor
    #: Gradient norm before clipping (0-d tensor), when clipping was asked for.
    grad_norm: Tensor | None
    #: False when dynamic loss scaling found inf/nan and skipped the whole window.
    stepped: bool


class Accumulator:
    """Accumulate gradients over uneven micro-batches and step once per window.

    Usage, one window (= one optimizer step)::

        acc = Accumulator(model, optimizer, max_grad_norm=1.0)
        for inputs, targets in micro_batches:
            loss_sum = loss_fn_sum(model(inputs), targets)   # SUM, not mean
            acc.backward(loss_sum, items=len(targets))
        acc.step()            # normalise once, clip once, step, clear

    Under ``DistributedDataParallel`` pass the DDP module and wrap each
    micro-batch's forward and backward in ``with acc.micro_batch(last=...)``:
    all but the last run under ``no_sync``, so gradients are all-reduced once
    per window, and ``step()`` all-reduces the item count once, so ranks
    holding different numbers of samples or items still normalise by the
    global total.

    Under FSDP2 pass the root module ``fully_shard`` returned and use the same
    ``micro_batch(last=...)`` context: all but the last micro-batch run with
    ``set_requires_gradient_sync(False)``, so each FSDP unit reduce-scatters
    once per window (holding unsharded gradients in between: the memory that
    buys), gradients are the DTensor shards, and clipping uses the global norm
    over all shards.  The Accumulator makes the model's FSDP units *sum*
    gradients over ranks (``set_gradient_divide_factor(1.0)`` with
    ``set_force_sum_reduction_for_comms(True)``; FSDP divides by the world size
    by default) and divides once by the global item count itself.

    Args:
        params: a module (a ``DistributedDataParallel`` one, or an FSDP2 root
            module, too) or an iterable of parameters (all on one device).
        optimizer: stepped once per window.
        scheduler: an LR scheduler stepped once per window that updated
            (not on windows skipped for overflow).
        max_grad_norm: clip the accumulated, normalised gradient to this norm
            once per window (``None``: no clipping).
        norm_type: the norm used for clipping.
        grad_scaler: a ``torch.amp.GradScaler``; the loss is scaled per
            micro-batch, and if any micro-batch produced inf/nan the whole
            window is skipped and the scale updated once.  Because the
            micro-batch losses are SUMS, scaled gradients inside the backward
            are larger than under the full batch's mean (by up to the window's
            item count), so a naturally overflowing float16 scale is reached
            that much sooner and the scaler settles lower; the skip decision
            then differs from the full-batch run's while it calibrates.
            Overflows that come from the data (inf/nan) skip identically.
        accumulate_dtype: accumulate in this dtype (e.g. ``torch.float32`` for
            bfloat16 parameters).  ``None`` or the parameters' own dtype
            accumulates in ``.grad`` with no second copy.
    """

    def __init__(
        self,
        params: nn.Module | Iterable[nn.Parameter],
        optimizer: torch.optim.Optimizer,
        *,
        scheduler: Any | None = None,
        max_grad_norm: float | None = None,
        norm_type: float = 2.0,
        grad_scaler: torch.amp.GradScaler | None = None,
        accumulate_dtype: torch.dtype | None = None,
    ) -> None:
        self.ddp = params if isinstance(params, DistributedDataParallel) else None
        self.fsdp = params if isinstance(params, FSDPModule) else None
        self.params: list[nn.Parameter] = _trainable_parameters(params)
        widening = self._check_options(
            max_grad_norm=max_grad_norm, grad_scaler=grad_scaler, accumulate_dtype=accumulate_dtype
        )
        #: Under FSDP2: the group the window's item count is summed over.
        self._group: dist.ProcessGroup | None = (
            self._prepare_fsdp(self.fsdp, widening=widening, grad_scaler=grad_scaler) if self.fsdp is not None else None
        )
        self.device = self.params[0].device
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.max_grad_norm = max_grad_norm
        self.norm_type = norm_type
        self.grad_scaler = grad_scaler
        # A wider buffer only where a parameter is narrower than accumulate_dtype:
        # otherwise .grad itself is the accumulator (no second copy).
        self._buffered: list[nn.Parameter] = [
            p
            for p in self.params
            if accumulate_dtype is not None and torch.finfo(accumulate_dtype).bits > torch.finfo(p.dtype).bits
        ]
        self._buffers: list[Tensor] = [
            torch.zeros_like(p, dtype=accumulate_dtype, memory_format=torch.preserve_format) for p in self._buffered
        ]
        self._micro_batches = 0
        self._items: int | Tensor = 0

    # ------------------------------------------------------------------ window
    @property
    def buffer_bytes(self) -> int:
        """Bytes of the wide accumulation buffers (0 when ``.grad`` is the accumulator)."""
        return sum(buf.numel() * buf.element_size() for buf in self._buffers)

    @property
    def micro_batches(self) -> int:
        """Micro-batches accumulated in the open window."""
        return self._micro_batches

    @contextlib.contextmanager
    def micro_batch(self, *, last: bool) -> Iterator[None]:
        """Wrap one micro-batch's forward AND backward.

        Under DDP every micro-batch but the last runs in ``no_sync()``: DDP
        decides at forward time whether the backward all-reduces, so the
        forward must be inside (accelerate #1726).  Under FSDP2 every
        micro-batch but the last runs with ``set_requires_gradient_sync(False)``
        (FSDP1's ``no_sync``), which FSDP2 reads in the backward; sync is
        switched back on when the block ends.  Otherwise it does nothing.
        """
        if self.ddp is not None and not last:
            with self.ddp.no_sync():
                yield
        elif self.fsdp is not None:
            self.fsdp.set_requires_gradient_sync(last)
            try:
                yield
            finally:
                # FSDP2's default; a plain backward() outside this block syncs.
                self.fsdp.set_requires_gradient_sync(True)
        else:
            yield

    def backward(self, loss_sum: Tensor, *, items: int | Tensor) -> None:
        """Add one micro-batch: back-propagate its SUMMED loss, count its items.

        ``items`` is how many items ``loss_sum`` sums over (samples, or tokens
        that are not padding).  A tensor count stays on the device.
        """
        if loss_sum.dim() != 0:
            raise ValueError(
                f"loss_sum must be a scalar (0-d) tensor, got shape {tuple(loss_sum.shape)}; "
                "reduce it with .sum() over the micro-batch"
            )
        if isinstance(items, Tensor):
            # Integer counts only: a float32 running count is inexact past 2**24.
            if items.dim() != 0 or items.is_floating_point() or items.dtype == torch.bool:
                raise ValueError(
                    f"items must be a 0-d integer tensor, got dtype {items.dtype} shape {tuple(items.shape)}"
                )
            items = items.to(self.device, non_blocking=True)
        elif isinstance(items, bool) or not isinstance(items, int):
            raise TypeError(f"items must be an int or a 0-d integer tensor, got {items!r}")
        elif items < 0:
            raise ValueError(f"items must be >= 0, got {items}")

        if self._micro_batches == 0:
            stale = [i for i, p in enumerate(self.params) if p.grad is not None]
            if stale:
                # Gradients from before the window would be summed into it.
                raise RuntimeError(
                    f"{len(stale)} parameter(s) (first: index {stale[0]}) already hold gradients at the start of "
                    "a window; clear them with optimizer.zero_grad(set_to_none=True) before the first backward()"
                )
        scaled = self.grad_scaler.scale(loss_sum) if self.grad_scaler is not None else loss_sum
        scaled.backward()
        if self._buffers:
            self._drain_grads_into_buffers()
        self._items = self._items + items
        self._micro_batches += 1

    def step(self) -> WindowResult:
        """Close the window: normalise by its total items, clip, step, clear."""
        if self._micro_batches == 0:
            raise RuntimeError("step() called with no micro-batch since the last step; call backward() first")
        micro_batches = self._micro_batches
        items, accumulated = self._window_total(micro_batches)
        grad_norm = self._normalise_and_clip(accumulated, items)
        # The optimizer reads .grad: the wide buffers go back in the parameters' dtype, rounded once.
        for p, buf in zip(self._buffered, self._buffers, strict=True):
            p.grad = buf.to(p.dtype)
        stepped = self._step_optimizer()
        self._clear()
        return WindowResult(micro_batches=micro_batches, items=items, grad_norm=grad_norm, stepped=stepped)

    # ----------------------------------------------------------------- helpers
    def _window_total(self, micro_batches: int) -> tuple[int | Tensor, list[Tensor]]:
        """The window's item count over every rank (refused when 0) and the tensors holding its gradient
        sums, with DDP's averaging over ranks undone."""
        items = self._items
        accumulated = self._accumulated()
        if self.ddp is not None:
            items, accumulated = self._synchronise_count(items, accumulated)
        elif self.fsdp is not None:
            if not accumulated:
                # FSDP2 leaves the sharded .grad unset until a backward syncs.
                raise RuntimeError(
                    f"no parameter holds a gradient after the window's {micro_batches} micro-batches: under FSDP2 "
                    "the last micro-batch's backward must run with gradient sync on "
                    "(acc.micro_batch(last=True), or model.set_requires_gradient_sync(True) before it)"
                )
            # The FSDP units summed the gradients over ranks (set up in
            # __init__): only the count is left to add up, once per window.
            items = torch.as_tensor(items, device=self.device, dtype=torch.int64).clone()
            dist.all_reduce(items, op=dist.ReduceOp.SUM, group=self._group)
        # For a tensor count this is the window's one host read (never per micro-step).
        if int(items) == 0:
            raise ValueError(
                f"the window's {micro_batches} micro-batches hold 0 items in total; nothing to normalise by"
            )

        return items, accumulated

    def _normalise_and_clip(self, accumulated: list[Tensor], items: int | Tensor) -> Tensor | None:
        """Divide the gradient sums by the window's item count once, unscale them, and clip them once;
        the norm before clipping (None without clipping)."""
        if accumulated:
            # Divide by the count itself rather than multiply by a rounded
            # reciprocal: the same operation a mean reduction performs.
            divisor = items.to(accumulated[0].dtype) if isinstance(items, Tensor) else float(items)
            torch._foreach_div_(accumulated, divisor)
        if self.grad_scaler is not None:
            self.grad_scaler.unscale_(self.optimizer)
        if self.max_grad_norm is None:
            return None
        # Once per window, on the accumulated gradient, in the accumulation dtype.
        # Under FSDP2 the tensors are DTensor shards: get_total_norm reduces
        # the shards' norms over ranks (the global norm, as
        # torch.nn.utils.clip_grad_norm_ does on DTensors) and returns a
        # replicated DTensor, so every rank scales its shard by one coefficient.
        grad_norm = torch.nn.utils.get_total_norm(accumulated, self.norm_type, foreach=True)
        # torch.nn.utils.clip_grad_norm_'s formula, applied to the accumulated
        # tensors (it only reaches p.grad, not wide buffers); the clamp keeps
        # it free of a host sync.
        clip_coef = torch.clamp(self.max_grad_norm / (grad_norm + 1e-6), max=1.0)
        torch._foreach_mul_(accumulated, clip_coef)
        if isinstance(grad_norm, DTensor):
            grad_norm = grad_norm.full_tensor()  # replicated: no communication
        return grad_norm

    def _step_optimizer(self) -> bool:
        """Step the optimizer (through the grad scaler, if any) and the scheduler; False when the scaler
        found inf/nan and skipped the window."""
        stepped = True
        if self.grad_scaler is not None:
            scale_before = self.grad_scaler.get_scale()
            self.grad_scaler.step(self.optimizer)  # skips the step if any micro-batch overflowed
            self.grad_scaler.update()
            # GradScaler lowers the scale exactly when it found inf/nan and skipped.
            stepped = self.grad_scaler.get_scale() >= scale_before
        else:
            self.optimizer.step()
        if self.scheduler is not None and stepped:
            self.scheduler.step()
        return stepped

    def _check_options(
        self,
        *,
        max_grad_norm: float | None,
        grad_scaler: torch.amp.GradScaler | None,
        accumulate_dtype: torch.dtype | None,
    ) -> bool:
        """Refuse options that cannot work together; return whether ``accumulate_dtype`` widens a
        parameter (a wide buffer is then kept beside ``.grad``)."""
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be a positive number or None, got {max_grad_norm!r}")
        if accumulate_dtype is not None and not accumulate_dtype.is_floating_point:
            raise ValueError(f"accumulate_dtype must be a floating dtype, got {accumulate_dtype}")
        widening = accumulate_dtype is not None and any(
            torch.finfo(accumulate_dtype).bits > torch.finfo(p.dtype).bits for p in self.params
        )
        if grad_scaler is not None and widening:
            # PyTorch forbids a .grad of another dtype, so GradScaler could not
            # see wide buffers.  The AMP recipe keeps float32 parameters
            # (autocast lowers only the activations), which needs no buffer.
            raise ValueError(
                f"grad_scaler with accumulate_dtype={accumulate_dtype} wider than the parameters is not supported; "
                "keep float32 parameters under torch.autocast (no wider buffer needed)"
            )
        if self.ddp is not None and widening:
            # DDP all-reduces .grad; a wide buffer drained after each micro-batch
            # would keep the earlier micro-batches' sums out of that all-reduce.
            raise ValueError(
                f"accumulate_dtype={accumulate_dtype} wider than the parameters is not supported under "
                "DistributedDataParallel; accumulate in the parameters' dtype"
            )
        return widening

    def _synchronise_count(self, items: int | Tensor, accumulated: list[Tensor]) -> tuple[Tensor, list[Tensor]]:
        """The global item count (one all-reduce per window), and the gradient
        sums with DDP's averaging over ranks undone."""
        assert self.ddp is not None
        group = self.ddp.process_group
        total = torch.as_tensor(items, device=self.device, dtype=torch.int64).clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
        # DDP divided each rank's sum by the world size before summing; multiply
        # back (exact for a power-of-two world size) so the division by the
        # global count below is the only normalisation.
        if accumulated:
            torch._foreach_mul_(accumulated, float(dist.get_world_size(group)))
        return total, accumulated

    def _prepare_fsdp(
        self, root: FSDPModule, *, widening: bool, grad_scaler: torch.amp.GradScaler | None
    ) -> dist.ProcessGroup:
        """Check the FSDP2 set-up, make its units sum gradients, and return the
        process group the item count is summed over."""
        if widening:
            # FSDP2 reduce-scatters from its own unsharded gradients; a wide
            # buffer drained from the sharded .grad would see only the last sync.
            raise ValueError(
                "accumulate_dtype wider than the parameters is not supported under FSDP2 (fully_shard); "
                "accumulate in the parameters' dtype, or set MixedPrecisionPolicy(reduce_dtype=...)"
            )
        if grad_scaler is not None:
            # torch.amp.GradScaler looks for inf/nan in this rank's shard only:
            # ranks could disagree on skipping the window.
            raise ValueError(
                "grad_scaler is not supported under FSDP2 (fully_shard): torch.amp.GradScaler checks only this "
                "rank's gradient shard for inf/nan, so ranks could disagree on skipping a window"
            )
        meshes = {p.device_mesh for p in self.params if isinstance(p, DTensor)}
        if len(meshes) != 1 or next(iter(meshes)).ndim > 2:
            shapes = sorted(str(tuple(m.shape)) for m in meshes)
            raise ValueError(
                "Accumulator under FSDP2 needs every parameter sharded on one device mesh, 1-D (FSDP2) or 2-D "
                f"(FSDP2 over tensor parallel), got meshes {shapes}"
            )
        units = [m for m in cast(nn.Module, root).modules() if isinstance(m, FSDPModule)]
        missing = [
            name
            for name in ("set_gradient_divide_factor", "set_force_sum_reduction_for_comms")
            if not hasattr(units[0], name)
        ]
        if missing:
            raise RuntimeError(
                f"Accumulator under FSDP2 needs FSDPModule.{missing[0]} (torch {torch.__version__} has none)"
            )
        for unit in units:
            # FSDP2 divides by the world size by default; summing instead leaves
            # the division by the global item count as the only normalisation
            # (exact for any world size; multiplying an average back by W=3 is
            # not).  Forcing SUM: with a factor of 1 FSDP would otherwise ask for
            # PREMUL_SUM, which gloo lacks.
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)
        # FSDP2 over tensor parallel shards on the outer mesh dimension (the
        # data ranks; it requires TP inside): the TP ranks of one data rank see
        # the same items, so the count is summed over the data ranks only.
        return next(iter(meshes)).get_group(0)

    def _accumulated(self) -> list[Tensor]:
        """The tensors holding the window's gradient sums (buffers, then plain .grad)."""
        buffered = {id(p) for p in self._buffered}
        plain = [p.grad for p in self.params if id(p) not in buffered and p.grad is not None]
        return self._buffers + plain

    def _drain_grads_into_buffers(self) -> None:
        grads, bufs = [], []
        for p, buf in zip(self._buffered, self._buffers, strict=True):
            if p.grad is not None:
                grads.append(p.grad)
                bufs.append(buf)
                p.grad = None
        if grads:
            torch._foreach_add_(bufs, grads)

    def _clear(self) -> None:
        for p in self.params:
            p.grad = None
        if self._buffers:
            torch._foreach_zero_(self._buffers)
        self._micro_batches = 0
        self._items = 0


def _trainable_parameters(params: nn.Module | Iterable[nn.Parameter]) -> list[nn.Parameter]:
    """The parameters that train (``requires_grad``), refused when there are none or they span devices."""
    params_list = list(params.parameters() if isinstance(params, nn.Module) else params)
    trainable = [p for p in params_list if p.requires_grad]
    if not trainable:
        raise ValueError("Accumulator needs at least one parameter with requires_grad=True, got none")
    devices = sorted({str(p.device) for p in trainable})
    if len(devices) > 1:
        raise ValueError(
            f"parameters must all be on one device so the window's state can live there, got parameters on {devices}"
        )
    return trainable


def accumulator_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: MicroBatches,
    loss_fn: Callable[..., Tensor],
    *,
    max_grad_norm: float | None = None,
    scheduler: Any | None = None,
    grad_scaler: torch.amp.GradScaler | None = None,
) -> None:
    """The reference candidate: sum each micro-batch's loss, normalise once by
    the window's item count, clip once, step once (skipped for the whole
    window if dynamic loss scaling finds an overflow).  Works unchanged on
    one process and, given a ``DistributedDataParallel`` model or an FSDP2
    (``fully_shard``) root module, on many.

    Args:
        model, optimizer: what one optimizer step trains.
        micro_batches: the window's ``(inputs, targets)`` pieces, in order; sizes may differ.
        loss_fn: the micro-batch's mean loss; its ``sum`` and ``count`` (an :class:`equiv.Loss`)
            when items are weighted (tokens that are not padding).
        max_grad_norm: clip the window's total gradient norm to this once (None: no clipping).
        scheduler: stepped once per optimizer step (not on a skipped window).
        grad_scaler: dynamic loss scaling; an overflow anywhere skips the whole window.

    Returns:
        None: the model and optimizer are updated in place.
    """
    accumulator = Accumulator(
        model, optimizer, max_grad_norm=max_grad_norm, scheduler=scheduler, grad_scaler=grad_scaler
    )
    for index, (inputs, targets) in enumerate(micro_batches):
        # Under DDP: no_sync for all but the last micro-batch (forward included);
        # under FSDP2: gradient sync off for all but the last.
        with accumulator.micro_batch(last=index == len(micro_batches) - 1):
            loss_sum, items = loss_sum_and_count(loss_fn, model(inputs), targets)
            accumulator.backward(loss_sum, items=items)
    accumulator.step()

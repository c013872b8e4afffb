"""Peak memory of one optimizer step, split into its two phases, measured deterministically.

A training step has two memory peaks that different things set:

* the **forward/backward peak** (``accumulate`` phase): live activations of one
  micro-batch, plus gradient temporaries on top of the existing ``.grad``;
  it shrinks as the micro-batch shrinks;
* the **optimizer-step peak** (``update`` phase): parameters, gradients and
  optimizer state, plus the optimizer's temporaries (Adam's can dominate for a
  parameter-heavy model); it does not depend on the micro-batch at all.

Accumulation only ever lowers the first, so both are reported.

On CPU the figure comes from :class:`StorageCounter`, a ``TorchDispatchMode``
that adds up the bytes of every live tensor storage (weakref finalizers
subtract them when the storage dies).  It sees exactly the tensors PyTorch
allocates, in program order, so the same step gives the byte-identical figure
on every run and in every process.  The process's RSS or ``tracemalloc`` do
not (RSS drifts by tens of MiB, ``tracemalloc`` does not see torch's
allocator).  Allocations a kernel makes and frees internally are not visible;
neither are tensors the step does not reach from ``roots`` before it starts.

On CUDA the figure is the caching allocator's own peak
(``torch.cuda.max_memory_allocated``), reset at each phase start, with the
device synchronised before each read so queued kernels are counted.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["StepMemory", "StorageCounter", "measure_step_memory", "training_state_tensors"]

#: How each device's figures are obtained (recorded next to every figure).
METHOD_STORAGE_COUNTER = "storage-counter"
METHOD_CUDA_ALLOCATOR = "cuda-allocator"


@dataclass(frozen=True, slots=True, kw_only=True)
class StepMemory:
    """Peak bytes of one optimizer step, by phase (all figures in bytes)."""

    device: str
    #: "storage-counter" (CPU, deterministic) or "cuda-allocator".
    method: str
    #: Live before the step: parameters, buffers, gradients, optimizer state, the batch.
    baseline_bytes: int
    #: Peak while the micro-batches run forward and backward.
    forward_backward_peak_bytes: int
    #: Peak while the optimizer steps (and gradients are cleared).
    optimizer_step_peak_bytes: int

    @property
    def peak_bytes(self) -> int:
        """The whole step's peak: what must fit on the device."""
        return max(self.forward_backward_peak_bytes, self.optimizer_step_peak_bytes)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "peak_bytes": self.peak_bytes}


class StorageCounter(TorchDispatchMode):
    """Count the bytes of live tensor storages, and their peak per phase.

    Every tensor an operator returns is recorded by its storage (views share
    one, so they count once); a weakref finalizer takes the storage's bytes
    off again when PyTorch frees it.  Tensors that exist before the mode is
    entered are only counted if passed to :meth:`track`.

    Usage::

        with StorageCounter() as counter:
            counter.track(training_state_tensors(model, optimizer))
            with counter.phase("forward_backward"):
                ...
        counter.phase_peak_bytes["forward_backward"]
    """

    def __init__(self) -> None:
        super().__init__()
        #: storage key -> bytes counted for it.
        self._bytes_by_storage: dict[int, int] = {}
        self._finalizers: list[weakref.finalize] = []
        self.live_bytes = 0
        self.peak_bytes = 0
        self.phase_peak_bytes: dict[str, int] = {}
        self._phase: str | None = None

    # -------------------------------------------------------------- counting
    def track(self, tensors: Iterable[Tensor]) -> None:
        """Count tensors that already exist (parameters, state, inputs)."""
        for tensor in tensors:
            self._record(tensor)
        self._update_peaks()

    def _record(self, tensor: Tensor) -> None:
        if not isinstance(tensor, Tensor) or tensor.is_meta:
            return
        storage = tensor.untyped_storage()
        key = storage._cdata  # the StorageImpl's address: unique while it lives
        nbytes = storage.nbytes()
        known = self._bytes_by_storage.get(key)
        if known is None:
            self._bytes_by_storage[key] = nbytes
            self.live_bytes += nbytes
            # PyTorch keeps one Python object per storage alive as long as the
            # storage itself, so its finalizer runs exactly when the memory goes.
            self._finalizers.append(weakref.finalize(storage, self._forget, key))
        elif known != nbytes:  # resized in place (out= variants, resize_)
            self._bytes_by_storage[key] = nbytes
            self.live_bytes += nbytes - known

    def _forget(self, key: int) -> None:
        self.live_bytes -= self._bytes_by_storage.pop(key, 0)

    def _update_peaks(self) -> None:
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        if self._phase is not None:
            self.phase_peak_bytes[self._phase] = max(self.phase_peak_bytes[self._phase], self.live_bytes)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        leaves, _ = tree_flatten(out)
        for leaf in leaves:
            if isinstance(leaf, Tensor):
                self._record(leaf)
        self._update_peaks()
        return out

    # ---------------------------------------------------------------- phases
    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Record the peak of the code inside under ``name``; it starts at the
        bytes already live, so a phase's peak includes what it inherits."""
        if self._phase is not None:
            raise RuntimeError(f"phase {name!r} opened inside phase {self._phase!r}; phases do not nest")
        self._phase = name
        self.phase_peak_bytes[name] = self.live_bytes
        try:
            yield
        finally:
            self._phase = None

    def __exit__(self, *exc: object) -> Any:
        result = super().__exit__(*exc)
        # Storages that outlive the measurement must not call back into it.
        for finalizer in self._finalizers:
            finalizer.detach()
        self._finalizers.clear()
        return result


def training_state_tensors(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> list[Tensor]:
    """Every tensor a training step starts from: parameters, buffers, their
    gradients and the optimizer's state."""
    tensors: list[Tensor] = [*model.parameters(), *model.buffers()]
    tensors += [p.grad for p in model.parameters() if p.grad is not None]
    if optimizer is not None:
        for state in optimizer.state.values():
            tensors += [value for value in state.values() if isinstance(value, Tensor)]
    return tensors


def measure_step_memory(
    accumulate: Callable[[], None],
    update: Callable[[], None],
    *,
    roots: Iterable[Tensor],
    device: torch.device | str = "cpu",
    counter: StorageCounter | None = None,
) -> StepMemory:
    """Run one step, ``accumulate()`` (every micro-batch forward and backward)
    then ``update()`` (optimizer step, gradients cleared), and return its peaks.

    ``roots`` are the tensors alive before the step that it uses (see
    :func:`training_state_tensors`, plus the batch); on CPU only these and what
    the step allocates are counted.  Run a warm-up step first so lazily
    created optimizer state is part of the baseline, as in steady training.
    ``counter``: the storage counter to count with on the CPU (a subclass,
    e.g. one that understands sharded tensors); a plain one by default.
    """
    device = torch.device(device)
    roots = list(roots)
    # Cyclic garbage freed by a collection in the middle of the step would make
    # the figure depend on when gc happens to run; refcounting alone is deterministic.
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        if device.type == "cuda":
            return _measure_cuda(accumulate, update, roots, device)
        if device.type != "cpu":
            raise ValueError(f"device must be 'cpu' or 'cuda[:index]', got {str(device)!r}")
        counter = counter if counter is not None else StorageCounter()
        with counter:
            counter.track(roots)
            baseline_bytes = counter.live_bytes
            with counter.phase("forward_backward"):
                accumulate()
            with counter.phase("optimizer_step"):
                update()
        return StepMemory(
            device=str(device),
            method=METHOD_STORAGE_COUNTER,
            baseline_bytes=baseline_bytes,
            forward_backward_peak_bytes=counter.phase_peak_bytes["forward_backward"],
            optimizer_step_peak_bytes=counter.phase_peak_bytes["optimizer_step"],
        )
    finally:
        if was_enabled:
            gc.enable()


def _measure_cuda(
    accumulate: Callable[[], None], update: Callable[[], None], roots: list[Tensor], device: torch.device
) -> StepMemory:
    if not torch.cuda.is_available():
        raise RuntimeError(f"device {str(device)!r} asked for, but torch.cuda.is_available() is False")
    del roots  # the allocator already knows everything live on the device

    def phase_peak(fn: Callable[[], None]) -> int:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)  # kernels still queued have not allocated yet
        return int(torch.cuda.max_memory_allocated(device))

    torch.cuda.synchronize(device)
    baseline_bytes = int(torch.cuda.memory_allocated(device))
    forward_backward = phase_peak(accumulate)
    optimizer_step = phase_peak(update)
    return StepMemory(
        device=str(device),
        method=METHOD_CUDA_ALLOCATOR,
        baseline_bytes=baseline_bytes,
        forward_backward_peak_bytes=forward_backward,
        optimizer_step_peak_bytes=optimizer_step,
    )

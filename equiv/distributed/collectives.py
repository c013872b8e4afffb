"""Counted collectives: how many gradient syncs a step made, and how many bytes.

One place for the counting the distributed checker (reduce-scatters and
all-reduces per optimizer step) and the FSDP2 cost sweep (reduce-scatters and
all-gathers per step, inside a memory measurement) both need.

- :class:`CollectiveCounts`: calls and bytes per step (``start_step`` opens
  the next one).
- :class:`CountingReduceScatter` / :class:`CountingAllGather`: FSDP2's default
  collectives (``torch.empty`` buffers, one ``reduce_scatter_single`` /
  ``all_gather_single``), counted; handed to ``FSDPModule.set_custom_reduce_scatter``
  / ``set_custom_all_gather``.
- :meth:`CollectiveCounts.allreduce_hook`: a DDP comm hook, the default
  all-reduce (or the step's own hook, chained), counted.
- :meth:`CollectiveCounts.counting`: an engine's own method (DeepSpeed's
  ``engine.backward`` and ``engine.step``), every ``torch.distributed``
  collective made inside it counted as the engine's.
- :class:`StepCollectives`: the collectives a step makes itself (a token count
  all-reduced, a gradient synced by hand), per step, apart from the gradient
  syncs counted above.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

# The interfaces FSDPModule.set_custom_all_gather / set_custom_reduce_scatter
# take; torch 2.13 exports them under no public name.
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

__all__ = ["COLLECTIVES", "CollectiveCounts", "CountingAllGather", "CountingReduceScatter", "StepCollectives"]

#: The ``torch.distributed`` functions a log records (those a training step,
#: DDP's comm hooks and FSDP2's default collectives call), where torch has them.
COLLECTIVES: tuple[str, ...] = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "all_gather_object",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "scatter",
)

#: How deep this thread is inside a counted gradient sync: a ``torch.distributed``
#: call made there is DDP's or FSDP2's, not the step's own.
_in_gradient_sync = threading.local()


#: A context a collective runs to completion in (e.g. a memory counter's
#: ``collective(output, input)``), given its output and input tensors.
SynchronousContext = Callable[[Tensor, Tensor], contextlib.AbstractContextManager[Any]]


class CollectiveCounts:
    """Calls and bytes of one kind of collective, per step.

    Counting starts with the first :meth:`start_step`; a collective before it
    (FSDP's lazy initialisation, a warm-up) is not counted.  While
    :attr:`synchronous` is set, FSDP2's collectives run to completion inside
    it (what a memory counter needs to see their buffers), not asynchronously.
    """

    def __init__(self) -> None:
        self.calls: list[int] = []
        self.bytes: list[int] = []
        self.synchronous: SynchronousContext | None = None
        #: A DDP comm hook the step registered itself ((state, hook)), run in place of the default.
        self.step_hook: tuple[Any, Callable[..., Any]] | None = None
        #: Whether DDP called :meth:`allreduce_hook` yet (counted or not): its
        #: reducer rebuilds its buckets at the next forward (equiv.distributed.matching.watch_ddp).
        self.synced = False

    def start_step(self, step: int | None = None) -> None:
        self.calls.append(0)
        self.bytes.append(0)

    def add(self, tensor: Tensor) -> None:
        self.add_call(tensor.numel() * tensor.element_size())

    def add_call(self, size: int) -> None:
        """One collective of ``size`` bytes in the current step (none before the first :meth:`start_step`)."""
        if self.calls:
            self.calls[-1] += 1
            self.bytes[-1] += size

    def counting(self, method: Callable[..., Any]) -> Callable[..., Any]:
        """``method`` (an engine's own, e.g. DeepSpeed's ``engine.backward``), every ``torch.distributed``
        collective made inside it counted here, by :class:`StepCollectives`' wrappers, and none of them
        as the step's own: an engine that reduces through its own communication layer (DeepSpeed's
        ``deepspeed.comm`` calls ``torch.distributed``) has no comm hook to count at."""

        @functools.wraps(method)
        def counted(*args: Any, **kwargs: Any) -> Any:
            with _gradient_sync(counts=self):
                return method(*args, **kwargs)

        return counted

    # No annotations: DDP compares them with dist.GradBucket at registration,
    # and this module's postponed annotations would be strings.
    def allreduce_hook(self, state, bucket):  # type: ignore[no-untyped-def]
        """A DDP comm hook: the default all-reduce, or the hook the step
        registered itself (:meth:`chain_step_hooks`), counted."""
        self.add(bucket.buffer())
        self.synced = True
        with _gradient_sync():
            if self.step_hook is not None:
                return self.step_hook[1](self.step_hook[0], bucket)
            return default_hooks.allreduce_hook(state, bucket)

    def chain_step_hooks(self, ddp: Any) -> None:
        """Let a step bring its own DDP comm hook: DDP takes one hook, and this
        counting hook holds the slot, so the step's ``register_comm_hook(state,
        hook)`` is kept and run inside it (counted as a gradient sync)."""

        def register_comm_hook(state: Any, hook: Callable[..., Any]) -> None:
            self.step_hook = (state, hook)

        ddp.register_comm_hook = register_comm_hook

    def run(self, collective: Callable[..., Any], output: Tensor, input: Tensor, **kwargs: Any) -> Any:
        with _gradient_sync():
            if self.synchronous is None:
                return collective(output, input, **kwargs)
            with self.synchronous(output, input):
                collective(output, input, **{**kwargs, "async_op": False})
            return None  # FSDP2 takes None for a collective already finished


@contextlib.contextmanager
def _gradient_sync(counts: CollectiveCounts | None = None) -> Any:
    """Inside a gradient sync: a collective made here is not the step's own; it is counted in
    ``counts`` where given (an engine's method, :meth:`CollectiveCounts.counting`), the innermost
    sync's counts winning (a snapshot's gather inside one is counted nowhere)."""
    outer = getattr(_in_gradient_sync, "counts", None)
    _in_gradient_sync.depth = getattr(_in_gradient_sync, "depth", 0) + 1
    _in_gradient_sync.counts = counts
    try:
        yield
    finally:
        _in_gradient_sync.depth -= 1
        _in_gradient_sync.counts = outer


def _tensor_bytes(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """Bytes of the tensor a collective is given (the first; of a list, all of it)."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, Tensor):
            return value.numel() * value.element_size()
        if isinstance(value, (list, tuple)) and value and all(isinstance(t, Tensor) for t in value):
            return sum(t.numel() * t.element_size() for t in value)
    return 0


class StepCollectives:
    """The ``torch.distributed`` collectives a step makes itself, per step: name
    -> calls (:attr:`calls`) and bytes given (:attr:`bytes`); a token count
    all-reduced, a gradient synced by hand.  DDP's and FSDP2's gradient syncs
    (:class:`CollectiveCounts`) are not among them, nor collectives outside a
    step (DDP's construction, gathering snapshots).  Python-level calls only:
    DTensor's functional collectives (a clip norm over shards) are not seen.
    """

    _installed: StepCollectives | None = None

    def __init__(self) -> None:
        self.calls: list[dict[str, int]] = []
        self.bytes: list[int] = []
        self._counting = False

    @classmethod
    def installed(cls) -> StepCollectives:
        """This process's counter, wrapping :data:`COLLECTIVES` once (wrapped
        twice, every call would count twice)."""
        if cls._installed is None:
            counter = cls._installed = cls()
            for name in COLLECTIVES:
                original = getattr(dist, name, None)
                if original is not None:
                    setattr(dist, name, counter._counted(name, original))
        return cls._installed

    def reset(self) -> None:
        self.calls, self.bytes, self._counting = [], [], False

    def start_step(self) -> None:
        self.calls.append({})
        self.bytes.append(0)
        self._counting = True

    def stop(self) -> None:
        self._counting = False

    def _counted(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def counted(*args: Any, **kwargs: Any) -> Any:
            if getattr(_in_gradient_sync, "depth", 0):
                engine = getattr(_in_gradient_sync, "counts", None)
                if engine is not None:  # inside an engine's own method (CollectiveCounts.counting)
                    engine.add_call(_tensor_bytes(args, kwargs))
            elif self._counting:
                self.calls[-1][name] = self.calls[-1].get(name, 0) + 1
                self.bytes[-1] += _tensor_bytes(args, kwargs)
            return original(*args, **kwargs)

        return counted


class _Counted:
    """What both counted FSDP2 collectives share: their counts, and FSDP2's
    default buffer (``torch.empty``)."""

    def __init__(self, counts: CollectiveCounts) -> None:
        self.counts = counts

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device) -> Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class CountingReduceScatter(_Counted, ReduceScatter):
    """FSDP2's default reduce-scatter, counted (bytes put in: the padded unsharded gradients)."""

    def __call__(
        self, output_tensor: Tensor, input_tensor: Tensor, group: dist.ProcessGroup, op: Any, async_op: bool = False
    ) -> Any:
        self.counts.add(input_tensor)
        # What FSDP2's DefaultReduceScatter calls (reduce_scatter_tensor before torch 2.13).
        reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return self.counts.run(reduce_scatter, output_tensor, input_tensor, op=op, group=group, async_op=async_op)


class CountingAllGather(_Counted, AllGather):
    """FSDP2's default all-gather, counted (bytes: the unsharded parameters gathered)."""

    def __call__(
        self, output_tensor: Tensor, input_tensor: Tensor, group: dist.ProcessGroup, async_op: bool = False
    ) -> Any:
        self.counts.add(output_tensor)
        # What FSDP2's DefaultAllGather calls (all_gather_into_tensor before torch 2.13).
        all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return self.counts.run(all_gather, output_tensor, input_tensor, group=group, async_op=async_op)

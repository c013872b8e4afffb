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
  all-reduce, counted.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

# The interfaces FSDPModule.set_custom_all_gather / set_custom_reduce_scatter
# take; torch 2.13 exports them under no public name.
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

__all__ = ["CollectiveCounts", "CountingAllGather", "CountingReduceScatter"]

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

    def start_step(self, step: int | None = None) -> None:
        self.calls.append(0)
        self.bytes.append(0)

    def add(self, tensor: Tensor) -> None:
        if self.calls:
            self.calls[-1] += 1
            self.bytes[-1] += tensor.numel() * tensor.element_size()

    # No annotations: DDP compares them with dist.GradBucket at registration,
    # and this module's postponed annotations would be strings.
    def allreduce_hook(self, state, bucket):  # type: ignore[no-untyped-def]
        """A DDP comm hook: the default all-reduce, counted."""
        self.add(bucket.buffer())
        return default_hooks.allreduce_hook(state, bucket)

    def run(self, collective: Callable[..., Any], output: Tensor, input: Tensor, **kwargs: Any) -> Any:
        if self.synchronous is None:
            return collective(output, input, **kwargs)
        with self.synchronous(output, input):
            collective(output, input, **{**kwargs, "async_op": False})
        return None  # FSDP2 takes None for a collective already finished


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

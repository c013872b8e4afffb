"""What accumulation costs under FSDP2 (``fully_shard``), per rank, as N grows.

Two ways to accumulate N micro-batches on a sharded model, both exact:

* ``sync_once_per_window``: ``set_requires_gradient_sync(False)`` on all but the
  last micro-batch (:class:`equiv.Accumulator` with ``micro_batch(last=...)``):
  one reduce-scatter per FSDP unit per optimizer step, but every rank holds
  its units' gradients *unsharded* from the first micro-batch to the last;
* ``sync_every_micro_batch``: FSDP2's default, every backward reduce-scatters:
  N reduce-scatters per unit per step, gradients sharded in between.

Both all-gather each unit's parameters in every forward and again in every
backward (FSDP2 reshards after each), so all-gathers grow with N either way.

:class:`FsdpCostSweep` measures all of it in ONE run of the ranks (it is the
per-rank task of :func:`equiv.distributed.launcher.run_on_ranks`, which the
caller passes it to): per rank, per policy and N, reduce-scatter and all-gather
calls and bytes per step (FSDP2's custom-comm hooks,
``FSDPModule.set_custom_reduce_scatter`` / ``set_custom_all_gather``), peak
memory split into forward/backward and optimizer step (the storage counter of
:mod:`equiv.cost.memory`, extended to DTensor shards and to the storages FSDP2
frees and re-allocates in place), and step time.
"""

from __future__ import annotations

import contextlib
import statistics
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from equiv.accumulator import Accumulator
from equiv.batches import even_sizes, split_batch
from equiv.cost.memory import (
    StepMemory,
    StorageCounter,
    measure_step_memory,
    training_state_tensors,
)
from equiv.cost.workloads import WORKLOADS, BlockNet, build_workload_model
from equiv.distributed.collectives import CollectiveCounts, CountingAllGather, CountingReduceScatter
from equiv.distributed.sharding import fsdp_modules, fully_shard_layers

__all__ = ["POLICIES", "FsdpCostRow", "FsdpCostSweep", "ShardAwareStorageCounter", "shard_block_net"]

#: The two ways to accumulate on an FSDP2 model (see the module docstring).
POLICIES: tuple[str, ...] = ("sync_once_per_window", "sync_every_micro_batch")


@dataclass(frozen=True, slots=True, kw_only=True)
class FsdpCostRow:
    """One rank's cost of one optimizer step under one policy and N."""

    policy: str
    micro_batches: int
    rank: int
    world_size: int
    reduce_scatters: int
    #: Bytes put into the reduce-scatters (padded unsharded gradients).
    reduce_scatter_bytes: int
    all_gathers: int
    #: Bytes of the all-gathered (unsharded) parameters.
    all_gather_bytes: int
    memory: StepMemory
    #: Median seconds of the timed steps (the ranks start each one together).
    step_seconds: float

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "memory": self.memory.to_dict()}


def _holders(tensor: Tensor) -> tuple[int, int]:
    """References to ``tensor`` itself and to its storage (a backend may hold
    either: the tensor, or views of it)."""
    storage_refs = torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)
    return int(tensor._use_count()), int(storage_refs)  # type: ignore[attr-defined]


class ShardAwareStorageCounter(StorageCounter):
    """:class:`~equiv.cost.memory.StorageCounter` for FSDP2 models.

    A DTensor counts as its local shard (a DTensor is a wrapper without a
    storage of its own).  FSDP2 frees and re-allocates the unsharded
    parameters with ``untyped_storage().resize_()``, which no operator
    reports, so every known storage's size is re-read at each operator:
    a freed unsharded parameter stops counting at the next operator, not
    when some later operator happens to touch it.
    """

    def __init__(self) -> None:
        super().__init__()
        self._storages: dict[int, weakref.ref[torch.UntypedStorage]] = {}

    def _record(self, tensor: Tensor) -> None:
        if isinstance(tensor, DTensor):
            # The shard itself; to_local() would be an operator of its own.
            tensor = tensor._local_tensor
        super()._record(tensor)
        if isinstance(tensor, Tensor) and not tensor.is_meta:
            storage = tensor.untyped_storage()
            self._storages[storage._cdata] = weakref.ref(storage)

    @contextlib.contextmanager
    def collective(self, *tensors: Tensor) -> Iterator[None]:
        """Run a (synchronous) collective on ``tensors`` inside: on leaving,
        wait (at most a second) until the backend's worker thread has let go
        of everything the collective used, so their memory is freed in
        operator order, on this thread.  (Gloo copies inputs into temporaries
        that its worker thread frees when it gets to it; left alone, whether
        that happens before or after the next allocation varies from run to
        run, and so would the peak.)"""
        holders = [_holders(t) for t in tensors]
        before = set(self._bytes_by_storage)
        yield
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline and (
            set(self._bytes_by_storage) - before  # temporaries made inside, still alive
            or any(
                now > then
                for t, held in zip(tensors, holders, strict=True)
                for now, then in zip(_holders(t), held, strict=True)
            )
        ):
            time.sleep(1e-4)

    def _update_peaks(self) -> None:
        for key, ref in list(self._storages.items()):
            storage = ref()
            known = self._bytes_by_storage.get(key)
            if storage is None or known is None:
                del self._storages[key]
                continue
            nbytes = storage.nbytes()
            if nbytes != known:
                self._bytes_by_storage[key] = nbytes
                self.live_bytes += nbytes - known
        super()._update_peaks()


def _measure_memory(
    accumulate: Callable[[], None],
    update: Callable[[], None],
    roots: list[Tensor],
    device: torch.device,
    *,
    counts: Sequence[CollectiveCounts],
) -> StepMemory:
    """:func:`~equiv.cost.memory.measure_step_memory` with the shard-aware
    counter on the CPU (the CUDA allocator already sees everything), the
    counted collectives run synchronously inside it."""
    if device.type != "cpu":
        return measure_step_memory(accumulate, update, roots=roots, device=device)
    counter = ShardAwareStorageCounter()
    for comm_counts in counts:
        comm_counts.synchronous = counter.collective
    try:
        return measure_step_memory(accumulate, update, roots=roots, device=device, counter=counter)
    finally:
        for comm_counts in counts:
            comm_counts.synchronous = None


def shard_block_net(model: BlockNet, world_size: int, device: torch.device) -> list[FSDPModule]:
    """``fully_shard`` each block, the stem and the head if they hold
    parameters, then the root (torchtitan's per-block wrapping, the same
    units the distributed checker shards: :func:`fully_shard_layers`);
    returns every FSDP module."""
    fully_shard_layers(model, init_device_mesh(device.type, (world_size,)))
    return fsdp_modules(model)


@dataclass(frozen=True)
class FsdpCostSweep:
    """The per-rank task measuring one workload under every policy and N
    (pass it to :func:`equiv.distributed.launcher.run_on_ranks`).

    Each (policy, N) gets a fresh sharded model and AdamW, one warm-up step
    (creates the optimizer state, as in steady training), one step under the
    storage counter (communication is counted in the same step), then
    ``timed_steps`` timed steps, each started together after a barrier.
    The rank's shard of the global batch is cut into N micro-batches as
    evenly as possible.
    """

    workload: str = "mlp"
    micro_batches: tuple[int, ...] = (1, 2, 4, 8)
    policies: tuple[str, ...] = POLICIES
    timed_steps: int = 3
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.workload not in WORKLOADS:
            raise ValueError(f"unknown workload {self.workload!r}; expected one of {sorted(WORKLOADS)}")
        unknown = [p for p in self.policies if p not in POLICIES]
        if unknown or not self.policies:
            raise ValueError(f"policies must be a non-empty subset of {POLICIES}, got {self.policies!r}")
        if not self.micro_batches or any(
            isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in self.micro_batches
        ):
            raise ValueError(f"micro_batches must be positive ints, got {self.micro_batches!r}")
        if isinstance(self.timed_steps, bool) or not isinstance(self.timed_steps, int) or self.timed_steps < 1:
            raise ValueError(f"timed_steps must be a positive int, got {self.timed_steps!r}")

    def __call__(self, rank: int, world_size: int, progress: Callable[[str], None]) -> list[FsdpCostRow]:
        workload = WORKLOADS[self.workload]
        device = torch.device(self.device)
        inputs, targets = workload.make_batch(workload.global_batch_size, torch.Generator().manual_seed(0))
        shard = even_sizes(workload.global_batch_size, world_size)
        start = sum(shard[:rank])
        batch = (inputs[start : start + shard[rank]].to(device), targets[start : start + shard[rank]].to(device))
        rows = []
        for policy in self.policies:
            for n in self.micro_batches:
                progress(f"{policy}, N={n}")
                rows.append(self._measure(rank, world_size, policy, n, batch, device))
        return rows

    def _measure(
        self, rank: int, world_size: int, policy: str, n: int, batch: tuple[Tensor, Tensor], device: torch.device
    ) -> FsdpCostRow:
        workload = WORKLOADS[self.workload]
        model = build_workload_model(workload, seed=0, device=device)
        units = shard_block_net(model, world_size, device)
        reduce_scatters, all_gathers = CollectiveCounts(), CollectiveCounts()
        for unit in units:
            unit.set_custom_reduce_scatter(CountingReduceScatter(reduce_scatters))
            unit.set_custom_all_gather(CountingAllGather(all_gathers))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        accumulator = Accumulator(model, optimizer)
        micro_batches = split_batch(batch, even_sizes(int(batch[0].shape[0]), n))
        once = policy == "sync_once_per_window"

        def accumulate() -> None:
            for index, (x, y) in enumerate(micro_batches):
                context = accumulator.micro_batch(last=index == n - 1) if once else contextlib.nullcontext()
                with context:
                    accumulator.backward(workload.loss_sum(model(x), y), items=workload.count_items(y))

        def update() -> None:
            accumulator.step()

        accumulate()  # warm-up: AdamW's state exists from here on
        update()
        for counts in (reduce_scatters, all_gathers):  # the warm-up's collectives are not the step's
            counts.start_step()
        roots = [*training_state_tensors(model, optimizer), *batch]
        memory = _measure_memory(accumulate, update, roots, device, counts=(reduce_scatters, all_gathers))
        counted = (reduce_scatters.calls[0], reduce_scatters.bytes[0], all_gathers.calls[0], all_gathers.bytes[0])
        seconds = []
        for _ in range(self.timed_steps):
            dist.barrier()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            begin = time.perf_counter()
            accumulate()
            update()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds.append(time.perf_counter() - begin)
        return FsdpCostRow(
            policy=policy,
            micro_batches=n,
            rank=rank,
            world_size=world_size,
            reduce_scatters=counted[0],
            reduce_scatter_bytes=counted[1],
            all_gathers=counted[2],
            all_gather_bytes=counted[3],
            memory=memory,
            step_seconds=statistics.median(seconds),
        )

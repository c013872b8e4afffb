"""Mismatched collectives, named at once: which rank called what, where.

Ranks whose collectives do not line up (one all-reduces a count per
micro-batch and holds more micro-batches; one skips a backward, and with it a
gradient sync) otherwise end in whatever the backend makes of it.  Measured on
gloo (torch 2.13): an all-reduce of 1 element against one of 8 aborts the
process ("Received data size doesn't match expected size", SIGABRT); a
reduce-scatter against an all-reduce of the same size runs silently (gloo
does both as an all-reduce); a rank left in a collective its peer never makes
waits until the timeout, or until the peer exits ("Connection closed by peer").

So every rank records each collective it is about to make in a store the
ranks share (:class:`CollectiveLog`: its position in the rank's sequence,
the operation, shape and dtype, and where the rank is), and compares it with
what any peer has already recorded at that position; a difference raises
:class:`CollectiveMismatch` naming both sides before the collective runs.
Nothing waits: a rank that gets there first records and goes on, and the
later one compares.  A rank whose task has returned records an end-of-task
mark (:meth:`CollectiveLog.end_of_task`), so a peer still making collectives
is told apart, at once, from one that is merely slow.

torch's own fingerprinting (``TORCH_DISTRIBUTED_DEBUG=DETAIL``) does the same
in C++ for every collective, but in torch 2.13 constructing
``DistributedDataParallel`` on a process group it wraps crashes the process
(SIGSEGV in ``c10d::Logger::set_env_variables``, which takes the wrapper for
a gloo group), so equiv records at the Python level: the module functions of
``torch.distributed`` (what a step, DDP's comm hooks and FSDP2's collectives
call), not DTensor's functional collectives.

What is recorded, then:

- every call of the :data:`COLLECTIVES` (a step's own, FSDP2's all-gathers and
  reduce-scatters, and DDP's gradient all-reduces: the distributed checker's
  counting comm hook runs DDP's default all-reduce through ``dist.all_reduce``);
- DDP's one collective made in C++ during training, out of Python's sight: the
  bucket rebuild, a broadcast at the first forward after the first gradient
  sync (:func:`watch_ddp`).  Unrecorded, it is what turned ranks that sync a
  different number of times into a hang: a rank that syncs once more rebuilds
  inside its next forward, before it reaches any recorded call, and waits there
  for a peer that has gone on to a collective of its own (measured on gloo: a
  timeout, every time the ranks parted that way, not a named mismatch);
- each DDP forward is counted: a call is named as made after the step's
  forward n (its micro-batch n, for a step that runs one forward each);
- :func:`mark` points (a step's start, a tier's end) and a task's end.

Not recorded: DDP's construction (parameter checks and broadcasts, between
marks), DDP's broadcasts of module buffers (the search's models have none), and
DTensor's collectives.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from equiv.distributed.collectives import COLLECTIVES

__all__ = ["COLLECTIVES", "DDP_BUCKET_REBUILD", "CollectiveLog", "CollectiveMismatch", "mark", "watch_ddp"]

_KEY = "equiv-collective"
#: How a recorded point that is not a collective begins (see :func:`mark`).
_MARK = "mark: "
#: How the log names DDP's bucket rebuild (see :func:`watch_ddp`).
DDP_BUCKET_REBUILD = "DDP's bucket rebuild (a broadcast, at the first forward after its first gradient sync)"
#: The log :meth:`CollectiveLog.install` installed in this process, if any.
_installed: CollectiveLog | None = None


class CollectiveMismatch(RuntimeError):
    """Two ranks were about to make different collectives at the same position."""


def _describe(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """The collective as its fingerprint: the operation, and the shape and dtype
    of the first tensor it is given (the input where the output comes first)."""
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    if not tensors:  # a list of tensors (all_gather, reduce_scatter) or none (barrier, objects)
        lists = [a for a in args if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor)]
        tensors = [lists[-1][0]] if lists else []
    if not tensors:
        return name
    # Output first, input last (all_gather_into_tensor, reduce_scatter_tensor, ...): the input is what was given.
    tensor = tensors[-1] if name.endswith(("_into_tensor", "_tensor", "_single")) and len(tensors) > 1 else tensors[0]
    return f"{name} of shape {list(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')}"


class CollectiveLog:
    """One rank's collectives, recorded in ``store`` and compared with its peers'.

    :meth:`install` wraps the :data:`COLLECTIVES` of ``torch.distributed`` in
    this process so each call is recorded first; ``where()`` says where the
    rank is (its last progress report), for the report.
    """

    def __init__(self, store: dist.Store, rank: int, world_size: int, where: Callable[[], str]) -> None:
        self.store, self.rank, self.world_size, self.where = store, rank, world_size, where
        self.count = 0
        #: Collectives so far on each subgroup (its ranks -> count).
        self.group_counts: dict[tuple[int, ...], int] = {}
        #: The report, once a mismatch was found here (the step may wrap the exception in its own).
        self.mismatch: str | None = None
        #: DDP forwards begun since the last :func:`mark` (a step's micro-batches, one forward each):
        #: a call is named as made after the latest of them.
        self.forwards = 0

    def record(self, call: str, group: tuple[int, ...] | None = None) -> None:
        """Record this rank's next collective; raise :class:`CollectiveMismatch`
        if a peer recorded a different one at the same position.  A collective
        on a subgroup (``group``: its ranks) is matched only among those ranks, in
        that group's own sequence: two context-parallel groups each reducing
        their own sequences' counts, in shapes of their own micro-batches, do
        not line up with each other and need not."""
        peers: tuple[int, ...]
        if group is None or len(group) == self.world_size:
            position, peers, key_prefix = self.count, tuple(range(self.world_size)), _KEY
            self.count += 1
        else:
            key_prefix = f"{_KEY}/group{','.join(map(str, group))}"
            position = self.group_counts.get(group, 0)
            self.group_counts[group], peers = position + 1, group
        where = self.where()
        if self.forwards:
            where += f", after the step's DDP forward {self.forwards}"
        if call.startswith(_MARK):
            self.forwards = 0
        here = f"{call}\t{where}"
        self.store.set(f"{key_prefix}/{position}/{self.rank}", here)
        for peer in peers:
            key = f"{key_prefix}/{position}/{peer}"
            if peer == self.rank or not self.store.check([key]):
                continue
            theirs = self.store.get(key).decode()
            if theirs.split("\t")[0] != call:
                self.mismatch = _report(position, {self.rank: here, peer: theirs})
                raise CollectiveMismatch(self.mismatch)

    def end_of_task(self) -> None:
        """Record that this rank's task returned: a peer still making collectives meets this mark."""
        self.record(_MARK + "the end of its task")

    def install(self) -> None:
        """Record every call of the :data:`COLLECTIVES` made in this process from
        now on, and every :func:`mark`, until :meth:`uninstall`.  The functions
        are wrapped once per process (a process that runs several tasks, as
        torchrun's ranks do, would otherwise record each call twice)."""
        global _installed
        if not _wrapped:
            for name in COLLECTIVES:
                original = getattr(dist, name, None)
                if original is not None:
                    setattr(dist, name, _recording(name, original))
            _wrapped.append(True)
        _installed = self

    def uninstall(self) -> None:
        global _installed
        if _installed is self:
            _installed = None


#: Whether this process's collectives are wrapped (see :meth:`CollectiveLog.install`).
_wrapped: list[bool] = []


def _recording(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def recorded(*args: Any, **kwargs: Any) -> Any:
        if _installed is not None:
            _installed.record(_describe(name, args, kwargs), _group_ranks(args, kwargs))
        return original(*args, **kwargs)

    return recorded


def _group_ranks(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, ...] | None:
    """The ranks of the process group a collective is called on (None: the default group)."""
    group = next((a for a in (*args, *kwargs.values()) if isinstance(a, dist.ProcessGroup)), None)
    return None if group is None else tuple(dist.get_process_group_ranks(group))


def mark(point: str) -> None:
    """Record ``point`` (e.g. "exact tier, step 1") in this process's log,
    if one is installed, as if it were a collective: a point every rank passes
    in the same order.  Collectives the log cannot see (DDP's construction and
    bucket rebuilding, DTensor's gathers) happen between such points, so a
    rank that drifted by a collective is caught at the next point, before it
    reaches them, and the report names the step where the ranks parted."""
    if _installed is not None:
        _installed.record(_MARK + point)


def watch_ddp(ddp: DistributedDataParallel, synced: Callable[[], bool]) -> None:
    """Record in this process's log, if one is installed, what ``ddp`` does at
    each forward that :meth:`CollectiveLog.install` cannot see: the forward
    itself (counted: the log names the forward a call follows) and DDP's bucket
    rebuild, a broadcast its C++ reducer makes once, at the first forward with
    gradients enabled after a gradient sync (``Reducer::rebuild_buckets``;
    never with ``find_unused_parameters`` unless the graph is static).

    A rank that syncs once more than its peers rebuilds there while they go on
    to other collectives; recorded first, the rebuild is named as the mismatch
    it is instead of waiting in gloo until the timeout.

    Args:
        ddp: the DDP model, wrapped in place (its ``_pre_forward``, which
            ``forward`` looks up on the instance).
        synced: whether a gradient sync of ``ddp`` has begun (its comm hook
            ran): the reducer then holds the parameters to rebuild buckets of.
    """
    original = ddp._pre_forward

    def pre_forward(*inputs: Any, **kwargs: Any) -> Any:
        log = _installed
        if log is not None:
            rebuilds = (
                torch.is_grad_enabled()
                and not ddp._has_rebuilt_buckets
                and synced()
                and (ddp.static_graph or not ddp.find_unused_parameters)
                and not ddp._use_python_reducer
                and not ddp._delay_all_reduce_all_params
            )
            if rebuilds:
                log.record(DDP_BUCKET_REBUILD)  # named as made after the forward before this one
            log.forwards += 1
        return original(*inputs, **kwargs)

    ddp._pre_forward = pre_forward  # type: ignore[method-assign]


def _report(position: int, calls: dict[int, str]) -> str:
    parts = []
    for rank, text in sorted(calls.items()):
        call, where = text.split("\t", 1)
        if call.startswith(_MARK):
            parts.append(f"rank {rank} made no collective #{position + 1}: it went on to {call.removeprefix(_MARK)}")
        else:
            parts.append(f"rank {rank} called {call} as its collective #{position + 1} ({where})")
    return "mismatched collectives: " + "; ".join(parts)

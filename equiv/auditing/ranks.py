"""The audit across the ranks of a multi-process run (torchrun, DDP, gloo or NCCL).

Each rank records its own micro-batches, as in one process.  At an audited
step the truth is the *global* full-batch step of the window: every rank's
micro-batches as one batch, the loss summed over all ranks' items and divided
by their global count, clipped once on the global norm.  It is computed where
the data already is, so neither its memory nor its time per rank grows with
the world size:

* each rank replays its own micro-batches on its own copy of the model (float64
  for the truth, the working dtype for the floors), each item loss divided by
  the global item count (one all-reduce of the ranks' counts);
* the gradients are summed across the ranks by equiv's own all-reduce, one
  flat buffer per replay, on a process group of its own (never the user's
  hooks, buckets or comm hooks: those are what is judged);
* each rank then clips and steps its copy as the full-batch step would, and
  compares the result with the update its own optimizer applied.

The floor samples run as in one process, only while a verdict depends on them,
but decided together: a rank runs another sample while any rank still has a
row past its allowance (a collective one rank skipped would hang the others);
then the ranks' verdicts are gathered, so each rank's window says which ranks were
off and how far (rank 0 prints them as one line per step).

Scope: models whose parameters each rank holds whole (DDP, or a plain module
whose gradients the loop reduces itself), and FSDP2 (``fully_shard`` on one
mesh dimension spanning every rank): there each rank replays on a whole copy
of the model (its start gathered once per replay: the model's size, not the
world's), and steps only its own shard of each parameter, with its own shard
of the optimizer state, as FSDP2 does; the comparison is of each rank's shards.
Tensor parallelism and HSDP (DTensor parameters on another mesh) are refused
with a clear error; use ``equiv.check_distributed`` for those steps.
"""

from __future__ import annotations

import copy
import datetime
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["RankVerdict", "Ranks", "ranks_of_run", "unwrapped"]

#: How long one of the audit's collectives waits for the other ranks (a rank that died or left the loop).
TIMEOUT = datetime.timedelta(seconds=300)


@dataclass(frozen=True, slots=True)
class RankVerdict:
    """One rank's verdict on a window, as the other ranks see it."""

    rank: int
    equivalent: bool
    #: the tensor furthest off (its label) and by how much of its scale, when not equivalent
    furthest: str | None = None
    relative_error: float = 0.0
    #: the worst ratio to the allowance over every tensor of the rank
    worst_ratio: float = 0.0
    #: whether this is the rank holding the window (set after the gather; not sent)
    mine: bool = False


@dataclass(slots=True)
class Ranks:
    """The ranks of the run, as the audit's own collectives see them."""

    rank: int
    world_size: int
    #: the audit's own process group (its collectives never interleave with the run's)
    group: Any
    #: whether the run shards its parameters across the ranks (FSDP2): each rank steps its shards
    sharded: bool = False
    #: bytes this rank sent into the audit's all-reduces and gathers so far (payload, not the protocol's)
    communicated: int = field(default=0)

    def sum_items(self, count: float) -> float:
        """The global item count: every rank's ``count`` summed."""
        total = torch.tensor([count], dtype=torch.float64, device=self._device())
        self._all_reduce(total)
        return float(total.item())

    def sum_gradients(self, model: nn.Module) -> None:
        """Every parameter's gradient summed across the ranks, in place (a missing one taken as zeros:
        a parameter one rank's micro-batches did not reach is still reached by another's)."""
        params = list(model.parameters())
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        self._all_reduce(flat)
        offset = 0
        for param in params:
            numel = param.numel()
            param.grad = flat[offset:offset + numel].view_as(param).clone()
            offset += numel

    def any_of(self, flag: bool) -> bool:
        """Whether ``flag`` holds on any rank (every rank asks together)."""
        value = torch.tensor([int(flag)], dtype=torch.int64, device=self._device())
        import torch.distributed as dist

        self.communicated += value.numel() * value.element_size()
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.group)
        return bool(value.item())

    def gather(self, verdict: RankVerdict) -> tuple[RankVerdict, ...]:
        """Every rank's verdict on the window, in rank order."""
        import torch.distributed as dist

        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, verdict, group=self.group)
        return tuple(gathered)

    def _all_reduce(self, tensor: Tensor) -> None:
        import torch.distributed as dist

        self.communicated += tensor.numel() * tensor.element_size()
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)

    def _device(self) -> torch.device:
        import torch.distributed as dist

        backend = dist.get_backend(self.group)
        return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def local(tensor: Tensor) -> Tensor:
    """What this rank holds of ``tensor``: its shard of a DTensor, else the tensor itself."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def whole(tensor: Tensor) -> Tensor:
    """The whole of ``tensor``: a DTensor gathered (a collective: every rank calls it together), else itself."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def shard_of(whole_tensor: Tensor, *, like: Tensor) -> Tensor:
    """This rank's shard of ``whole_tensor``, as the run's DTensor ``like`` shards it (``Shard(d)`` on
    one mesh dimension: ``torch.chunk`` along ``d``, as DTensor splits), with no communication."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(like, DTensor):
        return whole_tensor
    (placement,) = like.placements
    assert isinstance(placement, Shard)
    chunks = torch.chunk(whole_tensor, like.device_mesh.size(), dim=placement.dim)
    index = like.device_mesh.get_local_rank()
    shard = chunks[index] if index < len(chunks) else whole_tensor.narrow(placement.dim, 0, 0)
    expected = like.to_local().shape
    if shard.shape != expected:
        raise RuntimeError(f"equiv.audit cannot place this rank's shard of a parameter of shape "
                           f"{tuple(whole_tensor.shape)}: FSDP2 holds {tuple(expected)} here, an even chunk gives "
                           f"{tuple(shard.shape)} (a shard_placement_fn of its own?)")
    return shard


def plain_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` as an ordinary module: an FSDP2 model's (which refuses ``deepcopy``) with
    its own classes, no FSDP hooks or state, and whole parameters (gathered: every rank together);
    anything else by ``copy.deepcopy``.  The model itself is left as it was."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    fsdp: list[nn.Module] = [module for module in model.modules() if isinstance(module, FSDPModule)]
    if not fsdp:
        return copy.deepcopy(model)
    # For the copy only: each FSDP module's own class back (FSDP2 swaps in a subclass refusing deepcopy),
    # its hooks off; its state shared with the copy (process groups do not copy), then dropped from it.
    saved: list[tuple[nn.Module, type, dict[int, Any], dict[int, Any]]] = [
        (module, type(module), dict(module._forward_pre_hooks), dict(module._forward_hooks)) for module in fsdp]
    shared = {id(value): value for module in fsdp for key, value in vars(module).items() if key.startswith(_STATE_KEY)}
    memo: dict[int, Any] = {id(p): nn.Parameter(p.full_tensor().detach().clone(), requires_grad=p.requires_grad)
                            for p in model.parameters() if isinstance(p, DTensor)}
    memo.update(shared)
    try:
        for module, kind, _, _ in saved:
            module.__class__ = next(c for c in kind.__mro__[1:] if not issubclass(c, FSDPModule))  # type: ignore[assignment]
            module._forward_pre_hooks.clear()
            module._forward_hooks.clear()
        copied = copy.deepcopy(model, memo)
    finally:
        for module, kind, pre, post in saved:
            module.__class__ = kind
            module._forward_pre_hooks.update(pre)
            module._forward_hooks.update(post)
    for module in copied.modules():
        for key in [key for key in vars(module) if key.startswith(_STATE_KEY) or key in _FSDP_MARKS]:
            delattr(module, key)
    return copied


#: What ``fully_shard`` adds to a module's ``__dict__``: its state (under keys of this prefix) and two marks.
_STATE_KEY = "__composable_api_state_key"
_FSDP_MARKS = ("_fsdp_use_orig_params", "_is_fsdp_managed_module")


def unwrapped(model: Any) -> Any:
    """The module a ``DistributedDataParallel`` wrapper runs (its parameters are the optimizer's,
    by their own names), else ``model``."""
    from torch.nn.parallel import DistributedDataParallel

    return model.module if isinstance(model, DistributedDataParallel) else model


def ranks_of_run(model: nn.Module) -> Ranks | None:
    """The ranks of the run when ``torch.distributed`` is initialized with more than one, on a
    process group of the audit's own (every rank must enter the audit, as it must enter a
    collective); None in a single-process run.

    Args:
        model: the audited module (unwrapped): its parameters must be whole on every rank.

    Returns:
        The ranks, or None.

    Raises:
        RuntimeError: the model's parameters are sharded across the ranks (DTensors: FSDP2, tensor
            parallelism), which the audit does not replay yet.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return None
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor, Shard

    world = dist.get_world_size()
    sharded = {name: param for name, param in model.named_parameters() if isinstance(param, DTensor)}
    by_fsdp = any(isinstance(module, FSDPModule) for module in model.modules())
    unlike = [name for name, param in sharded.items()
              if param.device_mesh.ndim != 1 or param.device_mesh.size() != world
              or len(param.placements) != 1 or not isinstance(param.placements[0], Shard)]
    if sharded and (unlike or not by_fsdp):
        name = (unlike or list(sharded))[0]
        raise RuntimeError(
            f"equiv.audit replays a multi-process run whose ranks each hold the whole model (DDP, or gradients "
            f"reduced by the loop) or FSDP2 sharding it over every rank on one mesh dimension, but this model's "
            f"parameter '{name}' is a DTensor placed {sharded[name].placements} on a mesh of shape "
            f"{tuple(sharded[name].device_mesh.shape)} (tensor parallelism or HSDP: its ranks do not each hold "
            "their own micro-batches of one batch), which its replay does not rebuild. Check the step with "
            "equiv.check_distributed (engine='tp' or 'fsdp2+tp'), or audit a DDP or FSDP2 run of the same loop.")
    group = dist.new_group(backend=dist.get_backend(), timeout=TIMEOUT)
    return Ranks(rank=dist.get_rank(), world_size=world, group=group, sharded=bool(sharded))

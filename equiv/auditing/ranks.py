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
whose gradients the loop reduces itself).  A model sharded across the ranks
(FSDP2's ``fully_shard``, tensor parallelism: DTensor parameters) is refused
with a clear error; use ``equiv.check_distributed`` for those steps.
"""

from __future__ import annotations

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
    from torch.distributed.tensor import DTensor

    sharded = [name for name, param in model.named_parameters() if isinstance(param, DTensor)]
    if sharded:
        raise RuntimeError(
            f"equiv.audit replays a multi-process run whose ranks each hold the whole model (DDP, or gradients "
            f"reduced by the loop), but this model's parameters are sharded across the ranks (DTensor, e.g. "
            f"'{sharded[0]}': FSDP2's fully_shard or tensor parallelism), which its replay does not rebuild yet. "
            "Check the step with equiv.check_distributed (engine='fsdp2' or 'tp'), or audit a DDP run of the same loop.")
    group = dist.new_group(backend=dist.get_backend(), timeout=TIMEOUT)
    return Ranks(rank=dist.get_rank(), world_size=dist.get_world_size(), group=group)

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
mesh dimension spanning every rank).  An FSDP2 truth is itself sharded: each
replay builds a fresh copy of the model sharded the same way (the same units,
the run's ``MixedPrecisionPolicy`` in the working-dtype floors, none in the
float64 truth) on the audit's own process group, from this rank's shards of
the window's start, so no rank ever holds the whole model; its gradients are
reduce-scattered by that copy's FSDP2 (torch's, with its defaults: never the
run's own settings, which are what is judged), clipped on the global norm, and
each rank steps its own shards with its own shard of the optimizer state, as
FSDP2 does; the comparison is of each rank's shards.
Tensor parallelism, HSDP (FSDP2 on a 2-D mesh with a replicate dimension) and
FSDP2 over a mesh of fewer than every rank are refused with a clear error naming
what is not supported and what to run instead (:func:`sharding_refusal`).
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from equiv.results.audit import RankVerdict  # the result's part; named here as before

__all__ = ["RankVerdict", "Ranks", "RanksError", "ranks_of_run", "sharding_refusal", "unwrapped"]

#: How long one of the audit's collectives waits for the other ranks (a rank that hangs, stopped stepping or
#: left the loop) before this rank raises, naming where it waited; EQUIV_AUDIT_RANK_TIMEOUT_S overrides it.
DEFAULT_TIMEOUT_S = 300.0


class RanksError(RuntimeError):
    """The ranks did not meet in one of the audit's collectives: another rank hung, stopped
    stepping, raised or died (torchrun then ends the others), or did not enter the audit."""


def timeout_s() -> float:
    """The audit's collective timeout, in seconds (EQUIV_AUDIT_RANK_TIMEOUT_S, else the default)."""
    text = os.environ.get("EQUIV_AUDIT_RANK_TIMEOUT_S")
    if text is None:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value > 0 or math.isinf(value):
        raise ValueError(f"EQUIV_AUDIT_RANK_TIMEOUT_S must be a positive number of seconds, got {text!r}")
    return value


@dataclass(slots=True)
class Ranks:
    """The ranks of the run, as the audit's own collectives see them."""

    rank: int
    world_size: int
    #: the audit's own process group (its collectives never interleave with the run's)
    group: Any
    #: whether the run shards its parameters across the ranks (FSDP2): each rank steps its shards
    sharded: bool = False
    #: an FSDP2 run's units (the names of the modules ``fully_shard`` was applied to, innermost first) and
    #: each unit's mixed-precision policy, rebuilt on every replica
    units: tuple[tuple[str, Any], ...] = ()
    #: bytes this rank sent into the audit's all-reduces and gathers so far (payload, not the protocol's)
    communicated: int = field(default=0)
    #: the optimizer step being judged, to name where the ranks failed to meet
    step: int = 0

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
            param.grad = flat[offset : offset + numel].view_as(param).clone()
            offset += numel

    def sharded_replica(
        self, template: nn.Module, params: dict[str, Tensor], buffers: dict[str, Tensor], dtype: torch.dtype
    ) -> nn.Module:
        """A copy of an FSDP2 run's model in ``dtype``, sharded as the run shards it (its units,
        on the audit's own group; the run's mixed precision in a working-dtype copy, none in
        float64), holding this rank's shards of ``params`` and the ``buffers``: built on the meta
        device and given only its shards, so no rank holds the whole model."""
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        replica = copy.deepcopy(template)  # parameters on the meta device: structure only
        kept = {name: buffer.detach().clone() for name, buffer in replica.named_buffers()}
        replica.to(dtype)
        device = next(iter(params.values())).device if params else torch.device("cpu")
        mesh = DeviceMesh.from_group(self.group, device_type=device.type)
        named = dict(replica.named_modules())
        for unit, policy in self.units:
            settings = {} if policy is None or dtype == torch.float64 else {"mp_policy": policy}
            fully_shard(named[unit], mesh=mesh, **settings)
        replica.to_empty(device=device)
        with torch.no_grad():
            for name, param in replica.named_parameters():
                local(param).copy_(local(params[name]))
            for name, buffer in replica.named_buffers():
                buffer.copy_(buffers[name] if name in buffers else kept[name])
        return replica

    @contextlib.contextmanager
    def counting_fsdp(self) -> Iterator[None]:
        """While a sharded replica runs: the bytes this rank hands to its FSDP2's all-gathers and
        reduce-scatters on the audit's group, added to :attr:`communicated` (FSDP2 calls
        ``torch.distributed.all_gather_single`` / ``reduce_scatter_single``, looked up at each call)."""
        import torch.distributed as dist

        originals = {name: getattr(dist, name) for name in _FSDP_COLLECTIVES}

        def counted(name: str) -> Any:
            def collective(*args: Any, **kwargs: Any) -> Any:
                sent = kwargs.get("input", args[1] if len(args) > 1 else None)
                if kwargs.get("group") is self.group and isinstance(sent, Tensor):
                    self.communicated += sent.numel() * sent.element_size()
                with self._meeting("the full-batch replay"):
                    return originals[name](*args, **kwargs)

            return collective

        for name in _FSDP_COLLECTIVES:
            setattr(dist, name, counted(name))
        try:
            yield
        finally:
            for name, original in originals.items():
                setattr(dist, name, original)

    def any_of(self, flag: bool, what: str = "its floor samples") -> bool:
        """Whether ``flag`` holds on any rank (every rank asks together, in ``what``: named if one never comes)."""
        import torch.distributed as dist

        value = torch.tensor([int(flag)], dtype=torch.int64, device=self._device())
        self.communicated += value.numel() * value.element_size()
        with self._meeting(what):
            dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.group)
        return bool(value.item())

    def gather(self, verdict: RankVerdict) -> tuple[RankVerdict, ...]:
        """Every rank's verdict on the window, in rank order."""
        import torch.distributed as dist

        gathered: list[Any] = [None] * self.world_size
        with self._meeting("its verdicts"):
            dist.all_gather_object(gathered, verdict, group=self.group)
        return tuple(gathered)

    def all_reduce(self, tensor: Tensor) -> None:
        """``tensor`` summed over the ranks in place by the audit's own group (on its device, counted)."""
        device = self._device()
        if tensor.device == device:
            self._all_reduce(tensor)
            return
        moved = tensor.to(device)
        self._all_reduce(moved)
        tensor.copy_(moved)

    def _all_reduce(self, tensor: Tensor) -> None:
        import torch.distributed as dist

        self.communicated += tensor.numel() * tensor.element_size()
        with self._meeting("the full-batch replay"):
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)

    @contextlib.contextmanager
    def _meeting(self, what: str) -> Iterator[None]:
        """A collective of the audit's: its failure (a timeout, a peer gone) named, with where."""
        try:
            yield
        except RuntimeError as error:  # gloo / NCCL raise DistBackendError, a RuntimeError
            raise RanksError(
                f"equiv.audit: rank {self.rank} of {self.world_size} waited for the other ranks in {what} of "
                f"optimizer step {self.step} and they did not come ({type(error).__name__}: "
                f"{str(error).splitlines()[0] if str(error) else ''}): every rank must enter the audit and take the "
                f"same optimizer steps; did a rank hang, stop stepping, or raise? (waits up to {timeout_s():g} s: "
                "EQUIV_AUDIT_RANK_TIMEOUT_S)"
            ) from error

    def _device(self) -> torch.device:
        import torch.distributed as dist

        backend = dist.get_backend(self.group)
        return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def local(tensor: Tensor) -> Tensor:
    """What this rank holds of ``tensor``: its shard of a DTensor, else the tensor itself."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def plain_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` as an ordinary module: an FSDP2 model's (which refuses ``deepcopy``) with
    its own classes, no FSDP hooks or state, its parameters on the meta device (the structure only:
    :meth:`Ranks.sharded_replica` gives each rank its shards); anything else by ``copy.deepcopy``.
    The model itself is left as it was."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    fsdp: list[nn.Module] = [module for module in model.modules() if isinstance(module, FSDPModule)]
    if not fsdp:
        return copy.deepcopy(model)
    # For the copy only: each FSDP module's own class back (FSDP2 swaps in a subclass refusing deepcopy),
    # its hooks off; its state shared with the copy (process groups do not copy), then dropped from it.
    saved: list[tuple[nn.Module, type, dict[int, Any], dict[int, Any]]] = [
        (module, type(module), dict(module._forward_pre_hooks), dict(module._forward_hooks)) for module in fsdp
    ]
    shared = {id(value): value for module in fsdp for key, value in vars(module).items() if key.startswith(_STATE_KEY)}
    memo: dict[int, Any] = {
        id(p): nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), requires_grad=p.requires_grad)
        for p in model.parameters()
        if isinstance(p, DTensor)
    }
    memo.update(shared)
    try:
        for module, module_class, _, _ in saved:
            module.__class__ = next(c for c in module_class.__mro__[1:] if not issubclass(c, FSDPModule))  # type: ignore[assignment]
            module._forward_pre_hooks.clear()
            module._forward_hooks.clear()
        copied = copy.deepcopy(model, memo)
    finally:
        for module, module_class, pre, post in saved:
            module.__class__ = module_class
            module._forward_pre_hooks.update(pre)
            module._forward_hooks.update(post)
    for module in copied.modules():
        for key in [key for key in vars(module) if key.startswith(_STATE_KEY) or key in _FSDP_MARKS]:
            delattr(module, key)
    return copied


#: The collectives an FSDP2 module makes of its parameters and gradients (torch 2.13's _fsdp_collectives).
_FSDP_COLLECTIVES = ("all_gather_single", "reduce_scatter_single")
#: What ``fully_shard`` adds to a module's ``__dict__``: its state (under keys of this prefix) and two marks.
_STATE_KEY = "__composable_api_state_key"
_FSDP_MARKS = ("_fsdp_use_orig_params", "_is_fsdp_managed_module")


def sharding_refusal(
    name: str, placements: tuple[Any, ...], mesh_shape: tuple[int, ...], world: int, *, by_fsdp: bool
) -> str:
    """Why the audit refuses a model whose parameter ``name`` is a DTensor placed ``placements`` on a
    mesh of ``mesh_shape`` (of ``world`` ranks), and what the user can do, in one message: HSDP (FSDP2
    on a 2-D mesh, replicated over one dimension and sharded over the other), tensor parallelism
    (with or without FSDP2), or FSDP2 over a mesh that is not every rank."""
    from torch.distributed.tensor import Replicate, Shard

    where = f"parameter '{name}' is a DTensor placed {placements} on a mesh of shape {mesh_shape}"
    supported = (
        "equiv.audit replays DDP (or gradients reduced by the loop) and FSDP2 sharding the model over "
        "every rank on one mesh dimension"
    )
    replicated = any(isinstance(placement, Replicate) for placement in placements)
    if by_fsdp and len(mesh_shape) == 2 and replicated and any(isinstance(p, Shard) for p in placements):
        return (
            f"{supported}; this model is HSDP (FSDP2 on a 2-D mesh, replicated over one dimension and sharded "
            f"over the other: {where}), which the audit does not support yet. Audit the same loop with "
            "fully_shard over a 1-D mesh of every rank (or under DDP): the accumulation and the loss are the "
            "same code; or check the step with equiv.check_distributed(engine='fsdp2')"
        )
    if by_fsdp and len(mesh_shape) == 1:
        return (
            f"{supported}; this model is FSDP2 on a mesh of {mesh_shape[0]} of the {world} ranks ({where}), "
            "which the audit does not support yet. Audit the same loop with fully_shard over every rank (or "
            "under DDP), or check the step with equiv.check_distributed(engine='fsdp2')"
        )
    return (
        f"{supported}; this model's {where} (tensor parallelism: the ranks of a tensor-parallel group share "
        "their micro-batches and each holds a slice of the weights), which its replay does not rebuild. Check "
        "the step with equiv.check_distributed (engine='tp' or 'fsdp2+tp'), or audit a DDP or FSDP2 run of the "
        "same loop"
    )


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
    unlike = [
        name
        for name, param in sharded.items()
        if param.device_mesh.ndim != 1
        or param.device_mesh.size() != world
        or len(param.placements) != 1
        or not isinstance(param.placements[0], Shard)
    ]
    if sharded and (unlike or not by_fsdp):
        name = (unlike or list(sharded))[0]
        param = sharded[name]
        raise RuntimeError(
            sharding_refusal(name, tuple(param.placements), tuple(param.device_mesh.shape), world, by_fsdp=by_fsdp)
        )
    group = dist.new_group(backend=dist.get_backend(), timeout=datetime.timedelta(seconds=timeout_s()))
    units = tuple(
        (name, getattr(module._get_fsdp_state(), "_mp_policy", None))
        for name, module in sorted(model.named_modules(), key=lambda item: -item[0].count(".") if item[0] else 1)
        if isinstance(module, FSDPModule)
    )
    return Ranks(rank=dist.get_rank(), world_size=world, group=group, sharded=bool(sharded), units=units)

"""FSDP2 sharding, one way for everyone: which modules become FSDP units,
sharding them, and gathering sharded tensors back to full ones.

The distributed checker (:mod:`equiv.checking.distributed`) and the FSDP2
cost sweep (:mod:`equiv.cost.fsdp`) both shard with :func:`fully_shard_layers`,
so the units a check counts are the units a cost row measures.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

__all__ = ["fsdp_modules", "full_tensors", "fully_shard_layers", "sum_where_premul_sum_is_missing"]


def _shard_units(module: nn.Module) -> Iterator[nn.Module]:
    """The modules ``fully_shard`` wraps below the root: each child with
    parameters, looking through containers (ModuleList/ModuleDict have no
    forward of their own to hook) and through a wrapper that owns no parameter
    and is the only child with parameters (e.g. an autocast wrapper).  Never
    deeper: a module may use a child's parameters without calling the child
    (MultiheadAttention uses ``out_proj.weight`` directly)."""
    with_params = [c for c in module.children() if next(c.parameters(), None) is not None]
    for child in with_params:
        wrapper = (
            len(with_params) == 1
            and next(child.parameters(recurse=False), None) is None
            and any(next(g.parameters(), None) is not None for g in child.children())
        )
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)) or wrapper:
            yield from _shard_units(child)
        else:
            yield child


def fully_shard_layers(model: nn.Module, mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy | None = None) -> int:
    """Apply FSDP2's ``fully_shard`` to each layer of ``model`` (see
    :func:`_shard_units`) and then to ``model`` itself, in place, as
    torchtitan does; return the number of FSDP units that hold trainable
    parameters (each reduce-scatters once per gradient sync)."""
    kwargs: dict[str, Any] = {"mesh": mesh}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    layers = list(_shard_units(model))
    # Counted before sharding: fully_shard replaces the parameters.
    covered = {id(p) for layer in layers for p in layer.parameters()}
    units = sum(any(p.requires_grad for p in layer.parameters()) for layer in layers)
    units += any(p.requires_grad and id(p) not in covered for p in model.parameters())
    for layer in layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return units


def fsdp_modules(model: nn.Module) -> list[FSDPModule]:
    """Every ``fully_shard``-ed module of ``model`` (its units and the root), in module order."""
    return [module for module in model.modules() if isinstance(module, FSDPModule)]


def full_tensors(values: dict[str, Tensor]) -> dict[str, Tensor]:
    """``values`` with every DTensor shard gathered (``full_tensor()``, a
    collective: every rank must call this with the same names, and the
    gathering runs in sorted name order so it is the same order on every
    rank) and every tensor on the CPU; the mapping keeps its own order."""
    out = {}
    for name in sorted(values):
        value = values[name]
        out[name] = (value.full_tensor() if isinstance(value, DTensor) else value).cpu()
    return {name: out[name] for name in values}


def sum_where_premul_sum_is_missing(model: nn.Module, mesh: DeviceMesh) -> bool:
    """Make ``model``'s FSDP2 modules reduce gradients with a plain sum and
    divide afterwards where the mesh's backend has no ``ReduceOp.PREMUL_SUM``;
    return whether it did.

    FSDP2 reduce-scatters float32 and bfloat16 gradients with
    ``PREMUL_SUM(1 / factor)`` once a step sets a divide factor other than the
    world size (``set_gradient_divide_factor(1.0)``, as torchtitan does to
    divide by a global token count itself), and only NCCL has that op (see
    ``torch.distributed.ReduceOp``): on gloo the step raises "Cannot use
    ReduceOp.PREMUL_SUM with Gloo".  ``set_force_sum_reduction_for_comms(True)``
    makes FSDP2 reduce with ``SUM`` and divide by the same factor after it
    (none for a factor of 1), the same gradient.  The flag stays set whatever
    divide factor the step chooses later."""
    if mesh.device_type == "cuda" and "nccl" in str(dist.get_backend(mesh.get_group())):
        return False
    for module in fsdp_modules(model):
        module.set_force_sum_reduction_for_comms(True)
    return True

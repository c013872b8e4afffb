"""Tensor parallelism for the distributed check: the plan, the meshes, the wrapping.

``engine="tp"`` applies ``torch.distributed.tensor.parallel.parallelize_module``
on a 1-D mesh of all ranks: every rank sees the same micro-batches, and each
holds a shard of every parallelised weight.  ``engine="fsdp2+tp"`` lays the
ranks out on a 2-D mesh ``(dp, tp)``: tensor parallel inside each row of
``tp`` ranks, then FSDP2's ``fully_shard`` over the ``dp`` dimension (the
outer one, as FSDP2 with TP requires), so the parameters become 2-D DTensors.

The plan pairs the model's ``nn.Linear`` layers in module order as Megatron's
MLP does: the first of each pair ``ColwiseParallel`` (its output sharded on
the features), the second ``RowwiseParallel`` (it takes the sharded features
and all-reduces its output), with only element-wise layers (activations)
between them.  Biases of the row-wise layer stay replicated on every TP rank,
which is what makes a gradient norm easy to get wrong (counted once, not once
per rank).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

__all__ = ["ELEMENTWISE", "parallelize", "tensor_parallel_mesh", "tensor_parallel_plan"]

#: Layers that act on each feature alone, so they run on a feature shard unchanged.
ELEMENTWISE: tuple[type[nn.Module], ...] = (nn.Tanh, nn.ReLU, nn.GELU, nn.Sigmoid, nn.SiLU, nn.Identity)


def tensor_parallel_plan(model: nn.Module) -> dict[str, ParallelStyle]:
    """Column-wise then row-wise parallel for each consecutive pair of ``nn.Linear``
    layers of ``model``; raises ValueError naming what the plan cannot shard."""
    leaves = [(name, module) for name, module in model.named_modules() if not list(module.children())]
    owners = [(name, module) for name, module in leaves if next(module.parameters(recurse=False), None) is not None]
    others = [f"{name} ({type(module).__name__})" for name, module in owners if not isinstance(module, nn.Linear)]
    if others:
        raise ValueError(f"the tensor-parallel plan shards nn.Linear layers only; model has parameters in {others}")
    if not owners or len(owners) % 2:
        raise ValueError(
            f"the tensor-parallel plan pairs nn.Linear layers (column-wise, then row-wise); model has "
            f"{len(owners)} ({[name for name, _ in owners]}): use an even number, e.g. mlp with one "
            "hidden layer"
        )
    names = [name for name, _ in leaves]
    plan: dict[str, ParallelStyle] = {}
    for (first, _), (second, _) in zip(owners[::2], owners[1::2], strict=True):
        between = [module for name, module in leaves[names.index(first) + 1 : names.index(second)]]
        if not all(isinstance(module, ELEMENTWISE) for module in between):
            raise ValueError(
                f"between the column-wise {first!r} and the row-wise {second!r} the plan allows only "
                f"element-wise layers {[t.__name__ for t in ELEMENTWISE]}, got "
                f"{[type(m).__name__ for m in between]}"
            )
        plan[first], plan[second] = ColwiseParallel(), RowwiseParallel()
    return plan


def tensor_parallel_mesh(device_type: str, data_parallel: int, tensor_parallel: int) -> DeviceMesh:
    """A 1-D ``("tp",)`` mesh for one data rank, else a 2-D ``("dp", "tp")`` mesh:
    rank r is data rank r // tensor_parallel (row-major, TP ranks adjacent)."""
    if data_parallel == 1:
        return init_device_mesh(device_type, (tensor_parallel,), mesh_dim_names=("tp",))
    return init_device_mesh(device_type, (data_parallel, tensor_parallel), mesh_dim_names=("dp", "tp"))


def parallelize(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """``parallelize_module`` with :func:`tensor_parallel_plan` on the mesh's ``tp`` dimension, in place."""
    tp_mesh = mesh if mesh.ndim == 1 else mesh["tp"]
    return parallelize_module(model, tp_mesh, tensor_parallel_plan(model))

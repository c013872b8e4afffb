"""Router aux and z-loss weights under data parallelism (``engine="ddp"`` / ``"fsdp2"``).

The MoE model (:mod:`equiv.cases.moe`) puts each sample's weighted router loss
(the sequence-wise load-balancing loss times ``aux_weight``, plus the router
z-loss times ``z_weight``) in its last output column; ``loss="mse_aux"`` adds it
to the task loss.  The documented full-batch objective is the mean over the
window's samples of task + router loss, so under data parallelism and
accumulation the router loss takes the same weight as the task loss: each
micro-batch's summed router loss over the global sample count (times the
world size that DDP's average divides out).  The steps below get that weight
wrong in the ways reported upstream; :func:`equiv.accumulator_step` gets it
right (the router loss is part of the summed loss it normalises once).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from equiv.accumulator import accumulator_step
from equiv.losses import MSEWithAux
from equiv.outcomes import Outcome
from equiv.zoo.distributed_bugs import SearchEntry

__all__ = ["AUX_MODEL", "AUX_SEARCH_ZOO", "aux_at_full_weight_per_micro_batch", "aux_gradient_shrunk_by_world",
           "aux_weighted_by_global_samples"]

Batches = list[tuple[Tensor, Tensor]]


def _router_step(model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: Batches,
                 loss_fn: Callable[..., Tensor],
                 router_term: Callable[[Tensor, int, float], Tensor]) -> None:
    """The task loss weighted right (summed, times world / global samples), the
    router loss as ``router_term(output, samples in the window, world)`` says;
    DDP's sync on the last micro-batch only."""
    assert isinstance(model, DistributedDataParallel) and isinstance(loss_fn, MSEWithAux)
    optimizer.zero_grad(set_to_none=True)
    samples = torch.tensor(float(sum(len(targets) for _, targets in micro_batches)), dtype=torch.float64)
    dist.all_reduce(samples)
    world = float(dist.get_world_size())
    for index, (inputs, targets) in enumerate(micro_batches):
        last = index == len(micro_batches) - 1
        with contextlib.nullcontext() if last else model.no_sync():
            output = model(inputs)
            task = loss_fn.task_sum(output, targets) * world / float(samples)
            (task + router_term(output, int(samples), world)).backward()
    optimizer.step()


def aux_weighted_by_global_samples(model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: Batches,
                                   loss_fn: Callable[..., Tensor]) -> None:
    """Correct: the task and the router loss apart (as MoE trainers attach the
    router loss on its own), each summed and weighted by world / global samples."""
    _router_step(model, optimizer, micro_batches, loss_fn,
                 lambda output, samples, world: output[..., -1].sum() * world / samples)


def aux_gradient_shrunk_by_world(model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: Batches,
                                 loss_fn: Callable[..., Tensor]) -> None:
    """Megatron-LM #3672 (``global_aux_loss``, fixed by PR #3769): the router loss
    averaged over the global sample count with no factor for DDP's averaging over
    ranks, so its gradient is 1/dp of the coefficient's ("The gradient is
    therefore 1/dp_size too small"); NeMo Automodel PR #1412 fixed the same
    division by the data-parallel size."""
    _router_step(model, optimizer, micro_batches, loss_fn,
                 lambda output, samples, world: output[..., -1].sum() / samples)  # BUG: no * world


def aux_at_full_weight_per_micro_batch(model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: Batches,
                                       loss_fn: Callable[..., Tensor]) -> None:
    """Each micro-batch adds its own mean router loss at full weight, not
    weighted by its share of the window: the router loss counts once per
    micro-batch and per rank (Megatron scales the attached aux loss by the
    number of micro-batches and data ranks for this reason, Megatron-LM PR
    #2217)."""
    _router_step(model, optimizer, micro_batches, loss_fn,
                 lambda output, samples, world: output[..., -1].mean())  # BUG: full weight each micro-batch


#: The MoE base the aux-loss search draws: sequence-wise balance loss and a router z-loss.
AUX_MODEL = "moe"

#: The aux / z-loss zoo as the search meets it (the MoE model with a z-loss, DDP and FSDP2).
AUX_SEARCH_ZOO: dict[str, SearchEntry] = {
    "accumulator_step (DDP, MoE)": SearchEntry(
        accumulator_step, "ddp", (AUX_MODEL,), Outcome.EQUIVALENT, "", "the reference accumulator"),
    "accumulator_step (FSDP2, MoE)": SearchEntry(
        accumulator_step, "fsdp2", (AUX_MODEL,), Outcome.EQUIVALENT, "", "the reference accumulator"),
    "aux_weighted_by_global_samples": SearchEntry(
        aux_weighted_by_global_samples, "ddp", (AUX_MODEL,), Outcome.EQUIVALENT, "Megatron-LM PR #3769 (the fix)",
        "router loss apart, summed, times world / global samples"),
    "aux_gradient_shrunk_by_world": SearchEntry(
        aux_gradient_shrunk_by_world, "ddp", (AUX_MODEL,), Outcome.NOT_EQUIVALENT,
        "Megatron-LM #3672; NeMo Automodel PR #1412", "router-loss gradient 1/dp too small"),
    "aux_at_full_weight_per_micro_batch": SearchEntry(
        aux_at_full_weight_per_micro_batch, "ddp", (AUX_MODEL,), Outcome.NOT_EQUIVALENT, "Megatron-LM PR #2217",
        "each micro-batch's router-loss mean at full weight"),
}

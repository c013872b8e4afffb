"""Router aux and z-loss weights under data, context and sequence parallelism (``"ddp"``, ``"fsdp2"``, ``"cp"``, ``"tp"``).

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

Under context parallelism (``engine="cp"``) the search draws the token-level
MoE (:func:`equiv.cases.moe.token_moe`, ``loss="token_mse_aux"``): each rank
holds a slice of every sequence, the router sums its routing counts over the
slices in the forward, and each token carries its share of its sequence's
balance loss and z-loss.  The full-batch objective is the mean over the
window's tokens of task + router shares (every token real: the mean over
sequences of each sequence's router losses), so each rank's router shares
take the task's weight: summed, over the global token count, times the world
size (data x context) that DDP's average divides out.  Megatron attaches the
router losses apart from the task loss (``MoEAuxLossAutoScaler``) and scales
them by hand for the context-parallel ranks; the steps below get that factor
wrong as reported (Megatron-LM #1652, PR #5047).

The tensor-parallel side of those reports is the same split over the TP
group: under ``engine="tp"`` the search draws the token-level MoE
sequence-parallel (each TP rank routes its slice of every sequence's tokens,
the routing counts summed over the TP group, the replicated weights'
gradients reduced over it; :mod:`equiv.distributed.context_parallel`), and
:func:`~equiv.distributed.context_parallel.layout` gives the TP group's size
where it gave the CP size.  The steps below are written against that group,
so each one's factor is the TP size there: the per-token path short of the
TP x CP tokens (PR #5047) and the z-loss summed over the TP slices (commit
cac8d1a) are the same bugs on either engine.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from equiv.accumulator import accumulator_step
from equiv.batches import MicroBatches
from equiv.distributed.context_parallel import layout
from equiv.losses import MSEWithAux, TokenMSEWithAux
from equiv.outcomes import Outcome
from equiv.zoo.distributed_bugs import SearchEntry

__all__ = [
    "AUX_MODEL",
    "AUX_SEARCH_ZOO",
    "aux_at_full_weight_per_micro_batch",
    "aux_gradient_never_flows",
    "aux_gradient_shrunk_by_world",
    "aux_times_tokens_on_a_mean_loss",
    "aux_weighted_by_global_samples",
    "per_token_router_loss_times_local_tokens",
    "per_token_router_loss_times_tp_cp_tokens",
    "router_loss_not_scaled_by_cp",
    "router_loss_over_global_tokens",
    "z_loss_summed_over_cp_slices",
]


def _router_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: MicroBatches,
    loss_fn: Callable[..., Tensor],
    router_term: Callable[[Tensor, int, float], Tensor],
) -> None:
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


def aux_weighted_by_global_samples(
    model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: MicroBatches, loss_fn: Callable[..., Tensor]
) -> None:
    """Correct: the task and the router loss apart (as MoE trainers attach the
    router loss on its own), each summed and weighted by world / global samples."""
    _router_step(
        model, optimizer, micro_batches, loss_fn, lambda output, samples, world: output[..., -1].sum() * world / samples
    )


def aux_gradient_shrunk_by_world(
    model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: MicroBatches, loss_fn: Callable[..., Tensor]
) -> None:
    """Megatron-LM #3672 (``global_aux_loss``, fixed by PR #3769): the router loss
    averaged over the global sample count with no factor for DDP's averaging over
    ranks, so its gradient is 1/dp of the coefficient's ("The gradient is
    therefore 1/dp_size too small"); NeMo Automodel PR #1412 fixed the same
    division by the data-parallel size."""
    _router_step(
        model, optimizer, micro_batches, loss_fn, lambda output, samples, world: output[..., -1].sum() / samples
    )  # BUG: no * world


def aux_gradient_never_flows(
    model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: MicroBatches, loss_fn: Callable[..., Tensor]
) -> None:
    """NeMo Automodel #1408: the router loss handed to ``MoEAuxLossAutoScaler.apply``
    whose return value is discarded, so the autograd node that carries the
    router loss's gradient is never in the backward: the loss is computed (and
    logged) at the right weight but trains nothing, and the experts drift out
    of balance while the loss curve looks normal."""
    _router_step(
        model,
        optimizer,
        micro_batches,
        loss_fn,
        lambda output, samples, world: output[..., -1].sum().detach() * world / samples,
    )  # BUG: no gradient


def aux_times_tokens_on_a_mean_loss(
    model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: MicroBatches, loss_fn: Callable[..., Tensor]
) -> None:
    """NeMo Automodel #1408, its second half: the router loss's gradient scaled
    by the number of items N where the task loss is a mean over them (the ``* N``
    the issue asks to remove), so once the gradient flows it is N times too
    strong (the issue's ~180,000x at its batch of tokens)."""
    _router_step(
        model, optimizer, micro_batches, loss_fn, lambda output, samples, world: output[..., -1].sum() * world
    )  # BUG: not / samples


def aux_at_full_weight_per_micro_batch(
    model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: MicroBatches, loss_fn: Callable[..., Tensor]
) -> None:
    """Each micro-batch adds its own mean router loss at full weight, not
    weighted by its share of the window: the router loss counts once per
    micro-batch and per rank (Megatron scales the attached aux loss by the
    number of micro-batches and data ranks for this reason, Megatron-LM PR
    #2217)."""
    _router_step(
        model, optimizer, micro_batches, loss_fn, lambda output, samples, world: output[..., -1].mean()
    )  # BUG: full weight each micro-batch


def _cp_router_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: MicroBatches,
    loss_fn: Callable[..., Tensor],
    *,
    aux_factor: float = 1.0,
    z_factor: float = 1.0,
    per_token_loss: bool = False,
) -> None:
    """A context- (or sequence-) parallel rank's step on the token MoE: the task's summed loss
    weighted right, its router shares (load balancing, z-loss) times ``aux_factor``
    / ``z_factor`` of their right weight; DDP's sync on the last micro-batch only.

    Without ``per_token_loss`` every term is weighted by world / global tokens
    before backward.  With it, Megatron's ``calculate_per_token_loss`` contract:
    the sums are back-propagated (times the world size DDP's average divides),
    the real-token count is all-reduced over data x context ranks and every
    gradient divided by it after backward (``finalize_model_grads``)."""
    assert isinstance(model, DistributedDataParallel) and isinstance(loss_fn, TokenMSEWithAux)
    optimizer.zero_grad(set_to_none=True)
    tokens = torch.tensor(float(sum(loss_fn.count(targets) for _, targets in micro_batches)), dtype=torch.float64)
    dist.all_reduce(tokens)
    world = float(dist.get_world_size())
    scale = world if per_token_loss else world / float(tokens)
    for index, (inputs, targets) in enumerate(micro_batches):
        last = index == len(micro_batches) - 1
        with contextlib.nullcontext() if last else model.no_sync():
            output = model(inputs)
            router = loss_fn.aux_sum(output) * aux_factor + loss_fn.z_sum(output) * z_factor
            ((loss_fn.task_sum(output, targets) + router) * scale).backward()
    if per_token_loss:
        torch._foreach_div_([p.grad for p in model.parameters() if p.grad is not None], float(tokens))
    optimizer.step()


def router_loss_over_global_tokens(
    model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: MicroBatches, loss_fn: Callable[..., Tensor]
) -> None:
    """Correct under context parallelism: each slice's router shares taken with the
    task's weight, world (data x context) / global tokens: Megatron scales the
    attached aux loss by the CP size for this (``loss_scale * cp_size /
    num_microbatches``, Megatron-LM PR #2217, restated in PR #3959)."""
    _cp_router_step(model, optimizer, micro_batches, loss_fn)


def router_loss_not_scaled_by_cp(
    model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: MicroBatches, loss_fn: Callable[..., Tensor]
) -> None:
    """Megatron-LM #1652 (2): gradients are averaged over data x context ranks and
    the language-model loss is multiplied by the CP size in advance, but the aux
    loss is not, so the router losses' gradient is 1/cp of the coefficient's (the
    same factor Megatron-LM PR #3959 found left on the MTP loss)."""
    _cp_router_step(
        model, optimizer, micro_batches, loss_fn, aux_factor=1.0 / layout().size, z_factor=1.0 / layout().size
    )  # BUG: no * cp_size


def per_token_router_loss_times_local_tokens(
    model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: MicroBatches, loss_fn: Callable[..., Tensor]
) -> None:
    """Megatron-LM #1652 (1), fixed by PR #5047: with ``--calculate-per-token-loss``
    every gradient is divided by the global token count, so the router attaches its
    aux and z-loss (each a mean over the tokens of the TP x CP group) times
    ``num_local_tokens``, this rank's slice: short of the group's tokens by the TP x
    CP size, the router losses' gradient 1/cp (under sequence-parallel TP 1/tp) too
    small ("dependent on TP/CP size")."""
    cp = layout().size
    _cp_router_step(
        model, optimizer, micro_batches, loss_fn, aux_factor=1.0 / cp, z_factor=1.0 / cp, per_token_loss=True
    )  # BUG: times num_local_tokens, not num_local_tokens * tp_cp size


def per_token_router_loss_times_tp_cp_tokens(
    model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: MicroBatches, loss_fn: Callable[..., Tensor]
) -> None:
    """The fix of Megatron-LM PR #5047: the router losses attached times
    ``num_local_tokens * tp_cp_group.size()``, which the division by the global
    token count cancels, whatever the CP size."""
    _cp_router_step(model, optimizer, micro_batches, loss_fn, per_token_loss=True)


def z_loss_summed_over_cp_slices(
    model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: MicroBatches, loss_fn: Callable[..., Tensor]
) -> None:
    """Each rank takes the z-loss mean over its own slice's tokens at the full
    coefficient, and the ranks' gradients are summed: the z-loss counted once per
    slice, cp (under sequence-parallel TP, tp) times too strong.  Megatron divides the z-loss coefficient by the TP
    (since commit cac8d1a, "Fix Aux Loss Scaling when TP>1"), now the TP x CP, group
    size because the z-loss "must be averaged across TP+CP rather than summed"
    (its comment, restated in PR #5047)."""
    _cp_router_step(model, optimizer, micro_batches, loss_fn, z_factor=float(layout().size))  # BUG: no / cp_size


#: The MoE base the aux-loss search draws: sequence-wise balance loss and a router z-loss.
AUX_MODEL = "moe"

#: The aux / z-loss zoo as the search meets it (the MoE model with a z-loss, DDP and FSDP2; the
#: token-level MoE under CP and, sequence-parallel, under TP).
AUX_SEARCH_ZOO: dict[str, SearchEntry] = {
    "accumulator_step (DDP, MoE)": SearchEntry(
        accumulator_step, "ddp", (AUX_MODEL,), Outcome.EQUIVALENT, "", "the reference accumulator"
    ),
    "accumulator_step (FSDP2, MoE)": SearchEntry(
        accumulator_step, "fsdp2", (AUX_MODEL,), Outcome.EQUIVALENT, "", "the reference accumulator"
    ),
    "aux_weighted_by_global_samples": SearchEntry(
        aux_weighted_by_global_samples,
        "ddp",
        (AUX_MODEL,),
        Outcome.EQUIVALENT,
        "Megatron-LM PR #3769 (the fix)",
        "router loss apart, summed, times world / global samples",
    ),
    "aux_gradient_shrunk_by_world": SearchEntry(
        aux_gradient_shrunk_by_world,
        "ddp",
        (AUX_MODEL,),
        Outcome.NOT_EQUIVALENT,
        "Megatron-LM #3672; NeMo Automodel PR #1412",
        "router-loss gradient 1/dp too small",
    ),
    "aux_gradient_never_flows": SearchEntry(
        aux_gradient_never_flows,
        "ddp",
        (AUX_MODEL,),
        Outcome.NOT_EQUIVALENT,
        "NeMo Automodel #1408",
        "router loss computed, its autograd node discarded: no router-loss gradient",
    ),
    "aux_times_tokens_on_a_mean_loss": SearchEntry(
        aux_times_tokens_on_a_mean_loss,
        "ddp",
        (AUX_MODEL,),
        Outcome.NOT_EQUIVALENT,
        "NeMo Automodel #1408",
        "router-loss gradient times the item count of a mean loss: N times too strong",
    ),
    "aux_at_full_weight_per_micro_batch": SearchEntry(
        aux_at_full_weight_per_micro_batch,
        "ddp",
        (AUX_MODEL,),
        Outcome.NOT_EQUIVALENT,
        "Megatron-LM PR #2217",
        "each micro-batch's router-loss mean at full weight",
    ),
    "router_loss_over_global_tokens": SearchEntry(
        router_loss_over_global_tokens,
        "cp",
        (AUX_MODEL,),
        Outcome.EQUIVALENT,
        "Megatron-LM PR #2217 (the fix)",
        "router losses apart, times data x context ranks / global tokens",
    ),
    "per_token_router_loss_times_tp_cp_tokens": SearchEntry(
        per_token_router_loss_times_tp_cp_tokens,
        "cp",
        (AUX_MODEL,),
        Outcome.EQUIVALENT,
        "Megatron-LM PR #5047 (the fix)",
        "per-token loss mode, router losses times local tokens x TP x CP",
    ),
    "router_loss_not_scaled_by_cp": SearchEntry(
        router_loss_not_scaled_by_cp,
        "cp",
        (AUX_MODEL,),
        Outcome.NOT_EQUIVALENT,
        "Megatron-LM #1652",
        "task loss times CP size, router losses not: their gradient 1/cp too small",
    ),
    "per_token_router_loss_times_local_tokens": SearchEntry(
        per_token_router_loss_times_local_tokens,
        "cp",
        (AUX_MODEL,),
        Outcome.NOT_EQUIVALENT,
        "Megatron-LM PR #5047; #1652",
        "per-token loss mode, router losses times the slice's tokens: 1/cp too small",
    ),
    "z_loss_summed_over_cp_slices": SearchEntry(
        z_loss_summed_over_cp_slices,
        "cp",
        (AUX_MODEL,),
        Outcome.NOT_EQUIVALENT,
        "Megatron-LM commit cac8d1a; PR #5047",
        "each slice's z-loss mean at full weight: cp times too strong",
    ),
    # The same weights under TP with sequence parallelism: each TP rank routes its slice of the tokens.
    "accumulator_step (TP sequence-parallel, MoE)": SearchEntry(
        accumulator_step, "tp", (AUX_MODEL,), Outcome.EQUIVALENT, "", "the reference accumulator"
    ),
    "router_loss_over_global_tokens (TP)": SearchEntry(
        router_loss_over_global_tokens,
        "tp",
        (AUX_MODEL,),
        Outcome.EQUIVALENT,
        "Megatron-LM commit cac8d1a (the fix)",
        "each TP slice's router losses at the task's weight (z-loss / tp)",
    ),
    "per_token_router_loss_times_tp_cp_tokens (TP)": SearchEntry(
        per_token_router_loss_times_tp_cp_tokens,
        "tp",
        (AUX_MODEL,),
        Outcome.EQUIVALENT,
        "Megatron-LM PR #5047 (the fix)",
        "per-token loss mode, router losses times local tokens x TP x CP",
    ),
    "per_token_router_loss_times_local_tokens (TP)": SearchEntry(
        per_token_router_loss_times_local_tokens,
        "tp",
        (AUX_MODEL,),
        Outcome.NOT_EQUIVALENT,
        "Megatron-LM PR #5047",
        "per-token loss mode, router losses times the TP rank's sequence-parallel slice: 1/tp too small",
    ),
    "z_loss_summed_over_cp_slices (TP)": SearchEntry(
        z_loss_summed_over_cp_slices,
        "tp",
        (AUX_MODEL,),
        Outcome.NOT_EQUIVALENT,
        "Megatron-LM commit cac8d1a",
        "each TP slice's z-loss mean at full weight, gradients summed over TP: tp times too strong",
    ),
}

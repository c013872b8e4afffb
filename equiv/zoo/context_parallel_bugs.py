"""Normalisation mistakes under context parallelism (``engine="cp"``).

Each step follows the candidate contract on a context-parallel rank: its
micro-batches are its data rank's samples cut to this rank's slice of every
sequence's positions, the model is DDP-wrapped over every rank (data x
context), so DDP averages the gradients over all of them, and
:func:`equiv.distributed.context_parallel.layout` gives the groups (as
Megatron's ``parallel_state`` does).  The full-batch objective is the mean of
the per-token loss over the window's real tokens, every slice of every
sequence of every data rank: the one right normaliser is that global count.
Slices hold ragged numbers of real tokens (padding sits at the end of a
sequence, so the last slices often hold none), which is what the wrong
normalisers below trip over.
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
from equiv.losses import item_count, loss_sum_and_count
from equiv.outcomes import Outcome
from equiv.zoo.distributed_bugs import SearchEntry

__all__ = [
    "CP_SEARCH_ZOO",
    "cp_global_token_count",
    "cp_local_token_mean",
    "per_token_loss_counts_never_returned",
    "per_token_loss_counts_returned",
    "token_count_over_data_ranks_only",
]


def _window_items(micro_batches: MicroBatches, loss_fn: Callable[..., Tensor]) -> Tensor:
    return torch.tensor(
        float(sum(int(item_count(loss_fn, targets)) for _, targets in micro_batches)), dtype=torch.float64
    )


def _scaled_backward(
    model: nn.Module, micro_batches: MicroBatches, loss_fn: Callable[..., Tensor], scale: float
) -> None:
    """Each micro-batch's summed loss times ``scale``, DDP's sync on the last micro-batch only."""
    assert isinstance(model, DistributedDataParallel)
    for index, (inputs, targets) in enumerate(micro_batches):
        last = index == len(micro_batches) - 1
        with contextlib.nullcontext() if last else model.no_sync():
            loss_sum, _ = loss_sum_and_count(loss_fn, model(inputs), targets)
            (loss_sum * scale).backward()


def cp_global_token_count(
    model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: MicroBatches, loss_fn: Callable[..., Tensor]
) -> None:
    """Correct: the real-token count all-reduced over every rank, data and context
    (Megatron's ``get_data_parallel_group(with_context_parallel=True)``, the fix of
    verl PR #6049 for #5983), each slice's summed loss over it, times the world size
    that DDP's average divides out; one gradient sync per window."""
    optimizer.zero_grad(set_to_none=True)
    items = _window_items(micro_batches, loss_fn)
    dist.all_reduce(items)
    _scaled_backward(model, micro_batches, loss_fn, dist.get_world_size() / float(items))
    optimizer.step()


def token_count_over_data_ranks_only(
    model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: MicroBatches, loss_fn: Callable[..., Tensor]
) -> None:
    """verl #5983: the count all-reduced over the pure data-parallel group, which
    leaves out the other context ranks' slices: each rank divides by the real
    tokens of its own slice position only, about 1/C of the window's (a
    gradient about C times too large, and a different factor per slice when
    the slices are ragged)."""
    optimizer.zero_grad(set_to_none=True)
    items = _window_items(micro_batches, loss_fn)
    dist.all_reduce(items, group=layout().data_parallel_group)  # BUG: without the context-parallel ranks
    _scaled_backward(model, micro_batches, loss_fn, dist.get_world_size() / max(float(items), 1.0))
    optimizer.step()


def cp_local_token_mean(
    model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: MicroBatches, loss_fn: Callable[..., Tensor]
) -> None:
    """Each rank divides its slice's summed loss by its slice's own real tokens (1
    for a slice with none, so it adds nothing instead of NaN) and DDP averages the
    ranks: a mean of per-slice token means, as if every slice held as many real
    tokens (Megatron-LM PR #7513: "divides by each shard's local count. DDP then
    averages those gradients over DP x CP"; verl PR #6836: policy losses "normalized
    as if tokens were uniformly distributed across CP ranks")."""
    optimizer.zero_grad(set_to_none=True)
    items = _window_items(micro_batches, loss_fn)
    _scaled_backward(model, micro_batches, loss_fn, 1.0 / max(float(items), 1.0))  # BUG: this slice's own count
    optimizer.step()


def _per_token_loss_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: MicroBatches,
    loss_fn: Callable[..., Tensor],
    *,
    report_counts: bool,
) -> None:
    """Megatron's ``calculate_per_token_loss`` contract, as verl drives it: the
    loss function hands back each micro-batch's summed loss and its real-token
    count; the schedule back-propagates the sums (gradients summed over ranks:
    times the world size under DDP's average), all-reduces the counts and, in
    ``finalize_model_grads``, divides every gradient by that total, skipping the
    division when the total is 0."""
    optimizer.zero_grad(set_to_none=True)
    reported = _window_items(micro_batches, loss_fn) if report_counts else torch.zeros((), dtype=torch.float64)
    _scaled_backward(model, micro_batches, loss_fn, float(dist.get_world_size()))
    dist.all_reduce(reported)
    if float(reported) > 0:  # Megatron: normalise only when some rank reported tokens
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        torch._foreach_div_(grads, float(reported))
    optimizer.step()


def per_token_loss_counts_never_returned(
    model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: MicroBatches, loss_fn: Callable[..., Tensor]
) -> None:
    """verl PR #6836: under CP, Megatron-Bridge switches on the per-token loss
    mode, whose loss function must return ``(loss_sum, num_tokens, ...)``; verl
    returned no count, "so Megatron saw 0 total tokens and skipped normalization":
    the gradient of the summed loss, the window's real-token count times too large."""
    _per_token_loss_step(model, optimizer, micro_batches, loss_fn, report_counts=False)


def per_token_loss_counts_returned(
    model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: MicroBatches, loss_fn: Callable[..., Tensor]
) -> None:
    """The fix of verl PR #6836: the same per-token loss mode with each slice's
    real-token count returned, so the division by the global count happens."""
    _per_token_loss_step(model, optimizer, micro_batches, loss_fn, report_counts=True)


#: The context-parallel zoo as the search meets it (engine "cp", the token model).
CP_SEARCH_ZOO: dict[str, SearchEntry] = {
    "accumulator_step (CP)": SearchEntry(
        accumulator_step, "cp", ("tokens",), Outcome.EQUIVALENT, "", "the reference accumulator"
    ),
    "cp_global_token_count": SearchEntry(
        cp_global_token_count,
        "cp",
        ("tokens",),
        Outcome.EQUIVALENT,
        "verl PR #6049 (fixes #5983)",
        "summed loss / real tokens all-reduced over data x context ranks",
    ),
    "per_token_loss_counts_returned": SearchEntry(
        per_token_loss_counts_returned,
        "cp",
        ("tokens",),
        Outcome.EQUIVALENT,
        "verl PR #6836 (the fix)",
        "per-token loss mode, each slice's count returned",
    ),
    "token_count_over_data_ranks_only": SearchEntry(
        token_count_over_data_ranks_only,
        "cp",
        ("tokens",),
        Outcome.NOT_EQUIVALENT,
        "verl #5983",
        "token count all-reduced over pure DP: undercounted by about the CP factor",
    ),
    "per_token_loss_counts_never_returned": SearchEntry(
        per_token_loss_counts_never_returned,
        "cp",
        ("tokens",),
        Outcome.NOT_EQUIVALENT,
        "verl PR #6836",
        "0 tokens reported: Megatron skips the normalisation",
    ),
    "cp_local_token_mean": SearchEntry(
        cp_local_token_mean,
        "cp",
        ("tokens",),
        Outcome.NOT_EQUIVALENT,
        "Megatron-LM PR #7513",
        "each slice's own token mean (1 for an empty slice), averaged over DP x CP",
    ),
    "accumulator_step (FSDP2 + CP)": SearchEntry(
        accumulator_step, "fsdp2+cp", ("tokens",), Outcome.EQUIVALENT, "", "the reference accumulator"
    ),
}

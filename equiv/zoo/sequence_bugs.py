"""Accumulation steps that get packed sequences or RL normalisers wrong.

They need the losses of :mod:`equiv.losses.packed` or :mod:`equiv.losses.policy`
(the packed DPO step reads the pairs' margins, the AReaL step the response
tokens before the token filter); the others are steps of
:data:`equiv.zoo.bugs.BUGS` whose mistake these losses are where it was
reported.  Each table maps a name to the step and the loss its report is about.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from equiv.batches import MicroBatches
from equiv.losses.packed import PackedDPO, PackedLoss
from equiv.losses.policy import PolicyLoss
from equiv.zoo.bugs import _clip_and_step, mean_of_means, sample_weighted_token_loss

__all__ = [
    "PACKED_BUGS",
    "POLICY_BUGS",
    "SEQUENCE_BUG_REPORTS",
    "dpo_pairs_swapped",
    "row_mean_of_sequence_means",
    "selected_count_per_micro_batch",
]


def _loss_of(loss_fn: Any, loss_class: type, needs: str) -> Any:
    if not isinstance(loss_fn, loss_class):
        raise TypeError(f"this step needs {needs}, got {loss_fn!r}")
    return loss_fn


def dpo_pairs_swapped(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: MicroBatches,
    loss_fn: Callable[..., Tensor],
    *,
    max_grad_norm: float | None = None,
) -> None:
    """Packed DPO reading each pair of a packed row as (rejected, chosen): every
    margin's sign flipped, so the update pushes the rejected answers up (packed
    DPO with a gradient of the wrong sign, ms-swift #10144).  Normalised over the
    window's pairs, so only the sign is wrong."""
    loss = _loss_of(loss_fn, PackedDPO, "loss 'packed_dpo' (chosen/rejected pairs packed into rows)")
    optimizer.zero_grad(set_to_none=True)
    pairs = sum(loss.count(targets) for _, targets in micro_batches)
    for inputs, targets in micro_batches:
        margins = loss.pair_margins(model(inputs), targets, swapped=True)
        (-F.logsigmoid(margins).sum() / pairs).backward()
    _clip_and_step(model, optimizer, max_grad_norm)


def row_mean_of_sequence_means(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: MicroBatches,
    loss_fn: Callable[..., Tensor],
    *,
    max_grad_norm: float | None = None,
) -> None:
    """A per-sequence mean taken per packed row: each row's mean of its
    sequences' losses, then a mean over the window's rows.  Rows holding more
    sequences weigh each of them less: wrong, even unaccumulated, whenever rows
    hold different numbers of sequences (a per-sample mean written for unpacked
    rows, kept after packing)."""
    loss = _loss_of(loss_fn, PackedLoss, "a packed loss (sequences per row)")
    optimizer.zero_grad(set_to_none=True)
    rows = sum(int(targets.shape[0]) for _, targets in micro_batches)
    for inputs, targets in micro_batches:
        per_sequence, row_of = loss.sequence_losses(model(inputs), targets)
        batch = int(targets.shape[0])
        sums = torch.zeros(batch, dtype=per_sequence.dtype, device=per_sequence.device).index_add(
            0, row_of, per_sequence
        )
        counts = torch.zeros(batch, dtype=per_sequence.dtype, device=per_sequence.device).index_add(
            0, row_of, torch.ones_like(per_sequence)
        )
        ((sums / counts.clamp(min=1)).sum() / rows).backward()
    _clip_and_step(model, optimizer, max_grad_norm)


def selected_count_per_micro_batch(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: MicroBatches,
    loss_fn: Callable[..., Tensor],
    *,
    max_grad_norm: float | None = None,
) -> None:
    """Each micro-batch's loss divided by the tokens its filter kept (k_j) while
    the engine weights it by its share of the tokens before the filter (n_j / N):
    ``Σ_j (n_j / N) (A_j / k_j)``, the full batch's ``A / k`` only when every
    micro-batch keeps the same fraction, so the micro-batch split changes the
    objective (AReaL #1730, M2PO's token selection)."""
    loss = _loss_of(loss_fn, PolicyLoss, "a policy loss (response and loss masks)")
    optimizer.zero_grad(set_to_none=True)
    responses = sum(loss.response_count(targets) for _, targets in micro_batches)
    for inputs, targets in micro_batches:
        local = loss.sum(model(inputs), targets) / loss.count(targets).clamp(min=1)
        (local * loss.response_count(targets) / responses).backward()
    _clip_and_step(model, optimizer, max_grad_norm)


#: name -> (step, the packed loss its report is about); "sequence_means_weighted_by_rows" is
#: the zoo's sample weighting, met where items are sequences and samples are packed rows.
PACKED_BUGS: dict[str, tuple[Callable[..., Any], str]] = {
    "dpo_pairs_swapped": (dpo_pairs_swapped, "packed_dpo"),
    "row_mean_of_sequence_means": (row_mean_of_sequence_means, "packed_sequence_ce"),
    "sequence_means_weighted_by_rows": (sample_weighted_token_loss, "packed_sequence_ce"),
}

#: name -> (step, the policy loss its report is about).  SkyRL's legacy token mean is the
#: zoo's mean of means, Trinity-RFT's default the zoo's sample (sequence) weighting.
POLICY_BUGS: dict[str, tuple[Callable[..., Any], str]] = {
    "token_mean_of_micro_batch_means": (mean_of_means, "policy_dapo"),
    "token_means_weighted_by_sequences": (sample_weighted_token_loss, "policy_dapo"),
    "selected_count_per_micro_batch": (selected_count_per_micro_batch, "policy_dapo"),
}

#: name -> the public report each step of :data:`PACKED_BUGS` / :data:`POLICY_BUGS` reproduces
#: ("" for equiv's own zoo), as reports/equivalence.md cites it.
SEQUENCE_BUG_REPORTS: dict[str, str] = {
    "dpo_pairs_swapped": "ms-swift #10144 (packed DPO, a gradient of the wrong sign)",
    "row_mean_of_sequence_means": "",
    "sequence_means_weighted_by_rows": "",
    "token_mean_of_micro_batch_means": "SkyRL PR #925 / #1296 (a mean of micro-batch token means; SFT path #1504)",
    "token_means_weighted_by_sequences": "Trinity-RFT #336 (sequence-weighted by default, the fix an opt-in flag)",
    "selected_count_per_micro_batch": "AReaL #1730 (the micro-batch split changes the objective)",
}

"""Losses over packed rows: several sequences per row, their boundaries given by position ids.

Packing (Hugging Face's ``DataCollatorWithFlattening``, ``padding_free`` in TRL
and ms-swift) concatenates sequences into one row; where one ends and the next
begins is told by its position ids restarting at 0 (``cu_seqlens`` are their
cumulative lengths).  The model (:func:`equiv.cases.packed.packed_lm`) attends
within a sequence only; the loss must average over the right items:

- ``packed_token_ce``: one mean over every real token of the batch;
- ``packed_sequence_ce``: each sequence's token mean, then a mean over the
  sequences (items are sequences: a row holds several);
- ``packed_row_ce``: each row's token mean, then a mean over rows (items are rows);
- ``packed_dpo``: DPO (Rafailov et al. 2023, the sigmoid loss TRL's
  ``DPOTrainer`` documents): each row holds chosen/rejected pairs, sequence
  ``2k`` chosen and ``2k + 1`` rejected; a pair's loss is
  ``-log σ(β ((log π(c) - log π_ref(c)) - (log π(r) - log π_ref(r))))`` with a
  sequence's log-probability the sum over its labelled tokens; the mean is over pairs.

Every one follows the sum + count protocol of :class:`equiv.losses.Loss`, so
the reference accumulator (``Σ sums / Σ counts`` over the window) reproduces
the full batch, and a step that weights micro-batches by rows when items are
sequences (or means per row what should be per sequence) is found.

Targets are ``(batch, 3, seq)`` floats: the labels (``-100``: no label), the
position ids (``-1``: padding) and the reference model's per-token
log-probabilities (used by DPO only); :meth:`PackedLoss.draw_targets` draws
them for the inputs :func:`equiv.cases.packed.packed_lm` drew.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from equiv.losses.items import Loss

__all__ = [
    "IGNORE",
    "PACKED_LOSSES",
    "PackedDPO",
    "PackedLoss",
    "PackedRowCrossEntropy",
    "PackedSequenceCrossEntropy",
    "PackedTokenCrossEntropy",
    "segments",
]

#: The label of a token that has none (padding, a sequence's last token).
IGNORE = -100


def segments(positions: Tensor) -> Tensor:
    """Each token's sequence within its row, from position ids: 0, 1, ... where
    the positions restart at 0; -1 for padding (position -1)."""
    starts = (positions == 0).long()
    index = starts.cumsum(-1) - 1
    return torch.where(positions < 0, torch.full_like(index, -1), index)


class PackedLoss(Loss):
    """Base of the packed losses: per-token cross-entropy and per-sequence sums."""

    item_weighted: ClassVar[bool] = True

    @staticmethod
    def _parts(target: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        if target.dim() != 3 or target.shape[1] != 3:
            raise ValueError(
                f"packed losses need targets of shape (batch, 3, seq) (labels, position ids, reference "
                f"log-probs), got {tuple(target.shape)}"
            )
        labels, positions, reference = target.unbind(1)
        return labels.round().long(), positions.round().long(), reference

    def token_losses(self, output: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
        """Per-token cross-entropy (batch, seq), 0 where there is no label, and the label mask."""
        labels, _, _ = self._parts(target)
        if output.shape[:2] != labels.shape:
            raise ValueError(
                f"packed losses need (batch, seq, vocab) logits matching the labels {tuple(labels.shape)}, "
                f"got {tuple(output.shape)}"
            )
        mask = labels != IGNORE
        losses = F.cross_entropy(output.flatten(0, 1), labels.clamp(min=0).flatten(), reduction="none")
        return losses.view(labels.shape) * mask, mask

    def per_sequence(self, values: Tensor, target: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``values`` (batch, seq) summed per sequence: (sums, labelled tokens, row of each), one entry per
        sequence with a label, rows in order and sequences in order within a row."""
        labels, positions, _ = self._parts(target)
        batch, length = labels.shape
        seg = segments(positions)
        mask = (labels != IGNORE) & (seg >= 0)
        slot = (torch.arange(batch, device=labels.device).unsqueeze(1) * length + seg.clamp(min=0)).flatten()
        sums = torch.zeros(batch * length, dtype=values.dtype, device=values.device).index_add(
            0, slot, (values * mask).flatten()
        )
        counts = torch.zeros(batch * length, dtype=values.dtype, device=values.device).index_add(
            0, slot, mask.flatten().to(values.dtype)
        )
        kept = counts > 0
        rows = torch.arange(batch * length, device=labels.device) // length
        return sums[kept], counts[kept], rows[kept]

    def sequence_count(self, target: Tensor) -> Tensor:
        """How many sequences of ``target`` hold a label (a 0-d tensor)."""
        ones = torch.ones(target.shape[0], target.shape[2], dtype=target.dtype, device=target.device)
        return torch.tensor(self.per_sequence(ones, target)[1].numel(), device=target.device)

    def sequence_losses(self, output: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
        """Each sequence's token-mean cross-entropy and the row it sits in."""
        losses, _ = self.token_losses(output, target)
        sums, counts, rows = self.per_sequence(losses, target)
        return sums / counts, rows

    def draw_targets(self, inputs: Tensor, output_shape: tuple[int, ...], generator: torch.Generator) -> Tensor:
        """Random labels for the packed ``inputs`` (batch, 2, seq) of tokens and position ids: a label at
        every token but each sequence's last and the padding; reference log-probs near a uniform model's."""
        if inputs.dim() != 3 or inputs.shape[1] != 2 or len(output_shape) != 2:
            raise ValueError(
                f"packed losses need packed inputs (batch, 2, seq) of tokens and position ids and "
                f"(seq, vocab) outputs, got inputs {tuple(inputs.shape)}, output {output_shape}"
            )
        positions = inputs[:, 1]
        vocab = output_shape[1]
        labels = torch.randint(0, vocab, positions.shape, generator=generator)
        following = torch.cat([positions[:, 1:], torch.zeros_like(positions[:, :1])], dim=1)
        last = (positions >= 0) & (following <= 0)  # the next token starts a sequence, is padding, or there is none
        labels = labels.masked_fill((positions < 0) | last, IGNORE)
        reference = -torch.log(torch.tensor(float(vocab))) + 0.5 * torch.randn(positions.shape, generator=generator)
        return torch.stack([labels.float(), positions.float(), reference], dim=1)


class PackedTokenCrossEntropy(PackedLoss):
    """One mean over every labelled token of the batch, whatever sequence it is in."""

    name = "packed_token_ce"

    def sum(self, output: Tensor, target: Tensor) -> Tensor:
        return self.token_losses(output, target)[0].sum()

    def count(self, target: Tensor) -> Tensor:
        labels, _, _ = self._parts(target)
        return (labels != IGNORE).sum()


class PackedSequenceCrossEntropy(PackedLoss):
    """Each sequence's token mean, then a mean over the sequences (not over rows)."""

    name = "packed_sequence_ce"

    def sum(self, output: Tensor, target: Tensor) -> Tensor:
        return self.sequence_losses(output, target)[0].sum()

    def count(self, target: Tensor) -> Tensor:
        return self.sequence_count(target)


class PackedRowCrossEntropy(PackedLoss):
    """Each row's token mean, then a mean over the rows: an item is a row."""

    name = "packed_row_ce"

    def sum(self, output: Tensor, target: Tensor) -> Tensor:
        losses, mask = self.token_losses(output, target)
        return (losses.sum(-1) / mask.sum(-1).clamp(min=1)).sum()

    def count(self, target: Tensor) -> int:
        return int(target.shape[0])


class PackedDPO(PackedLoss):
    """DPO's sigmoid loss over chosen/rejected pairs packed into rows (see the module's docstring)."""

    name = "packed_dpo"
    #: DPO's temperature (TRL's default).
    beta: ClassVar[float] = 0.1

    def pair_margins(self, output: Tensor, target: Tensor, *, swapped: bool = False) -> Tensor:
        """β × (chosen's log-ratio − rejected's) per pair; ``swapped`` reads each pair as (rejected, chosen)."""
        losses, _ = self.token_losses(output, target)
        _, _, reference = self._parts(target)
        policy, _, rows = self.per_sequence(-losses, target)
        ref, _, _ = self.per_sequence(reference, target)
        if policy.numel() % 2 or not torch.equal(rows[0::2], rows[1::2]):
            raise ValueError(
                "packed DPO needs each row to hold whole chosen/rejected pairs (an even number of "
                f"labelled sequences per row), got sequences in rows {rows.tolist()}"
            )
        ratios = policy - ref
        chosen, rejected = (ratios[1::2], ratios[0::2]) if swapped else (ratios[0::2], ratios[1::2])
        return self.beta * (chosen - rejected)

    def sum(self, output: Tensor, target: Tensor) -> Tensor:
        return -F.logsigmoid(self.pair_margins(output, target)).sum()

    def count(self, target: Tensor) -> Tensor:
        return self.sequence_count(target) // 2


#: The packed losses by name (registered in :data:`equiv.losses.LOSSES` by the package).
PACKED_LOSSES: dict[str, type[PackedLoss]] = {
    cls.name: cls for cls in (PackedTokenCrossEntropy, PackedSequenceCrossEntropy, PackedRowCrossEntropy, PackedDPO)
}

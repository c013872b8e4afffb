"""A packed-sequence model family (model ``"packed_lm"``): several sequences per row.

Each row of the inputs is ``(2, seq_len)``: the tokens and their position ids,
which restart at 0 where a new sequence begins (``-1``: padding after the last
sequence), as Hugging Face's ``DataCollatorWithFlattening`` hands them to a
model.  The model embeds tokens and positions and runs one causal attention
block whose mask keeps each token inside its own sequence (what
``flash_attn_varlen_func`` does with ``cu_seqlens``), then an LM head: logits
``(seq_len, vocab)`` per row, for the losses of :mod:`equiv.losses.packed`.

A row holds sequences of 2 tokens or more (each has a label to predict);
``pairs=True`` packs them as chosen/rejected pairs (an even number per row, the
two of a pair side by side), for ``loss="packed_dpo"``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from equiv.cases.models import ModelBundle, register_model
from equiv.losses.packed import segments

__all__ = ["PackedLM", "draw_packing", "packed_lm"]

#: The shortest sequence a row holds: a token and the label after it.
_SHORTEST = 2


def draw_packing(batch_size: int, seq_len: int, generator: torch.Generator, *, pairs: bool = False) -> Tensor:
    """Position ids (batch, seq_len) of rows packed with random-length sequences (``-1``: padding)."""
    unit = 2 * _SHORTEST if pairs else _SHORTEST
    if seq_len < unit:
        raise ValueError(
            f"packed rows of seq_len={seq_len} cannot hold a {'pair of sequences' if pairs else 'sequence'} "
            f"(at least {unit} tokens)"
        )
    rows = torch.full((batch_size, seq_len), -1, dtype=torch.long)
    for row in range(batch_size):
        at = 0
        while seq_len - at >= unit:
            # After the first, stop early now and then: the row's tail is padding.
            if at and int(torch.randint(0, 4, (), generator=generator)) == 0:
                break
            room = seq_len - at
            for member in range(2 if pairs else 1):
                most = room - (_SHORTEST if pairs and member == 0 else 0)
                length = int(torch.randint(_SHORTEST, max(most, _SHORTEST) + 1, (), generator=generator))
                rows[row, at : at + length] = torch.arange(length)
                at, room = at + length, room - length
    return rows


class PackedLM(nn.Module):
    """Token + position embeddings, one causal attention block kept within each sequence, an LM head."""

    def __init__(self, vocab_size: int, width: int, seq_len: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, width)
        self.position = nn.Embedding(seq_len, width)
        self.norm = nn.LayerNorm(width)
        # No biases on the projections: a key bias gets an exactly-zero gradient under
        # softmax (rounding noise that adaptive optimizers amplify; see CausalLM).
        self.query = nn.Linear(width, width, bias=False)
        self.key = nn.Linear(width, width, bias=False)
        self.value = nn.Linear(width, width, bias=False)
        self.head = nn.Linear(width, vocab_size)

    def forward(self, packed: Tensor) -> Tensor:
        tokens, positions = packed[:, 0], packed[:, 1]
        hidden = self.embed(tokens) + self.position(positions.clamp(min=0))
        normed = self.norm(hidden)
        seg = segments(positions)
        length = tokens.shape[1]
        causal = torch.ones(length, length, dtype=torch.bool, device=tokens.device).tril()
        allowed = (seg.unsqueeze(2) == seg.unsqueeze(1)) & (seg.unsqueeze(1) >= 0) & causal
        # Padding queries see only themselves (no sequence to attend to, and no NaN from an empty row).
        allowed = allowed | torch.eye(length, dtype=torch.bool, device=tokens.device)
        scores = self.query(normed) @ self.key(normed).transpose(1, 2) / normed.shape[-1] ** 0.5
        weights = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        logits: Tensor = self.head(hidden + weights @ self.value(normed))
        return logits


@register_model("packed_lm")
def packed_lm(*, vocab_size: int = 7, width: int = 8, seq_len: int = 8, pairs: bool = False) -> ModelBundle:
    """Rows of ``seq_len`` tokens packing several sequences (see the module's docstring); ``pairs``: as
    chosen/rejected pairs (for ``loss="packed_dpo"``)."""
    draw_packing(1, seq_len, torch.Generator().manual_seed(0), pairs=pairs)  # a bad seq_len fails here, named

    def make(batch_size: int, generator: torch.Generator) -> Tensor:
        positions = draw_packing(batch_size, seq_len, generator, pairs=pairs)
        tokens = torch.randint(0, vocab_size, (batch_size, seq_len), generator=generator)
        return torch.stack([tokens.masked_fill(positions < 0, 0), positions], dim=1)

    return ModelBundle(PackedLM(vocab_size, width, seq_len), make, (seq_len, vocab_size))

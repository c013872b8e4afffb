"""A tiny causal language model, defined here (no downloads).

Embedding + learned positions, one pre-norm causal self-attention block with
an MLP, and an LM head: the smallest model where the 2024 transformers bug
class shows (a mean of per-micro-batch token means instead of one mean over
the window's real tokens).  Registered as the model family ``"causal_lm"``;
use it with ``loss="token_cross_entropy"``, whose targets are variable-length
sequences padded with ``ignore_index``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from equiv.models import ModelBundle, register_model

__all__ = ["CausalLM"]


class CausalLM(nn.Module):
    def __init__(self, vocab_size: int, width: int, heads: int, seq_len: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, width)
        self.position = nn.Parameter(torch.randn(seq_len, width) * 0.02)
        self.norm1 = nn.LayerNorm(width)
        # dropout=0: dropout would make any accumulation inherently non-equivalent.
        # bias=False: the key bias gets an exactly-zero gradient, whose rounding noise
        # Adam would turn into real updates (a false mismatch, not a bug).
        self.attention = nn.MultiheadAttention(width, heads, dropout=0.0, bias=False, batch_first=True)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
        self.head = nn.Linear(width, vocab_size)
        self.register_buffer("causal_mask", torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool), 1), persistent=False)

    def forward(self, tokens: Tensor) -> Tensor:
        length = tokens.shape[1]
        hidden = self.embed(tokens) + self.position[:length]
        normed = self.norm1(hidden)
        causal_mask: Tensor = self.causal_mask  # type: ignore[assignment]  # a registered buffer
        attended, _ = self.attention(normed, normed, normed, attn_mask=causal_mask[:length, :length],
                                     need_weights=False)
        hidden = hidden + attended
        hidden = hidden + self.mlp(self.norm2(hidden))
        logits: Tensor = self.head(hidden)
        return logits


@register_model("causal_lm")
def causal_lm(*, vocab_size: int = 13, width: int = 8, heads: int = 2, seq_len: int = 6) -> ModelBundle:
    def make(batch_size: int, generator: torch.Generator) -> Tensor:
        return torch.randint(0, vocab_size, (batch_size, seq_len), generator=generator)

    return ModelBundle(CausalLM(vocab_size, width, heads, seq_len), make, (seq_len, vocab_size))

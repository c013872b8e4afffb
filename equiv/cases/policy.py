"""A policy model family (model ``"policy"``) for the RL losses of :mod:`equiv.losses.policy`.

Each row is a completion of ``seq_len`` tokens; the model returns each token's
log-probability given the token before it (a start token before the first):
``(batch, seq_len)``, what GRPO's surrogate takes (TRL's ``per_token_logps``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from equiv.cases.models import ModelBundle, register_model

__all__ = ["Policy", "policy"]


class Policy(nn.Module):
    """Embedding of the previous token -> tanh layer -> vocabulary; the log-prob of each given token."""

    def __init__(self, vocab_size: int, width: int) -> None:
        super().__init__()
        # One more embedding row: the start token before the first completion token.
        self.embed = nn.Embedding(vocab_size + 1, width)
        self.mix = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab_size)
        self.start = vocab_size

    def forward(self, tokens: Tensor) -> Tensor:
        previous = torch.cat([torch.full_like(tokens[:, :1], self.start), tokens[:, :-1]], dim=1)
        logits = self.head(torch.tanh(self.mix(self.embed(previous))))
        return F.log_softmax(logits, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


@register_model("policy")
def policy(*, vocab_size: int = 7, width: int = 8, seq_len: int = 6) -> ModelBundle:
    """Completions of ``seq_len`` tokens; output: each token's log-probability (use a ``policy_*`` loss)."""

    def make(batch_size: int, generator: torch.Generator) -> Tensor:
        return torch.randint(0, vocab_size, (batch_size, seq_len), generator=generator)

    return ModelBundle(Policy(vocab_size, width), make, (seq_len,))

"""RL policy-gradient losses and their normalisers: GRPO, DAPO, Dr. GRPO (and BNPO's local one).

:class:`GRPOObjective` is GRPO's per-token clipped surrogate as TRL's
``GRPOTrainer._compute_loss`` defines it, with the full-batch normaliser each
loss type documents (:data:`GRPO_LOSS_TYPES`); the TRL audit
(:mod:`equiv.peers.trl`) replays trainers' windows with it.  :class:`PolicyLoss`
hands the same objective to the candidate contract, so a trainer's step written
to it is searched (``equiv verify``) the way TRL's trainers were measured:

- ``policy_grpo``: each sequence's token mean, then a mean over sequences;
- ``policy_dapo``: one mean over the window's selected tokens (TRL's default ``dapo``);
- ``policy_dr_grpo``: the sum over tokens / (sequences x the completion length).

BNPO normalises by the *local* batch's tokens by design; over one batch that
is DAPO's objective, so it is no loss of its own here: a step that normalises
each micro-batch by its own tokens is the BNPO-style normaliser, searched
against DAPO's full-batch objective (a mean of micro-batch means).

The model output is the completion tokens' log-probabilities ``(batch, seq)``
(:func:`equiv.cases.policy.policy`); the targets ``(batch, 3, seq)`` hold the
response mask (the completion's tokens), the loss mask (the tokens the loss
keeps: a subset, as a token filter such as M2PO's leaves it) and each
sequence's advantage along its tokens.  Training is on-policy (one update per
generation, TRL's default ``num_iterations=1``): the old log-probs are the
current ones, detached, so the ratio is 1 and its gradient the policy gradient.
"""

from __future__ import annotations

import torch
from torch import Tensor

from equiv.losses.items import Loss

__all__ = ["GRPO_LOSS_TYPES", "POLICY_LOSSES", "DAPOLoss", "DrGRPOLoss", "GRPOLoss", "GRPOObjective", "PolicyLoss"]

#: loss_type -> (what it normalises by, the full-batch objective it documents)
GRPO_LOSS_TYPES: dict[str, tuple[str, str]] = {
    "grpo": ("sequences", "mean over a sequence's tokens, then over the window's sequences"),
    "sapo": ("sequences", "mean over a sequence's tokens, then over the window's sequences"),
    "luspo": ("sequences", "sequence-level ratio; the sequence's loss × its length, mean over the window's sequences"),
    "dr_grpo": ("constant", "sum over the window's tokens / (its sequences × max_completion_length)"),
    "dapo": ("tokens", "sum over the window's tokens / its active tokens (the global accumulated batch)"),
    "cispo": ("tokens", "sum over the window's tokens / its active tokens (the global accumulated batch)"),
    "bnpo": (
        "local tokens",
        "by design each local batch's token mean (TRL's docs: 'normalization is performed "
        "over the local batch only'); measured against the window's token mean",
    ),
}


class GRPOObjective:
    """GRPO's per-token surrogate as ``GRPOTrainer._compute_loss`` defines it
    (beta = 0, no entropy mask or bonus, no vLLM), as a named sum + count
    (:class:`equiv.Loss`'s protocol) so the audit's replay divides the window's
    sum by the window's count.

    The model output it takes is the completion tokens' log-probabilities (see
    :func:`completion_log_probs`); the targets are :func:`pack`'s tensor:
    the completion mask, the advantages, the old log-probs (NaN where the
    trainer uses the current ones, detached) and a per-micro-batch normaliser.
    ``per_micro_batch=False``: the loss type's documented full-batch objective;
    ``True``: ``Σ_i sum_i / n_i``, a hypothesis of :data:`HYPOTHESES`."""

    def __init__(
        self,
        loss_type: str,
        *,
        epsilon_low: float,
        epsilon_high: float,
        max_completion_length: int,
        sapo_temperature_pos: float = 1.0,
        sapo_temperature_neg: float = 1.05,
        per_micro_batch: bool = False,
    ) -> None:
        if loss_type not in GRPO_LOSS_TYPES:
            raise ValueError(f"loss_type {loss_type!r} is not reproduced here (known: {sorted(GRPO_LOSS_TYPES)})")
        self.loss_type, self.per_micro_batch = loss_type, per_micro_batch
        self.epsilon_low, self.epsilon_high = epsilon_low, epsilon_high
        self.max_completion_length = max_completion_length
        self.sapo = (sapo_temperature_pos, sapo_temperature_neg)

    def _per_token(self, logps: Tensor, packed: Tensor) -> tuple[Tensor, Tensor]:
        mask, advantages, old, _ = packed.unbind(0)
        old = torch.where(torch.isnan(old), logps.detach(), old)
        log_ratio = logps - old
        if self.loss_type == "luspo":  # importance_sampling_level="sequence"
            log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
            advantages = advantages[:, :1]
        coef = torch.exp(log_ratio)
        if self.loss_type == "cispo":
            loss = -torch.clamp(coef, max=self.epsilon_high).detach() * advantages * logps
        elif self.loss_type == "sapo":
            pos, neg = self.sapo
            temperatures = torch.where(
                advantages > 0, torch.full_like(advantages, pos), torch.full_like(advantages, neg)
            )
            loss = -torch.sigmoid(temperatures * (coef - 1)) * 4 / temperatures * advantages
        else:
            clipped = torch.clamp(coef, 1 - self.epsilon_low, 1 + self.epsilon_high)
            loss = -torch.min(coef * advantages, clipped * advantages)
        return loss, mask

    def sum(self, logps: Tensor, packed: Tensor) -> Tensor:
        loss, mask = self._per_token(logps, packed)
        if self.loss_type in ("grpo", "sapo"):
            summed = ((loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).sum()
        else:  # luspo's (B, 1) loss broadcasts: its sequence loss times its length
            summed = (loss * mask).sum()
        if self.per_micro_batch:  # Σ_i sum_i / n_i over the window, with count 1 per micro-batch
            normaliser, accumulation = packed[3, 0, 0], packed[3, 1, 0]
            return summed * accumulation / normaliser
        return summed

    def count(self, packed: Tensor) -> Tensor:
        mask = packed[0]
        if self.per_micro_batch:
            return torch.ones((), dtype=packed.dtype)
        if self.loss_type in ("grpo", "sapo", "luspo"):
            return torch.tensor(float(mask.shape[0]), dtype=packed.dtype)
        if self.loss_type == "dr_grpo":
            return torch.tensor(float(mask.shape[0] * self.max_completion_length), dtype=packed.dtype)
        return mask.sum()

    def __repr__(self) -> str:
        return f"GRPOObjective({self.loss_type!r}, per_micro_batch={self.per_micro_batch})"


#: DAPO's clip range (epsilon_low, epsilon_high); inert on-policy (the ratio is 1), kept as TRL sets it.
_EPSILONS = (0.2, 0.28)


class PolicyLoss(Loss):
    """:class:`GRPOObjective` of one loss type behind the candidate contract (see the module's docstring)."""

    item_weighted = True
    loss_type: str = "dapo"

    def objective(self, target: Tensor) -> GRPOObjective:
        """The loss type's full-batch objective for completions of ``target``'s length."""
        low, high = _EPSILONS
        return GRPOObjective(self.loss_type, epsilon_low=low, epsilon_high=high, max_completion_length=target.shape[-1])

    @staticmethod
    def packed(target: Tensor) -> Tensor:
        """``target`` as :class:`GRPOObjective` takes it: (4, batch, seq) of the loss mask, the advantages,
        the old log-probs (NaN: on-policy) and no per-micro-batch normaliser."""
        if target.dim() != 3 or target.shape[1] != 3:
            raise ValueError(
                f"policy losses need targets of shape (batch, 3, seq) (response mask, loss mask, "
                f"advantages), got {tuple(target.shape)}"
            )
        _, mask, advantages = target.unbind(1)
        return torch.stack([mask, advantages, torch.full_like(mask, float("nan")), torch.zeros_like(mask)])

    def sum(self, output: Tensor, target: Tensor) -> Tensor:
        return self.objective(target).sum(output, self.packed(target))

    def count(self, target: Tensor) -> Tensor:
        # An integer: the Accumulator counts items exactly (every normaliser here is a whole number).
        return self.objective(target).count(self.packed(target)).round().long().to(target.device)

    def response_count(self, target: Tensor) -> Tensor:
        """The response tokens of ``target`` before any token filter (the engine's weight in AReaL #1730)."""
        return target[:, 0].sum()

    def draw_targets(self, inputs: Tensor, output_shape: tuple[int, ...], generator: torch.Generator) -> Tensor:
        """Completions of random lengths (at least one token), about a third of their tokens dropped by the
        loss mask (at least one kept per completion), one advantage of either sign per completion."""
        batch, length = inputs.shape[0], output_shape[0]
        lengths = torch.randint(1, length + 1, (batch, 1), generator=generator)
        response = torch.arange(length).expand(batch, length) < lengths
        kept = (torch.rand(batch, length, generator=generator) > 1 / 3) | (torch.arange(length) == 0)
        advantages = torch.randn(batch, 1, generator=generator).expand(batch, length)
        return torch.stack([response.float(), (response & kept).float(), advantages * response], dim=1)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class GRPOLoss(PolicyLoss):
    """GRPO: each sequence's token mean, then a mean over the window's sequences."""

    name = "policy_grpo"
    loss_type = "grpo"


class DAPOLoss(PolicyLoss):
    """DAPO (TRL's default): the window's token sum over its selected tokens."""

    name = "policy_dapo"
    loss_type = "dapo"


class DrGRPOLoss(PolicyLoss):
    """Dr. GRPO: the window's token sum / (its sequences × the completion length)."""

    name = "policy_dr_grpo"
    loss_type = "dr_grpo"


#: The policy losses by name (registered in :data:`equiv.losses.LOSSES` by the package).
POLICY_LOSSES: dict[str, type[PolicyLoss]] = {cls.name: cls for cls in (GRPOLoss, DAPOLoss, DrGRPOLoss)}

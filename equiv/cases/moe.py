"""A small mixture-of-experts family (model ``"moe"``) with a load-balancing loss.

Each token goes to its ``top_k`` experts (a softmax router, gates renormalised
over the chosen experts), the tokens of a sample are pooled, and a linear head
gives the task output.  The load-balancing loss is Switch Transformer's
``experts x Σ_e f_e P_e`` (``f_e``: the fraction of routed slots that chose
expert ``e``, ``P_e``: its mean router probability), taken either

- per sequence (``balance="sequence"``, DeepSeek-V3's sequence-wise balance
  loss): one value per sample, so the window's loss is a mean over samples and
  accumulation can reproduce it exactly; or
- over the whole batch (``balance="batch"``): ``f`` and ``P`` are batch means
  and their product is not linear in the samples, so micro-batches each balance
  their own statistics and no accumulation reproduces the full batch's loss
  (torchtitan PR #3000 rejects a batch-wise aux loss under accumulation for
  this reason).  :func:`equiv.judging.inherent.inherent_non_equivalences` reports it, as it
  reports BatchNorm.

A router z-loss (ST-MoE, Zoph et al. 2022, eq. 5: the mean over tokens of
``logsumexp(router_logits)^2``) is added per sequence with ``z_weight`` > 0:
one value per sample, like the sequence-wise balance loss, so the full-batch
objective stays a mean over samples.

The model returns ``(batch, out_features + 1)``: the task output and, in the
last column, each sample's weighted aux loss, so that a loss following the
candidate contract sees both (:class:`equiv.losses.MSEWithAux`).

The token-level family (model ``"token_moe"``) keeps every position apart: a
per-token output, and each token's share of its sequence's router losses in
two last columns (``aux_weight x experts x Σ_e f_e p_te``, with ``f_e`` the
sequence's routing fractions, and ``z_weight x logsumexp(logits_t)^2``), so
the mean over a sequence's tokens is the same sequence-wise balance loss and
z-loss, and the loss is a sum over tokens (:class:`equiv.losses.TokenMSEWithAux`).
That is what context parallelism can split: under ``engine="cp"`` a rank holds
a slice of every sequence, and only ``f_e`` needs the other slices: the routing
counts are summed over the context-parallel group in the forward, as Megatron's
router sums ``tokens_per_expert`` over its TP x CP group (Megatron-LM #1652).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from equiv.cases.models import ModelBundle, register_model
from equiv.distributed.context_parallel import sequence_group

__all__ = ["BALANCES", "MoELayer", "MoEModel", "TokenMoEModel", "moe", "token_moe"]

#: Where the load-balancing statistics are taken: per sequence, or over the batch.
BALANCES: tuple[str, ...] = ("sequence", "batch")


class MoELayer(nn.Module):
    """Top-k routed experts (one linear map each) and their load-balancing loss."""

    def __init__(self, width: int, experts: int, top_k: int, balance: str) -> None:
        super().__init__()
        if balance not in BALANCES:
            raise ValueError(f"unknown balance {balance!r}; expected one of {list(BALANCES)}")
        if not 1 <= top_k <= experts:
            raise ValueError(f"top_k must be in 1..experts ({experts}), got {top_k}")
        self.balance = balance
        self.top_k = top_k
        self.router = nn.Linear(width, experts, bias=False)
        self.experts = nn.Parameter(torch.randn(experts, width, width) / width**0.5)

    def route(self, hidden: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """``hidden`` (batch, seq, width) -> (router logits, router probabilities, the
        experts' mixed output, each token's routing decisions over ``top_k``), the last
        with no gradient: Switch's ``f_e`` counts decisions."""
        logits = self.router(hidden)
        probs = torch.softmax(logits, dim=-1)
        top_probs, top_index = probs.topk(self.top_k, dim=-1)
        gates = torch.zeros_like(probs).scatter(-1, top_index, top_probs / top_probs.sum(-1, keepdim=True))
        # Every expert on every token, weighted by a gate that is zero off the top-k:
        # the same gradients as dispatching, in one deterministic einsum.
        outputs = torch.einsum("bsi,eoi->bseo", hidden, self.experts)
        mixed = torch.einsum("bse,bseo->bso", gates, outputs)
        chosen = torch.zeros_like(probs).scatter(-1, top_index, 1.0) / self.top_k
        return logits, probs, mixed, chosen

    def forward(self, hidden: Tensor, with_z: bool = False) -> tuple[Tensor, ...]:
        """``hidden`` (batch, seq, width) -> (mixed output, per-sample aux loss (batch,)),
        and with ``with_z`` each sample's router z-loss (batch,) too: the mean over its
        tokens of ``logsumexp(router_logits)^2``.  (One forward, so FSDP2's hooks run.)"""
        experts = self.experts.shape[0]
        logits, probs, mixed, chosen = self.route(hidden)
        z_loss = torch.logsumexp(logits, dim=-1).square().mean(1)
        if self.balance == "sequence":
            aux = experts * (chosen.mean(1) * probs.mean(1)).sum(-1)
        else:
            batch_aux = experts * (chosen.mean((0, 1)) * probs.mean((0, 1))).sum()
            aux = batch_aux.expand(hidden.shape[0])
        return (mixed, aux, z_loss) if with_z else (mixed, aux)


class MoEModel(nn.Module):
    """Input projection -> one MoE layer (residual) -> mean over tokens -> head;
    the aux loss times ``aux_weight`` (plus the router z-loss times ``z_weight``)
    rides along as the last output column."""

    def __init__(
        self,
        in_features: int,
        width: int,
        experts: int,
        top_k: int,
        out_features: int,
        balance: str,
        aux_weight: float,
        z_weight: float = 0.0,
    ) -> None:
        super().__init__()
        self.project = nn.Linear(in_features, width)
        self.moe = MoELayer(width, experts, top_k, balance)
        self.head = nn.Linear(width, out_features)
        self.aux_weight = aux_weight
        self.z_weight = z_weight

    def forward(self, inputs: Tensor) -> Tensor:
        hidden = torch.tanh(self.project(inputs))
        mixed, aux, z_loss = self.moe(hidden, with_z=True)
        task = self.head((hidden + mixed).mean(1))
        router = self.aux_weight * aux
        if self.z_weight:  # added only when asked, so a model without it computes exactly as before
            router = router + self.z_weight * z_loss
        return torch.cat([task, router.unsqueeze(-1)], dim=-1)


@register_model("moe")
def moe(
    *,
    in_features: int = 3,
    seq_len: int = 4,
    width: int = 4,
    experts: int = 4,
    top_k: int = 2,
    out_features: int = 2,
    balance: str = "sequence",
    aux_weight: float = 0.1,
    z_weight: float = 0.0,
) -> ModelBundle:
    """A one-layer top-k MoE on (seq_len, in_features) inputs; use it with
    ``loss="mse_aux"``.  ``balance`` "sequence" (equivalent under accumulation)
    or "batch" (inherently not: see the module docstring); ``z_weight`` > 0 adds
    the router z-loss per sequence."""

    def make(batch_size: int, generator: torch.Generator) -> Tensor:
        return torch.randn(batch_size, seq_len, in_features, generator=generator)

    module = MoEModel(in_features, width, experts, top_k, out_features, balance, aux_weight, z_weight)
    return ModelBundle(module, make, (out_features + 1,))


class TokenMoEModel(nn.Module):
    """Input projection -> one MoE layer (residual) -> head, at every position:
    ``(batch, seq, out_features + 2)``, the last two columns each token's weighted
    share of its sequence's load-balancing loss and router z-loss."""

    def __init__(
        self,
        in_features: int,
        width: int,
        experts: int,
        top_k: int,
        out_features: int,
        aux_weight: float,
        z_weight: float,
    ) -> None:
        super().__init__()
        self.project = nn.Linear(in_features, width)
        self.moe = MoELayer(width, experts, top_k, "sequence")
        self.head = nn.Linear(width, out_features)
        self.aux_weight = aux_weight
        self.z_weight = z_weight

    def forward(self, inputs: Tensor) -> Tensor:
        hidden = torch.tanh(self.project(inputs))
        logits, probs, mixed, chosen = self.moe.route(hidden)
        # The sequence's routing fractions f_e: this rank's positions, plus under
        # context parallelism every other slice of the same sequences (no gradient).
        counts, positions = chosen.sum(1), hidden.shape[1]
        group = sequence_group()
        if group is not None:
            counts = counts.detach().clone()
            torch.distributed.all_reduce(counts, group=group)
            positions *= torch.distributed.get_world_size(group)
        fractions = counts / positions
        experts = probs.shape[-1]
        aux = self.aux_weight * experts * (fractions.unsqueeze(1) * probs).sum(-1)
        z_loss = self.z_weight * torch.logsumexp(logits, dim=-1).square()
        return torch.cat([self.head(hidden + mixed), aux.unsqueeze(-1), z_loss.unsqueeze(-1)], dim=-1)


@register_model("token_moe")
def token_moe(
    *,
    in_features: int = 3,
    seq_len: int = 4,
    width: int = 4,
    experts: int = 4,
    top_k: int = 2,
    out_features: int = 2,
    aux_weight: float = 0.1,
    z_weight: float = 0.01,
) -> ModelBundle:
    """A one-layer top-k MoE with an output at every position of (seq_len, in_features)
    inputs; use it with ``loss="token_mse_aux"``.  Its sequence-wise balance loss and
    router z-loss ride along per token (module docstring), so context parallelism can
    split its positions (``engine="cp"``)."""

    def make(batch_size: int, generator: torch.Generator) -> Tensor:
        return torch.randn(batch_size, seq_len, in_features, generator=generator)

    module = TokenMoEModel(in_features, width, experts, top_k, out_features, aux_weight, z_weight)
    return ModelBundle(module, make, (seq_len, out_features + 2))

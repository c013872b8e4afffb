"""The full-batch objectives TRL's preference and distillation trainers document, as sum + count losses
(:class:`equiv.losses.Loss`) the audit replays in float64 (``equiv sweep trl``, :mod:`equiv.peers.trl_sweep`).

Each is the trainer's own per-item loss (read from TRL 1.16's ``_compute_loss``, the formulas cited per class)
summed over the window's items and divided by their count: what the trainer means by one optimizer step over
the window, whatever its micro-batches.  The items, per TRL's docs:

* ``DPOTrainer``: a preference pair (its ``loss_type`` per pair, then the mean over the pairs); ``loss_type="sft"``
  is the chosen completions' token mean, so its items are tokens;
* ``KTOTrainer``: an example (desirable or undesirable), each weighted by ``desirable_weight`` /
  ``undesirable_weight``, the mean over the examples;
* ``RewardTrainer``: a pair, ``-log σ(r_chosen - r_rejected)``, the mean over the pairs;
* ``GKDTrainer`` and ``DistillationTrainer``: a completion token, the generalized Jensen-Shannon divergence between
  the student's and the teacher's next-token distributions, the mean over the tokens.

The model's output each one takes is what :mod:`equiv.peers.trl_sweep` replays through the model class's own
``forward`` (TRL's fused LM head replaced, as in :mod:`equiv.peers.trl`), and its targets what the trainer's
micro-batch held that the model does not compute (the reference model's log-probabilities, the labels, the
teacher's log-probabilities), recorded as the trainer trained.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from equiv.losses.items import Loss

__all__ = [
    "DPO_PAIR_LOSSES",
    "DPOChosenNLL",
    "DPOPairs",
    "GeneralizedJSD",
    "KTOExamples",
    "RewardPairs",
    "generalized_jsd",
]

#: (chosen log-ratio c, rejected log-ratio r, chosen tokens, rejected tokens, beta, label smoothing) -> each pair's
#: loss, for DPOTrainer's ``loss_type`` (``DPOTrainer._compute_loss``, f_divergence_type="reverse_kl"; TRL 1.16)
PairLoss = Callable[[Tensor, Tensor, Tensor, Tensor, float, float], Tensor]


def _discopop(c: Tensor, r: Tensor, lc: Tensor, lr: Tensor, beta: float, smoothing: float, tau: float = 0.05) -> Tensor:
    """DiscoPOP (Eq. 5 of arXiv 2406.08414), with DPOConfig's default ``discopop_tau``."""
    logits = beta * (c - r)
    modulation = torch.sigmoid(logits / tau)
    return -F.logsigmoid(logits) * (1 - modulation) + torch.exp(-logits) * modulation


def _exo_pair(c: Tensor, r: Tensor, lc: Tensor, lr: Tensor, beta: float, smoothing: float) -> Tensor:
    """EXO-pref (Eq. 16 of arXiv 2402.00856) against the labels ``[1 - ε, ε]``."""
    delta = beta * (c - r)
    return torch.sigmoid(delta) * (F.logsigmoid(delta) - math.log1p(-smoothing)) + torch.sigmoid(-delta) * (
        F.logsigmoid(-delta) - math.log(smoothing)
    )


def _robust(c: Tensor, r: Tensor, lc: Tensor, lr: Tensor, beta: float, smoothing: float) -> Tensor:
    delta = beta * (c - r)
    return (-(1 - smoothing) * F.logsigmoid(delta) + smoothing * F.logsigmoid(-delta)) / (1 - 2 * smoothing)


DPO_PAIR_LOSSES: dict[str, PairLoss] = {
    "sigmoid": lambda c, r, lc, lr, beta, s: -F.logsigmoid(beta * (c - r)),
    "hinge": lambda c, r, lc, lr, beta, s: torch.relu(1 - beta * (c - r)),
    # IPO per completion token (TRL's normalisation, confirmed with the IPO authors per its comment)
    "ipo": lambda c, r, lc, lr, beta, s: ((c / lc.clamp(min=1) - r / lr.clamp(min=1)) - 1 / (2 * beta)) ** 2,
    "exo_pair": _exo_pair,
    "nca_pair": lambda c, r, lc, lr, beta, s: (
        -F.logsigmoid(beta * c) - 0.5 * F.logsigmoid(-beta * c) - 0.5 * F.logsigmoid(-beta * r)
    ),
    "robust": _robust,
    "bco_pair": lambda c, r, lc, lr, beta, s: -F.logsigmoid(beta * c) - F.logsigmoid(-beta * r),
    "sppo_hard": lambda c, r, lc, lr, beta, s: (c - 0.5 / beta) ** 2 + (r + 0.5 / beta) ** 2,
    "apo_zero": lambda c, r, lc, lr, beta, s: 1 - torch.sigmoid(beta * c) + torch.sigmoid(beta * r),
    "apo_down": lambda c, r, lc, lr, beta, s: torch.sigmoid(beta * c) + 1 - torch.sigmoid(beta * (c - r)),
    "discopop": _discopop,
    "sigmoid_norm": lambda c, r, lc, lr, beta, s: -F.logsigmoid(beta * (c / lc.clamp(min=1) - r / lr.clamp(min=1))),
}


class DPOPairs(Loss):
    """DPOTrainer's per-pair loss, the mean over the window's pairs.  Output: each completion's summed
    log-probability, the chosen ones then the rejected ones (``2P``, as TRL's batch is laid out); target
    ``(P, 4)``: the reference model's chosen and rejected log-probabilities, the chosen and rejected
    completions' token counts."""

    def __init__(self, loss_type: str, *, beta: float, label_smoothing: float = 0.0) -> None:
        if loss_type not in DPO_PAIR_LOSSES:
            raise ValueError(f"DPO loss_type {loss_type!r} is not a per-pair loss equiv reproduces: {DPO_PAIR_LOSSES}")
        self.loss_type, self.beta, self.label_smoothing = loss_type, beta, label_smoothing

    def sum(self, output: Tensor, target: Tensor) -> Tensor:
        chosen, rejected = output.chunk(2)
        pair_loss = DPO_PAIR_LOSSES[self.loss_type]
        return pair_loss(
            chosen - target[:, 0], rejected - target[:, 1], target[:, 2], target[:, 3], self.beta, self.label_smoothing
        ).sum()

    def __repr__(self) -> str:
        return f"DPOPairs({self.loss_type!r}, beta={self.beta})"


class DPOChosenNLL(Loss):
    """DPOTrainer's ``loss_type="sft"``: the chosen completions' negative log-likelihood, the mean over their
    tokens.  Output: per-token log-probabilities (``2P × T``, zero off the completions); target as
    :class:`DPOPairs`'s (the chosen token counts in column 2)."""

    item_weighted = True

    def sum(self, output: Tensor, target: Tensor) -> Tensor:
        return -output.chunk(2)[0].sum()

    def count(self, target: Tensor) -> Tensor:
        return target[:, 2].sum()


class KTOExamples(Loss):
    """KTOTrainer's ``loss_type="apo_zero_unpaired"``: a desirable example's ``1 - σ(β c)``, an undesirable one's
    ``σ(β c)`` (c: its log-ratio to the reference), each times its class weight, the mean over the examples.
    Output: each completion's summed log-probability; target ``(B, 2)``: the reference's, and 1 for desirable."""

    def __init__(self, *, beta: float, desirable_weight: float = 1.0, undesirable_weight: float = 1.0) -> None:
        self.beta, self.desirable_weight, self.undesirable_weight = beta, desirable_weight, undesirable_weight

    def sum(self, output: Tensor, target: Tensor) -> Tensor:
        ratio, desirable = output - target[:, 0], target[:, 1] > 0.5
        losses = torch.where(
            desirable,
            self.desirable_weight * (1 - torch.sigmoid(self.beta * ratio)),
            self.undesirable_weight * torch.sigmoid(self.beta * ratio),
        )
        return losses.sum()


class RewardPairs(Loss):
    """RewardTrainer's Bradley-Terry loss, ``-log σ(r_chosen - r_rejected)``, the mean over the pairs.  Output:
    the rewards, the chosen ones then the rejected ones (``2P``); target ``(P, 1)`` (the pairs, counted)."""

    def sum(self, output: Tensor, target: Tensor) -> Tensor:
        chosen, rejected = output.reshape(-1).chunk(2)
        return -F.logsigmoid(chosen - rejected).sum()


def generalized_jsd(student_log_probs: Tensor, teacher_log_probs: Tensor, beta: float) -> Tensor:
    """Each position's generalized JSD of arXiv 2306.13649 Eq. (1), as TRL computes it
    (``GKDTrainer.generalized_jsd_loss``, ``kernels/chunked_divergence.py``): ``beta`` 0 the forward
    KL(teacher || student), 1 the reverse KL(student || teacher), else ``β KL(p_t || m) + (1 - β) KL(p_s || m)``
    with ``m = (1 - β) p_s + β p_t``."""
    if beta == 0:
        return (teacher_log_probs.exp() * (teacher_log_probs - student_log_probs)).sum(-1)
    if beta == 1:
        return (student_log_probs.exp() * (student_log_probs - teacher_log_probs)).sum(-1)
    mixture = torch.logaddexp(student_log_probs + math.log(1 - beta), teacher_log_probs + math.log(beta))
    kl_teacher = (teacher_log_probs.exp() * (teacher_log_probs - mixture)).sum(-1)
    kl_student = (student_log_probs.exp() * (student_log_probs - mixture)).sum(-1)
    return beta * kl_teacher + (1 - beta) * kl_student


class GeneralizedJSD(Loss):
    """The distillation trainers' loss: each trained token's generalized JSD (:func:`generalized_jsd`) at the
    softmax temperature, the mean over the tokens.  Output: the student's logits at the positions predicting
    each token (``B × T × V``); target ``B × T × (V + 1)``: the teacher's log-probabilities at the same
    temperature, then 1 where the token is trained (0: prompt, padding)."""

    item_weighted = True

    def __init__(self, *, beta: float, temperature: float = 1.0) -> None:
        self.beta, self.temperature = beta, temperature

    def sum(self, output: Tensor, target: Tensor) -> Tensor:
        student = F.log_softmax(output / self.temperature, dim=-1)
        divergence = generalized_jsd(student, target[..., :-1], self.beta)
        return (divergence * target[..., -1]).sum()

    def count(self, target: Tensor) -> Tensor:
        return target[..., -1].sum()

    def __repr__(self) -> str:
        return f"GeneralizedJSD(beta={self.beta}, temperature={self.temperature})"

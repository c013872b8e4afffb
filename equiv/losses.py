"""Loss functions in the form the candidate contract hands them to a step.

A candidate's ``loss_fn(output, target)`` returns the MEAN loss over the
micro-batch's items.  Every loss here also offers what a correct accumulation
needs: ``loss_fn.sum(output, target)`` (the SUM over items) and
``loss_fn.count(target)`` (how many items that sum is over).  For sample losses
an item is a sample; for :class:`TokenCrossEntropy` it is a token that is not
padding, so the correct window loss is ``Σ sums / Σ counts`` and a step that
weights micro-batches by samples (or averages their means) is found out.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "LOSSES",
    "MSE",
    "CrossEntropy",
    "Loss",
    "MSEWithAux",
    "NextTokenCrossEntropy",
    "TokenCrossEntropy",
    "TokenMSEWithAux",
    "build_loss",
    "item_count",
    "loss_sum_and_count",
]


class Loss:
    """Base: a mean-reducing loss that also exposes its sum and its item count."""

    name: ClassVar[str]
    #: True when items are not samples (the count depends on the targets' content).
    item_weighted: ClassVar[bool] = False

    def __call__(self, output: Tensor, target: Tensor) -> Tensor:
        return self.sum(output, target) / self.count(target)

    def sum(self, output: Tensor, target: Tensor) -> Tensor:
        raise NotImplementedError

    def count(self, target: Tensor) -> int | Tensor:
        """Items in ``target``: an int for sample losses, a 0-d tensor (on the
        targets' device, no host read) for item-weighted ones."""
        return int(target.shape[0])

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class MSE(Loss):
    """Mean squared error exactly as ``nn.MSELoss()`` computes it: the mean over
    every element.  An item is an element; every sample has the same number of
    elements, so this is still a sample mean."""

    name = "mse"

    def __call__(self, output: Tensor, target: Tensor) -> Tensor:
        return F.mse_loss(output, target)

    def sum(self, output: Tensor, target: Tensor) -> Tensor:
        return F.mse_loss(output, target, reduction="sum")

    def count(self, target: Tensor) -> int:
        return target.numel()


class CrossEntropy(Loss):
    """Cross-entropy over classes, one target class per sample."""

    name = "cross_entropy"

    def __call__(self, output: Tensor, target: Tensor) -> Tensor:
        return F.cross_entropy(output, target, reduction="mean")

    def sum(self, output: Tensor, target: Tensor) -> Tensor:
        return F.cross_entropy(output, target, reduction="sum")


class TokenCrossEntropy(Loss):
    """Token-level cross-entropy with padding: the mean is over the tokens whose
    target is not ``ignore_index``.  ``output`` is (batch, seq, vocab),
    ``target`` (batch, seq)."""

    name = "token_cross_entropy"
    item_weighted = True

    def __init__(self, ignore_index: int = -100) -> None:
        self.ignore_index = ignore_index

    def __call__(self, output: Tensor, target: Tensor) -> Tensor:
        # Mean over this micro-batch's real tokens (what HF models return).
        return F.cross_entropy(output.flatten(0, 1), target.flatten(), ignore_index=self.ignore_index)

    def sum(self, output: Tensor, target: Tensor) -> Tensor:
        return F.cross_entropy(
            output.flatten(0, 1), target.flatten(), ignore_index=self.ignore_index, reduction="sum"
        )

    def count(self, target: Tensor) -> Tensor:
        return (target != self.ignore_index).sum()

    def __repr__(self) -> str:
        return f"TokenCrossEntropy(ignore_index={self.ignore_index})"


class NextTokenCrossEntropy(TokenCrossEntropy):
    """A causal LM's next-token loss as transformers computes it from ``labels``:
    the logits at position t predict the label at t + 1 (shifted here), labels
    ``ignore_index`` (-100) are padding; items are the real next-token targets."""

    def __call__(self, output: Tensor, target: Tensor) -> Tensor:
        return super().__call__(output[:, :-1], target[:, 1:])

    def sum(self, output: Tensor, target: Tensor) -> Tensor:
        return super().sum(output[:, :-1], target[:, 1:])

    def count(self, target: Tensor) -> Tensor:
        return super().count(target[:, 1:])

    def __repr__(self) -> str:
        return f"NextTokenCrossEntropy(ignore_index={self.ignore_index})"


class MSEWithAux(Loss):
    """A task loss plus an auxiliary loss the model computed, as MoE training
    adds its load-balancing loss: ``output`` is (batch, features + 1), the last
    column each sample's weighted aux loss, ``target`` (batch, features).  An
    item is a sample: the mean is the task MSE plus the mean aux loss, and
    :meth:`task_sum` / :meth:`aux_mean` give the two parts apart (a step that
    weights them differently is what NeMo Automodel PR #3359 fixed)."""

    name = "mse_aux"

    def task_sum(self, output: Tensor, target: Tensor) -> Tensor:
        """The task loss summed over samples (each sample's MSE over its features)."""
        features = output.shape[-1] - 1
        if target.shape[-1] != features:
            raise ValueError(f"loss 'mse_aux' needs targets with one column fewer than the output "
                             f"(the aux loss); got output {tuple(output.shape)}, target {tuple(target.shape)}")
        return F.mse_loss(output[..., :-1], target, reduction="sum") / features

    def aux_mean(self, output: Tensor) -> Tensor:
        """The micro-batch's aux loss as the model reports it: a mean over its samples."""
        return output[..., -1].mean()

    def sum(self, output: Tensor, target: Tensor) -> Tensor:
        return self.task_sum(output, target) + output[..., -1].sum()


class TokenMSEWithAux(Loss):
    """A per-token task loss plus each token's share of its sequence's router
    losses (model ``"token_moe"``): ``output`` is (batch, seq, features + 2), the
    last two columns each token's weighted load-balancing and z-loss shares,
    ``target`` (batch, seq, features).  An item is a token (every one real), so
    the mean is the token mean of the task MSE plus each sequence's router losses
    averaged over the window's sequences; :meth:`task_sum`, :meth:`aux_sum` and
    :meth:`z_sum` give the parts apart, for a step that attaches the router
    losses on their own as Megatron does."""

    name = "token_mse_aux"

    def task_sum(self, output: Tensor, target: Tensor) -> Tensor:
        """The task loss summed over tokens (each token's MSE over its features)."""
        features = output.shape[-1] - 2
        if target.shape[-1] != features or target.shape[:-1] != output.shape[:-1]:
            raise ValueError(f"loss 'token_mse_aux' needs targets shaped like the output less its two router "
                             f"columns; got output {tuple(output.shape)}, target {tuple(target.shape)}")
        return F.mse_loss(output[..., :-2], target, reduction="sum") / features

    def aux_sum(self, output: Tensor) -> Tensor:
        """The weighted load-balancing loss summed over tokens (a sequence's sum is its loss x its length)."""
        return output[..., -2].sum()

    def z_sum(self, output: Tensor) -> Tensor:
        """The weighted router z-loss summed over tokens."""
        return output[..., -1].sum()

    def sum(self, output: Tensor, target: Tensor) -> Tensor:
        return self.task_sum(output, target) + self.aux_sum(output) + self.z_sum(output)

    def count(self, target: Tensor) -> int:
        return int(target.shape[0] * target.shape[1])

    def draw_targets(self, inputs: Tensor, output_shape: tuple[int, ...], generator: torch.Generator) -> Tensor:
        """Random targets for every position, two columns fewer than the output (the router losses)."""
        if len(output_shape) != 2 or output_shape[1] < 3:
            raise ValueError(f"it needs a (seq, features + 2) output, the model gives {output_shape}")
        return torch.randn(inputs.shape[0], output_shape[0], output_shape[1] - 2, generator=generator)


LOSSES: dict[str, type[Loss]] = {cls.name: cls for cls in (MSE, CrossEntropy, TokenCrossEntropy, MSEWithAux,
                                                           TokenMSEWithAux)}


def build_loss(name: str) -> Loss:
    """The loss registered under ``name`` (one of :data:`LOSSES`)."""
    try:
        return LOSSES[name]()
    except KeyError:
        raise ValueError(f"unknown loss {name!r}; expected one of {sorted(LOSSES)}") from None


def loss_sum_and_count(loss_fn: Callable[..., Tensor], output: Tensor, target: Tensor) -> tuple[Tensor, int | Tensor]:
    """The micro-batch's SUMMED loss and how many items it sums over.

    Uses ``loss_fn.sum`` / ``loss_fn.count`` when the loss offers them (every
    :mod:`equiv.losses` loss does); a plain mean loss is taken as a mean over
    samples: ``mean * samples``.
    """
    if hasattr(loss_fn, "sum") and hasattr(loss_fn, "count"):
        return loss_fn.sum(output, target), loss_fn.count(target)
    samples = int(target.shape[0])
    return loss_fn(output, target) * samples, samples


def item_count(loss_fn: Callable[..., Tensor], target: Tensor) -> int | Tensor:
    """How many items ``loss_fn`` averages over in ``target`` (samples for a plain mean loss)."""
    return loss_fn.count(target) if hasattr(loss_fn, "count") else int(target.shape[0])

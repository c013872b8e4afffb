"""Layers that make accumulation inherently differ from the full-batch step.

These are not bugs of an accumulator: no accumulation of per-micro-batch
passes can reproduce them, so a check reports them with the reason instead of
calling the result a pass or a failure.
"""

from __future__ import annotations

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from equiv.cases.moe import MoELayer

__all__ = ["inherent_non_equivalences"]

_DROPOUTS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


def inherent_non_equivalences(model: nn.Module) -> list[str]:
    """One reason per layer of ``model`` that no accumulation can make equivalent."""
    reasons = []
    for name, module in model.named_modules():
        label = name or type(module).__name__
        if isinstance(module, _BatchNorm) and module.training:
            reasons.append(
                f"BatchNorm layer '{label}' ({type(module).__name__}) normalises each micro-batch by its own "
                "statistics in train mode, so the loss itself differs from the full batch's (pytorch#46516)"
            )
        elif isinstance(module, _DROPOUTS) and module.p > 0 and module.training:
            reasons.append(
                f"Dropout layer '{label}' (p={module.p}) draws its masks per forward pass, so micro-batch "
                "passes drop other units than the full-batch pass"
            )
        elif isinstance(module, MoELayer) and module.balance == "batch" and module.training:
            reasons.append(
                f"MoE layer '{label}' takes its load-balancing loss over the batch: the fraction of routed "
                "tokens per expert times its mean router probability, a product of batch statistics that is "
                "not linear in the samples, so each micro-batch balances its own routing and no accumulation "
                "reproduces the full batch's loss (torchtitan PR #3000); a sequence-wise balance loss, a mean over "
                "samples, accumulates exactly"
            )
        elif isinstance(module, nn.MultiheadAttention) and module.dropout > 0 and module.training:
            reasons.append(
                f"MultiheadAttention '{label}' (dropout={module.dropout}) drops attention weights per forward pass"
            )
    return reasons

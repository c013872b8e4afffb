"""Layers that make accumulation inherently differ from the full-batch step.

These are not bugs of an accumulator: no accumulation of per-micro-batch
passes can reproduce them, so a check reports them with the reason instead of
calling the result a pass or a failure.  Layers are named by their modules
(:func:`inherent_non_equivalences`); randomness a forward draws without one
(``torch.nn.functional.dropout`` inside a transformers attention, a router's
jitter noise, a stochastic depth) is found by running the forward under two
seeds (:func:`seed_dependence`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from equiv.cases.moe import MoELayer

__all__ = [
    "SEED_DEPENDENT",
    "generator_states",
    "inherent_non_equivalences",
    "random_forward_reason",
    "seed_dependence",
]

#: How far (relative to its largest element) a float64 forward's output may move between two seeds and still be
#: one output: float64 rounding, a nondeterministic kernel's atomics, is ~1e-16 of it; a dropout mask or a
#: router's jitter moves it by its probability or noise scale (~1e-2).
SEED_DEPENDENT = 1e-8

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


def _generators(device: torch.device) -> list[torch.Generator]:
    """torch's default random generators a forward on ``device`` draws from: the CPU's, and the device's own."""
    generators = [torch.default_generator]
    if device.type == "cuda":
        generators.append(torch.cuda.default_generators[device.index if device.index is not None else 0])
    return generators


def generator_states(device: torch.device) -> tuple[Tensor, ...]:
    """The states of torch's generators a forward on ``device`` draws from (a draw advances one)."""
    return tuple(generator.get_state() for generator in _generators(device))


def seed_dependence(forward: Callable[[], Tensor], device: torch.device, *, always_twice: bool = False) -> float | None:
    """How far ``forward``'s output moves when only torch's random seed changes, relative to its
    largest element: ``forward`` (a training-mode forward of one micro-batch, in float64) run under
    seed 0 and seed 1; None where the first run draws no random number (a draw leaves torch's
    generator advanced), and the second is not run unless ``always_twice`` (ranks that must call
    together: an FSDP2 replica's forward all-gathers).  torch's generators on the CPU and on
    ``device`` are as they were after: the run being audited goes on with its own random numbers.
    A draw that does not reach the output (a layer-drop probability of 0 still drawn) gives 0."""
    generators = _generators(device)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
        outputs, drew = [], False
        for seed in (0, 1):
            for generator in generators:
                generator.manual_seed(seed)
            before = generator_states(device)
            outputs.append(forward().detach())
            drew = drew or any(not torch.equal(a, b) for a, b in zip(before, generator_states(device), strict=True))
            if not drew and not always_twice:
                return None
    if not drew:
        return None
    first, second = outputs
    scale = float(first.abs().max()) if first.numel() else 0.0
    moved = float((first - second).abs().max()) if first.numel() else 0.0
    return moved / scale if scale > 0 else moved


def random_forward_reason(moved: float) -> str:
    """Why a window whose forward moves by ``moved`` (:func:`seed_dependence`; NaN: measured on another
    rank) with the seed cannot be judged."""
    measured = "" if math.isnan(moved) else f" by {moved:.2g} of its largest element"
    return (
        "the model's training-mode forward draws random numbers that reach its output (the same micro-batch under "
        f"another seed moves it{measured}): functional dropout (a transformers config's "
        "attention_dropout), a router's jitter noise or a stochastic depth, which no module names; each micro-batch "
        "pass draws other numbers than the full-batch pass, so no accumulation reproduces it"
    )

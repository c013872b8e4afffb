"""Small models a :class:`~equiv.cases.Case` names, built deterministically.

Each builder takes keyword arguments only and returns a :class:`ModelBundle`:
the module, how to draw a batch of its inputs, and the per-sample output shape
(which fixes the targets each loss needs).  Register new families with
:func:`register_model`; a case names a family and its keyword arguments, so
``Case.to_dict()`` is enough to rebuild the exact same model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["MODELS", "ModelBundle", "build_model", "register_model"]

#: Draws a batch of ``batch_size`` inputs from a seeded CPU generator.
InputMaker = Callable[[int, torch.Generator], Tensor]


@dataclass(frozen=True, slots=True)
class ModelBundle:
    module: nn.Module
    make_inputs: InputMaker
    #: Shape of one sample's output: (features,) or (classes,) or (seq, vocab).
    output_shape: tuple[int, ...]


MODELS: dict[str, Callable[..., ModelBundle]] = {}


def register_model(name: str) -> Callable[[Callable[..., ModelBundle]], Callable[..., ModelBundle]]:
    """Decorator: make a builder available to cases under ``name``."""

    def register(builder: Callable[..., ModelBundle]) -> Callable[..., ModelBundle]:
        if name in MODELS:
            raise ValueError(f"a model family named {name!r} is already registered")
        MODELS[name] = builder
        return builder

    return register


def build_model(name: str, seed: int, **kwargs: Any) -> ModelBundle:
    """Build family ``name`` in float32 on the CPU, weights drawn from ``seed``.

    The global RNG is left as it was, so building a model never perturbs the
    caller's randomness.
    """
    try:
        builder = MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; expected one of {sorted(MODELS)}") from None
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            return builder(**kwargs)
        except TypeError as exc:
            raise ValueError(f"bad arguments {kwargs!r} for model {name!r}: {exc}") from None


_ACTIVATIONS: dict[str, Callable[[], nn.Module]] = {
    "tanh": nn.Tanh,
    "relu": nn.ReLU,
    "gelu": nn.GELU,
    "sigmoid": nn.Sigmoid,
    "silu": nn.SiLU,
}


def _activation(name: str) -> nn.Module:
    try:
        return _ACTIVATIONS[name]()
    except KeyError:
        raise ValueError(f"unknown activation {name!r}; expected one of {sorted(_ACTIVATIONS)}") from None


def _normal_inputs(*shape: int) -> InputMaker:
    def make(batch_size: int, generator: torch.Generator) -> Tensor:
        return torch.randn(batch_size, *shape, generator=generator)

    return make


@register_model("mlp")
def mlp(
    *,
    in_features: int = 4,
    hidden: tuple[int, ...] = (8,),
    out_features: int = 3,
    activation: str = "tanh",
    bias: bool = True,
    norm: str = "none",
    dropout: float = 0.0,
) -> ModelBundle:
    """Linear layers with ``activation`` between them; ``norm`` is "none",
    "layer" or "batch" (BatchNorm1d, inherently non-equivalent), ``dropout`` a
    probability (inherently non-equivalent when > 0)."""
    norms: dict[str, Callable[[int], nn.Module]] = {
        "none": lambda width: nn.Identity(),
        "layer": nn.LayerNorm,
        "batch": nn.BatchNorm1d,
    }
    if norm not in norms:
        raise ValueError(f"unknown norm {norm!r}; expected one of {sorted(norms)}")
    layers: list[nn.Module] = []
    width = in_features
    for hidden_width in hidden:
        layers += [nn.Linear(width, hidden_width, bias=bias), norms[norm](hidden_width), _activation(activation)]
        if dropout > 0:
            layers.append(nn.Dropout(dropout))
        width = hidden_width
    layers.append(nn.Linear(width, out_features, bias=bias))
    module = nn.Sequential(*[layer for layer in layers if not isinstance(layer, nn.Identity)])
    return ModelBundle(module, _normal_inputs(in_features), (out_features,))


@register_model("scalar_linear")
def scalar_linear(*, init: float = 0.0) -> ModelBundle:
    """``y = w * x`` with one weight ``w = init``: the toy case of the
    Accelerate guide (x = 1..8, y = 2x, w = 0, SGD lr 0.02 gives w = 2.04)."""
    module = nn.Linear(1, 1, bias=False)
    nn.init.constant_(module.weight, init)
    return ModelBundle(module, _normal_inputs(1), (1,))


class _TokenMLP(nn.Module):
    """Embedding -> per-token MLP -> vocabulary logits: the smallest model with
    a token-level loss (no attention; issue-5's causal LM has one)."""

    def __init__(self, vocab_size: int, width: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, width)
        self.mix = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab_size)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.head(torch.tanh(self.mix(self.embed(tokens))))


@register_model("token_mlp")
def token_mlp(*, vocab_size: int = 11, width: int = 8, seq_len: int = 6) -> ModelBundle:
    def make(batch_size: int, generator: torch.Generator) -> Tensor:
        return torch.randint(0, vocab_size, (batch_size, seq_len), generator=generator)

    return ModelBundle(_TokenMLP(vocab_size, width), make, (seq_len, vocab_size))

"""Small models a :class:`~equiv.cases.case.Case` names, built deterministically.

Each builder takes keyword arguments only and returns a :class:`ModelBundle`:
the module, how to draw a batch of its inputs, and the per-sample output shape
(which fixes the targets each loss needs).  Register new families with
:func:`register_model`; a case names a family and its keyword arguments, so
``Case.to_dict()`` is enough to rebuild the exact same model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import Tensor, nn

from equiv.names import resolve

__all__ = ["MODELS", "CausalLM", "ModelBundle", "ModelFactory", "build_model", "register_model"]

#: Draws a batch of ``batch_size`` inputs from a seeded CPU generator.
InputMaker = Callable[[int, torch.Generator], Tensor]


@dataclass(frozen=True, slots=True)
class ModelBundle:
    module: nn.Module
    #: None for a user's model given as a bare module (its case brings its own data).
    make_inputs: InputMaker | None
    #: Shape of one sample's output: (features,) or (classes,) or (seq, vocab); None when unknown.
    output_shape: tuple[int, ...] | None


MODELS: dict[str, Callable[..., ModelBundle]] = {}


def register_model(name: str) -> Callable[[Callable[..., ModelBundle]], Callable[..., ModelBundle]]:
    """Decorator: make a builder available to cases under ``name``."""

    def register(builder: Callable[..., ModelBundle]) -> Callable[..., ModelBundle]:
        if name in MODELS:
            raise ValueError(f"a model family named {name!r} is already registered")
        MODELS[name] = builder
        return builder

    return register


ModelFactory = Callable[..., "ModelBundle | nn.Module"]


def build_model(model: str | ModelFactory, seed: int, **kwargs: Any) -> ModelBundle:
    """Build a model in float32 on the CPU, weights drawn from ``seed``.

    ``model``: a family registered with :func:`register_model`, or a user's
    factory (a callable or its ``"module:attribute"`` import path) returning a
    :class:`ModelBundle` or a bare ``nn.Module`` (whose case then brings its
    own data).  The global RNG is left as it was, so building a model never
    perturbs the caller's randomness.
    """
    if callable(model):
        builder, label = model, getattr(model, "__qualname__", repr(model))
    elif ":" in model:
        builder, label = resolve(model), model
    else:
        try:
            builder, label = MODELS[model], model
        except KeyError:
            raise ValueError(f"unknown model {model!r}; expected one of {sorted(MODELS)} or an import path") from None
    with torch.random.fork_rng(devices=[]):
        # The CPU generator only (what initialisation draws from):
        # torch.manual_seed also queues lazy CUDA/XPU/MTIA seeding, which
        # formats the whole Python stack each call (slow under Hypothesis).
        torch.default_generator.manual_seed(seed)
        try:
            built = builder(**kwargs)
        except TypeError as exc:
            raise ValueError(f"bad arguments {kwargs!r} for model {label!r}: {exc}") from None
    if isinstance(built, ModelBundle):
        return built
    if isinstance(built, nn.Module):
        return ModelBundle(built, None, None)
    raise ValueError(f"model {label!r} returned {type(built).__name__}; expected an nn.Module or a ModelBundle")


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
    a token-level loss (no attention; :class:`CausalLM` has one)."""

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


# ---------------------------------------------------------------------------
# Families the strategies draw from (equiv.strategies.models).  All tiny: a
# check runs six short trainings, so each forward pass must cost microseconds.

_CONV_NORMS = ("none", "group", "batch")


def _conv_norm(norm: str, channels: int, groups: int, batch_norm: Callable[[int], nn.Module]) -> nn.Module:
    if norm == "none":
        return nn.Identity()
    if norm == "group":
        if channels % groups:
            raise ValueError(f"GroupNorm needs channels ({channels}) divisible by groups ({groups})")
        return nn.GroupNorm(groups, channels)
    if norm == "batch":
        return batch_norm(channels)
    raise ValueError(f"unknown norm {norm!r}; expected one of {list(_CONV_NORMS)}")


@dataclass(frozen=True, slots=True)
class _ConvKind:
    """The layer classes of one spatial rank: a conv stack over sequences (1-d) or images (2-d)."""

    conv: Callable[..., nn.Module]
    batch_norm: Callable[[int], nn.Module]
    dropout: Callable[[float], nn.Module]


_CONV1D = _ConvKind(nn.Conv1d, nn.BatchNorm1d, nn.Dropout1d)
_CONV2D = _ConvKind(nn.Conv2d, nn.BatchNorm2d, nn.Dropout2d)


@dataclass(frozen=True, kw_only=True, slots=True)
class _ConvLayers:
    """The keywords ``conv1d`` and ``conv2d`` share (a case's ``model_kwargs``
    beyond the input and head shapes): the conv layers between input and head."""

    channels: tuple[int, ...] = (4,)
    kernel_size: int = 3
    activation: str = "tanh"
    norm: str = "none"
    groups: int = 2
    dropout: float = 0.0

    @classmethod
    def of(cls, family: str, options: dict[str, Any]) -> _ConvLayers:
        """The layers ``family`` was asked for; an unknown keyword is refused as a
        builder with it in its signature would refuse it (build_model reports it)."""
        known = {field.name for field in fields(cls)}
        for name in options:
            if name not in known:
                raise TypeError(f"{family}() got an unexpected keyword argument {name!r}")
        return cls(**options)

    def __post_init__(self) -> None:
        # A list from JSON as a tuple: the same layers whatever container named them.
        object.__setattr__(self, "channels", tuple(self.channels))


def _conv_stack(
    layer_classes: _ConvKind, spec: _ConvLayers, *, in_channels: int, spatial_numel: int, out_features: int
) -> nn.Module:
    layers: list[nn.Module] = []
    width = in_channels
    for out_channels in spec.channels:
        # padding keeps the spatial size, so the head's input size is known.
        # A bias right before a norm is removed by it (its gradient is zero in
        # exact arithmetic, rounding noise in practice): no bias then.
        layers += [
            layer_classes.conv(
                width, out_channels, spec.kernel_size, padding=spec.kernel_size // 2, bias=spec.norm == "none"
            ),
            _conv_norm(spec.norm, out_channels, spec.groups, layer_classes.batch_norm),
            _activation(spec.activation),
        ]
        if spec.dropout > 0:
            layers.append(layer_classes.dropout(spec.dropout))
        width = out_channels
    layers += [nn.Flatten(), nn.Linear(width * spatial_numel, out_features)]
    return nn.Sequential(*[layer for layer in layers if not isinstance(layer, nn.Identity)])


@register_model("conv1d")
def conv1d(*, in_channels: int = 2, length: int = 5, out_features: int = 3, **layers: Any) -> ModelBundle:
    """Conv1d layers (odd ``kernel_size``, same padding) then a linear head on
    the flattened features.  ``layers``: the keywords of :class:`_ConvLayers`
    (``channels`` (4,), ``kernel_size`` 3, ``activation`` "tanh", ``norm``,
    ``groups`` 2, ``dropout`` 0.0); ``norm`` is "none", "group" (GroupNorm with
    ``groups``) or "batch" (BatchNorm1d, inherently non-equivalent)."""
    spec = _ConvLayers.of("conv1d", layers)
    module = _conv_stack(_CONV1D, spec, in_channels=in_channels, spatial_numel=length, out_features=out_features)
    return ModelBundle(module, _normal_inputs(in_channels, length), (out_features,))


@register_model("conv2d")
def conv2d(*, in_channels: int = 1, size: int = 4, out_features: int = 3, **layers: Any) -> ModelBundle:
    """Conv2d layers on ``size`` x ``size`` images (same padding) then a
    linear head; ``layers`` and ``norm`` as for ``conv1d`` (BatchNorm2d for "batch")."""
    spec = _ConvLayers.of("conv2d", layers)
    module = _conv_stack(_CONV2D, spec, in_channels=in_channels, spatial_numel=size * size, out_features=out_features)
    return ModelBundle(module, _normal_inputs(in_channels, size, size), (out_features,))


class _Recurrent(nn.Module):
    """A GRU or LSTM over the sequence; the last step's hidden state feeds a linear head."""

    def __init__(
        self, cell: type[nn.Module], in_features: int, hidden: int, layers: int, out_features: int, dropout: float
    ) -> None:
        super().__init__()
        self.rnn = cell(in_features, hidden, num_layers=layers, batch_first=True)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.head = nn.Linear(hidden, out_features)

    def forward(self, inputs: Tensor) -> Tensor:
        output, _ = self.rnn(inputs)
        return self.head(self.dropout(output[:, -1]))


def _recurrent(
    cell: type[nn.Module], in_features: int, seq_len: int, hidden: int, layers: int, out_features: int, dropout: float
) -> ModelBundle:
    module = _Recurrent(cell, in_features, hidden, layers, out_features, dropout)
    return ModelBundle(module, _normal_inputs(seq_len, in_features), (out_features,))


@register_model("gru")
def gru(
    *,
    in_features: int = 3,
    seq_len: int = 4,
    hidden: int = 6,
    layers: int = 1,
    out_features: int = 3,
    dropout: float = 0.0,
) -> ModelBundle:
    """A GRU over ``seq_len`` steps of ``in_features``; a linear head on the last hidden state."""
    return _recurrent(nn.GRU, in_features, seq_len, hidden, layers, out_features, dropout)


@register_model("lstm")
def lstm(
    *,
    in_features: int = 3,
    seq_len: int = 4,
    hidden: int = 6,
    layers: int = 1,
    out_features: int = 3,
    dropout: float = 0.0,
) -> ModelBundle:
    """An LSTM over ``seq_len`` steps of ``in_features``; a linear head on the last hidden state."""
    return _recurrent(nn.LSTM, in_features, seq_len, hidden, layers, out_features, dropout)


class _Attention(nn.Module):
    """Embedding + one pre-norm self-attention block (LayerNorm, MultiheadAttention,
    residual); "tokens" head: logits per position, "pooled" head: mean over
    positions -> ``out_features``."""

    def __init__(self, vocab_size: int, width: int, heads: int, head: str, out_features: int, dropout: float) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, width)
        self.norm = nn.LayerNorm(width)
        # No in-projection bias: the key bias shifts every score of a query by
        # the same amount, so softmax makes its gradient exactly zero in exact
        # arithmetic, and rounding noise there is all an adaptive optimizer
        # sees (it would amplify it into a spurious float64 mismatch).
        self.attention = nn.MultiheadAttention(width, heads, dropout=dropout, bias=False, batch_first=True)
        self.pooled = head == "pooled"
        self.head = nn.Linear(width, out_features if self.pooled else vocab_size)

    def forward(self, tokens: Tensor) -> Tensor:
        hidden = self.embed(tokens)
        normed = self.norm(hidden)
        attended, _ = self.attention(normed, normed, normed, need_weights=False)
        hidden = hidden + attended
        return self.head(hidden.mean(dim=1) if self.pooled else hidden)


@register_model("attention")
def attention(
    *,
    vocab_size: int = 7,
    seq_len: int = 4,
    width: int = 8,
    heads: int = 2,
    head: str = "pooled",
    out_features: int = 3,
    dropout: float = 0.0,
) -> ModelBundle:
    """Token embedding then one self-attention block (LayerNorm +
    ``nn.MultiheadAttention``).  ``head`` "pooled": a (``out_features``,)
    output per sample (for MSE / cross-entropy); "tokens": (seq_len,
    vocab_size) logits (for the token-level loss).  ``dropout`` drops
    attention weights (inherently non-equivalent when > 0)."""
    if head not in ("pooled", "tokens"):
        raise ValueError(f"unknown head {head!r}; expected 'pooled' or 'tokens'")

    def make(batch_size: int, generator: torch.Generator) -> Tensor:
        return torch.randint(0, vocab_size, (batch_size, seq_len), generator=generator)

    module = _Attention(vocab_size, width, heads, head, out_features, dropout)
    output_shape = (out_features,) if head == "pooled" else (seq_len, vocab_size)
    return ModelBundle(module, make, output_shape)


# ----------------------------------------------------------- causal LM
# A tiny causal language model (no downloads): embedding + learned positions,
# one pre-norm causal self-attention block with an MLP, and an LM head.  The
# smallest model where the 2024 transformers bug class shows (a mean of
# per-micro-batch token means instead of one mean over the window's real
# tokens); use it with loss="token_cross_entropy", whose targets are
# variable-length sequences padded with ignore_index.


class CausalLM(nn.Module):
    """A one-block causal LM for token-level losses (model family ``"causal_lm"``)."""

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
        self.register_buffer(
            "causal_mask", torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool), 1), persistent=False
        )

    def forward(self, tokens: Tensor) -> Tensor:
        length = tokens.shape[1]
        hidden = self.embed(tokens) + self.position[:length]
        normed = self.norm1(hidden)
        causal_mask: Tensor = self.causal_mask  # type: ignore[assignment]  # a registered buffer
        attended, _ = self.attention(
            normed, normed, normed, attn_mask=causal_mask[:length, :length], need_weights=False
        )
        hidden = hidden + attended
        hidden = hidden + self.mlp(self.norm2(hidden))
        logits: Tensor = self.head(hidden)
        return logits


@register_model("causal_lm")
def causal_lm(*, vocab_size: int = 13, width: int = 8, heads: int = 2, seq_len: int = 6) -> ModelBundle:
    def make(batch_size: int, generator: torch.Generator) -> Tensor:
        return torch.randint(0, vocab_size, (batch_size, seq_len), generator=generator)

    return ModelBundle(CausalLM(vocab_size, width, heads, seq_len), make, (seq_len, vocab_size))

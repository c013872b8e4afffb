"""The keyword arguments each model family is drawn with (:func:`equiv.strategies.models`).

One strategy per family of :data:`equiv.cases.models.MODELS` that the searches draw, each shrinking toward its
smallest shape; ``tiny`` cuts the drawn shapes down afterwards, so a tiny model takes the same choices as a full one.
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument

__all__ = ["family_kwargs"]


def _activations() -> st.SearchStrategy[str]:
    return st.sampled_from(["tanh", "relu", "gelu", "sigmoid", "silu"])


def _dropout(allow_dropout: bool) -> st.SearchStrategy[float]:
    return st.sampled_from([0.0, 0.25, 0.5]) if allow_dropout else st.just(0.0)


def family_kwargs(
    family: str, *, tokens: bool, allow_batchnorm: bool, allow_dropout: bool, tiny: bool = False
) -> st.SearchStrategy[dict[str, Any]]:
    """``tiny``: the smallest shapes only (one hidden layer, short sequences),
    for cases with many micro-batches, where every forward pass is paid N times."""
    strategy = _full_family_kwargs(family, tokens=tokens, allow_batchnorm=allow_batchnorm, allow_dropout=allow_dropout)
    # The same draws, cut down afterwards: a tiny model takes exactly the
    # choices a full one does, so when a search shrinks a case below
    # FEW_MICRO_BATCHES + 1 micro-batches its model draws still line up (a
    # longer choice sequence would count as a bigger case, and the shrink be refused).
    return strategy.map(_tiny) if tiny else strategy


def _tiny(kwargs: dict[str, Any]) -> dict[str, Any]:
    out = dict(kwargs)
    if "hidden" in out and isinstance(out["hidden"], tuple):  # mlp: one hidden layer of at most 8
        out["hidden"] = (min(out["hidden"][0], 8),)
    if "channels" in out:  # conv: one layer
        out["channels"] = out["channels"][:1]
    if "layers" in out:  # gru / lstm: one layer over at most 2 steps
        out["layers"], out["seq_len"] = 1, min(out["seq_len"], 2)
    elif "pairs" in out:  # packed_lm: rows of 4 (two sequences, or one chosen/rejected pair)
        out["seq_len"] = min(out["seq_len"], 4)
    elif "seq_len" in out:  # attention / token_mlp / policy: at most 3 positions
        out["seq_len"] = min(out["seq_len"], 3)
    return out


def _full_family_kwargs(
    family: str, *, tokens: bool, allow_batchnorm: bool, allow_dropout: bool
) -> st.SearchStrategy[dict[str, Any]]:
    batch = ["batch"] if allow_batchnorm else []
    if family == "mlp":
        return st.fixed_dictionaries(
            {
                "hidden": st.lists(st.sampled_from([4, 8, 16]), min_size=1, max_size=2).map(tuple),
                "activation": _activations(),
                "norm": st.sampled_from(["none", "layer", *batch]),
                "dropout": _dropout(allow_dropout),
            }
        )
    if family in ("conv1d", "conv2d"):
        return st.fixed_dictionaries(
            {
                "channels": st.lists(st.sampled_from([2, 4]), min_size=1, max_size=2).map(tuple),
                "kernel_size": st.sampled_from([3, 1]),
                "activation": _activations(),
                "norm": st.sampled_from(["none", "group", *batch]),
                "dropout": _dropout(allow_dropout),
            }
        )
    if family in ("gru", "lstm"):
        return st.fixed_dictionaries(
            {
                "seq_len": st.integers(1, 4),
                "hidden": st.sampled_from([4, 6]),
                "layers": st.integers(1, 2),
                "dropout": _dropout(allow_dropout),
            }
        )
    if family == "attention":
        return st.fixed_dictionaries(
            {
                # At least 2 positions: with one, softmax is constant and the query
                # and key projections get an exactly-zero gradient (only rounding
                # noise, which adaptive optimizers amplify into a false mismatch).
                "seq_len": st.integers(2, 4),
                "heads": st.sampled_from([1, 2]),
                "head": st.just("tokens" if tokens else "pooled"),
                "dropout": _dropout(allow_dropout),
            }
        )
    if family == "token_mlp":
        return st.fixed_dictionaries({"width": st.sampled_from([4, 8]), "seq_len": st.integers(1, 6)})
    if family == "packed_lm":  # at least 4 positions: room for a chosen/rejected pair (pairs set by the loss)
        return st.fixed_dictionaries(
            {"width": st.sampled_from([4, 8]), "seq_len": st.integers(4, 8), "pairs": st.just(False)}
        )
    if family == "policy":
        return st.fixed_dictionaries({"width": st.sampled_from([4, 8]), "seq_len": st.integers(1, 6)})
    raise InvalidArgument(f"no strategy for model family {family!r}")  # pragma: no cover

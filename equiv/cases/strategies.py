"""Hypothesis strategies that draw accumulation cases: ``equiv.strategies``.

Every strategy is a plural noun, takes keyword-only bounds validated when it is
called (not when it is drawn from), and shrinks toward the simplest case that
still shows a difference: few and small micro-batches, the smallest models,
plain hyperparameters, two steps, seed 0.

    from hypothesis import given
    from equiv.cases import strategies as eqst

    @given(eqst.cases())
    def test_my_step_matches_full_batch(case):
        equiv.check(my_step, case).assert_ok()

Models and optimizers are drawn as ``(name, kwargs)`` pairs, the two fields a
:class:`~equiv.cases.case.Case` stores for each.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from hypothesis import assume
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument

from equiv.cases.case import DTYPES, Case
from equiv.losses import LOSSES

__all__ = [
    "CLIPPING",
    "ITEM_WEIGHTED_LOSSES",
    "MODEL_FAMILIES",
    "OPTIMIZERS",
    "SAMPLE_LOSSES",
    "SCHEDULERS",
    "TOKEN_FAMILIES",
    "cases",
    "losses",
    "micro_batch_splits",
    "models",
    "optimizers",
]

Spec = tuple[str, dict[str, Any]]

#: Losses whose mean is over samples (searched by default).
SAMPLE_LOSSES: tuple[str, ...] = ("mse", "cross_entropy")
#: Losses whose mean is over items that are not samples (searched when asked).
ITEM_WEIGHTED_LOSSES: tuple[str, ...] = ("token_cross_entropy",)
#: Model families with one (features,) output per sample, simplest first.
MODEL_FAMILIES: tuple[str, ...] = ("mlp", "conv1d", "conv2d", "gru", "lstm", "attention")
#: Model families with (seq, vocab) outputs, for the token-level loss.
TOKEN_FAMILIES: tuple[str, ...] = ("token_mlp", "attention")
#: Every deterministic first-order ``torch.optim`` optimizer, simplest first.
OPTIMIZERS: tuple[str, ...] = (
    "SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Adagrad", "Adadelta",
)
#: Clipping regimes: no clipping, a norm the gradient never reaches, one it always exceeds.
CLIPPING: tuple[str, ...] = ("none", "inactive", "active")
#: LR schedulers a case may step once per optimizer step (None: no scheduler).
SCHEDULERS: dict[str | None, dict[str, Any]] = {
    None: {},
    "StepLR": {"step_size": 1, "gamma": 0.5},
    "ExponentialLR": {"gamma": 0.7},
    "LinearLR": {"start_factor": 0.25, "total_iters": 3},
}


# ------------------------------------------------------------------ checks
def _check_int(name: str, value: Any, *, at_least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(f"{name} must be an int but was {value!r} ({type(value).__name__})")
    if value < at_least:
        raise InvalidArgument(f"{name} must be at least {at_least} but was {value}")


def _check_names(name: str, values: Any, known: Sequence[Any]) -> tuple[Any, ...]:
    if isinstance(values, str) or not isinstance(values, Sequence):
        raise InvalidArgument(f"{name} must be a sequence of names but was {values!r}")
    if not values:
        raise InvalidArgument(f"{name} must name at least one of {list(known)} but was empty")
    unknown = [v for v in values if v not in known]
    if unknown:
        raise InvalidArgument(f"{name} has unknown {unknown!r}; expected some of {list(known)}")
    return tuple(values)


def _check_flag(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise InvalidArgument(f"{name} must be a bool but was {value!r}")


# -------------------------------------------------------- micro-batch splits
@st.composite
def _cut(draw: st.DrawFn, required: bool, largest: int) -> int | None:
    """One more micro-batch of 1..``largest`` samples, or None to stop (unless
    ``required``).  One span of choices per piece, so the shrinker can delete
    a whole piece at once, as it does for list elements."""
    if not required and draw(st.integers(0, 2)) == 0:  # continue 2 times in 3
        return None
    return draw(st.integers(1, largest))


@st.composite
def _splits(draw: st.DrawFn, batch_size: int, min_pieces: int, max_pieces: int) -> tuple[int, ...]:
    # Each size shrinks toward 1 with the rest in the last piece (no
    # rejection, and a smaller batch reuses the same draws).
    sizes: list[int] = []
    left = batch_size
    while len(sizes) + 1 < max_pieces and left > 1:
        # Leave a sample for the last piece and for every piece min_pieces still needs.
        still_needed = max(min_pieces - len(sizes) - 2, 0)
        size = draw(_cut(len(sizes) + 1 < min_pieces, left - 1 - still_needed))
        if size is None:
            break
        sizes.append(size)
        left -= size
    return (*sizes, left)


def micro_batch_splits(
    batch_size: int, *, min_pieces: int = 1, max_pieces: int | None = None
) -> st.SearchStrategy[tuple[int, ...]]:
    """Return a strategy for ordered compositions of ``batch_size``: tuples of
    positive micro-batch sizes, in order, that add up to ``batch_size``.

    The number of pieces lies in [``min_pieces`` (default 1), ``max_pieces``
    (default ``batch_size``: one sample each)].  Each size is drawn
    anywhere it fits, so splits are deliberately uneven; it shrinks toward
    few pieces, and toward small pieces first with the rest in the last one
    (e.g. ``(1, 2)`` for a batch of 3 in two pieces).
    """
    _check_int("batch_size", batch_size, at_least=1)
    _check_int("min_pieces", min_pieces, at_least=1)
    if max_pieces is None:
        max_pieces = batch_size
    _check_int("max_pieces", max_pieces, at_least=1)
    if min_pieces > batch_size:
        raise InvalidArgument(
            f"min_pieces={min_pieces} is more than batch_size={batch_size}: every micro-batch needs a sample"
        )
    if max_pieces > batch_size:
        raise InvalidArgument(
            f"max_pieces={max_pieces} is more than batch_size={batch_size}: every micro-batch needs a sample"
        )
    if min_pieces > max_pieces:
        raise InvalidArgument(f"min_pieces={min_pieces} must be at most max_pieces={max_pieces}")

    return _splits(batch_size, min_pieces, max_pieces)


# ------------------------------------------------------------------ models
def _activations() -> st.SearchStrategy[str]:
    return st.sampled_from(["tanh", "relu", "gelu", "sigmoid", "silu"])


def _dropout(allow_dropout: bool) -> st.SearchStrategy[float]:
    return st.sampled_from([0.0, 0.25, 0.5]) if allow_dropout else st.just(0.0)


def _family_kwargs(family: str, *, tokens: bool, allow_batchnorm: bool, allow_dropout: bool) -> st.SearchStrategy[dict[str, Any]]:
    batch = ["batch"] if allow_batchnorm else []
    if family == "mlp":
        return st.fixed_dictionaries({
            "hidden": st.lists(st.sampled_from([4, 8, 16]), min_size=1, max_size=2).map(tuple),
            "activation": _activations(),
            "norm": st.sampled_from(["none", "layer", *batch]),
            "dropout": _dropout(allow_dropout),
        })
    if family in ("conv1d", "conv2d"):
        return st.fixed_dictionaries({
            "channels": st.lists(st.sampled_from([2, 4]), min_size=1, max_size=2).map(tuple),
            "kernel_size": st.sampled_from([3, 1]),
            "activation": _activations(),
            "norm": st.sampled_from(["none", "group", *batch]),
            "dropout": _dropout(allow_dropout),
        })
    if family in ("gru", "lstm"):
        return st.fixed_dictionaries({
            "seq_len": st.integers(1, 4),
            "hidden": st.sampled_from([4, 6]),
            "layers": st.integers(1, 2),
            "dropout": _dropout(allow_dropout),
        })
    if family == "attention":
        return st.fixed_dictionaries({
            # At least 2 positions: with one, softmax is constant and the query
            # and key projections get an exactly-zero gradient (only rounding
            # noise, which adaptive optimizers amplify into a false mismatch).
            "seq_len": st.integers(2, 4),
            "heads": st.sampled_from([1, 2]),
            "head": st.just("tokens" if tokens else "pooled"),
            "dropout": _dropout(allow_dropout),
        })
    if family == "token_mlp":
        return st.fixed_dictionaries({"width": st.sampled_from([4, 8]), "seq_len": st.integers(1, 6)})
    raise InvalidArgument(f"no strategy for model family {family!r}")  # pragma: no cover


def models(
    *,
    families: Sequence[str] | None = None,
    tokens: bool = False,
    allow_batchnorm: bool = False,
    allow_dropout: bool = False,
) -> st.SearchStrategy[Spec]:
    """Return a strategy for ``(model, model_kwargs)`` pairs naming tiny models
    in :data:`equiv.cases.models.MODELS`.

    ``families`` defaults to every family of :data:`MODEL_FAMILIES` (MLP with
    optional LayerNorm, Conv1d/Conv2d stacks with optional GroupNorm, GRU,
    LSTM, embedding + MultiheadAttention) or, with ``tokens=True`` (default
    False), of :data:`TOKEN_FAMILIES` (per-token logits for the token-level
    loss).  BatchNorm layers only with ``allow_batchnorm=True`` and dropout
    only with ``allow_dropout=True`` (both default False): no accumulation can
    reproduce them.  Shrinks toward the first family and its smallest shape.
    """
    _check_flag("tokens", tokens)
    _check_flag("allow_batchnorm", allow_batchnorm)
    _check_flag("allow_dropout", allow_dropout)
    known = TOKEN_FAMILIES if tokens else MODEL_FAMILIES
    chosen = known if families is None else _check_names("families", families, known)
    if allow_batchnorm and not any(f in ("mlp", "conv1d", "conv2d") for f in chosen):
        raise InvalidArgument(f"allow_batchnorm=True, but none of families={list(chosen)} has BatchNorm")
    return st.one_of([
        st.tuples(st.just(family), _family_kwargs(
            family, tokens=tokens, allow_batchnorm=allow_batchnorm, allow_dropout=allow_dropout))
        for family in chosen
    ])


# -------------------------------------------------------------- optimizers
def _log_uniform(low: float, high: float) -> st.SearchStrategy[float]:
    """Floats spread evenly in log space, rounded to 2 significant digits (readable)."""
    return st.floats(math.log10(low), math.log10(high)).map(lambda e: float(f"{10 ** e:.2g}"))


# eps from the default up to 1: a large eps breaks Adam's invariance to the
# gradient's scale, so an unscaled gradient shows in the update.
_EPS = st.sampled_from([1e-8, 1e-3, 0.1, 1.0])
_WEIGHT_DECAY = st.sampled_from([0.0, 1e-2, 0.1])
_BETAS = st.sampled_from([(0.9, 0.999), (0.5, 0.9), (0.0, 0.99)])


def _sgd() -> st.SearchStrategy[dict[str, Any]]:
    @st.composite
    def draw(draw: st.DrawFn) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"lr": draw(_log_uniform(1e-3, 0.3))}
        momentum = draw(st.sampled_from([0.0, 0.9, 0.5]))
        if momentum:
            kwargs["momentum"] = momentum
            if draw(st.booleans()):
                kwargs["nesterov"] = True  # needs dampening 0
            else:
                kwargs["dampening"] = draw(st.sampled_from([0.0, 0.3]))
        kwargs["weight_decay"] = draw(_WEIGHT_DECAY)
        return kwargs

    return draw()


def _optimizer_kwargs(name: str) -> st.SearchStrategy[dict[str, Any]]:
    lr_adaptive = _log_uniform(1e-4, 1e-1)
    table: dict[str, Callable[[], st.SearchStrategy[dict[str, Any]]]] = {
        "SGD": _sgd,
        "Adam": lambda: st.fixed_dictionaries({
            "lr": lr_adaptive, "betas": _BETAS, "eps": _EPS, "weight_decay": _WEIGHT_DECAY, "amsgrad": st.booleans(),
        }),
        "AdamW": lambda: st.fixed_dictionaries({
            "lr": lr_adaptive, "betas": _BETAS, "eps": _EPS, "weight_decay": _WEIGHT_DECAY, "amsgrad": st.booleans(),
        }),
        "Adamax": lambda: st.fixed_dictionaries({
            "lr": lr_adaptive, "betas": _BETAS, "eps": _EPS, "weight_decay": _WEIGHT_DECAY,
        }),
        "NAdam": lambda: st.fixed_dictionaries({
            "lr": lr_adaptive, "eps": _EPS, "weight_decay": _WEIGHT_DECAY,
            "momentum_decay": st.sampled_from([4e-3, 0.1]), "decoupled_weight_decay": st.booleans(),
        }),
        "RAdam": lambda: st.fixed_dictionaries({
            "lr": lr_adaptive, "eps": _EPS, "weight_decay": _WEIGHT_DECAY, "decoupled_weight_decay": st.booleans(),
        }),
        "RMSprop": lambda: st.fixed_dictionaries({
            "lr": lr_adaptive, "alpha": st.sampled_from([0.99, 0.5]), "eps": _EPS,
            "momentum": st.sampled_from([0.0, 0.9]), "centered": st.booleans(), "weight_decay": _WEIGHT_DECAY,
        }),
        "Adagrad": lambda: st.fixed_dictionaries({
            "lr": _log_uniform(1e-3, 0.3), "lr_decay": st.sampled_from([0.0, 0.1]), "eps": _EPS,
            "initial_accumulator_value": st.sampled_from([0.0, 0.1]), "weight_decay": _WEIGHT_DECAY,
        }),
        "Adadelta": lambda: st.fixed_dictionaries({
            "lr": _log_uniform(0.1, 1.0), "rho": st.sampled_from([0.9, 0.5]), "eps": st.sampled_from([1e-6, 1e-3, 0.1]),
            "weight_decay": _WEIGHT_DECAY,
        }),
    }
    return table[name]()


def optimizers(*, names: Sequence[str] | None = None) -> st.SearchStrategy[Spec]:
    """Return a strategy for ``(optimizer, optimizer_kwargs)`` pairs: a
    ``torch.optim`` class name and its hyperparameters.

    ``names`` defaults to :data:`OPTIMIZERS`, every deterministic first-order
    optimizer (SGD with momentum / Nesterov / dampening / weight decay, Adam
    and AdamW with amsgrad, Adamax, NAdam, RAdam, RMSprop with centering and
    momentum, Adagrad, Adadelta).  Hyperparameters range widely on purpose:
    learning rates over decades, eps up to 1 (which breaks the adaptive
    optimizers' invariance to the gradient's scale), betas with no momentum.
    Shrinks toward SGD without momentum.
    """
    chosen = OPTIMIZERS if names is None else _check_names("names", names, OPTIMIZERS)
    return st.one_of([st.tuples(st.just(name), _optimizer_kwargs(name)) for name in chosen])


# ------------------------------------------------------------------ losses
def losses(*, item_weighted: bool = False) -> st.SearchStrategy[str]:
    """Return a strategy for loss names (see :data:`equiv.losses.LOSSES`).

    By default (``item_weighted=False``) only losses whose mean is over
    samples: MSE and cross-entropy.  With ``item_weighted=True`` also the
    token-level cross-entropy with padding (``ignore_index``), whose correct
    normalisation is by the real tokens of the whole window.
    """
    _check_flag("item_weighted", item_weighted)
    return st.sampled_from(SAMPLE_LOSSES + (ITEM_WEIGHTED_LOSSES if item_weighted else ()))


# ------------------------------------------------------------------- cases
def cases(
    *,
    min_batch_size: int = 1,
    max_batch_size: int = 12,
    min_micro_batches: int = 1,
    max_micro_batches: int | None = None,
    families: Sequence[str] | None = None,
    optimizer_names: Sequence[str] | None = None,
    loss_names: Sequence[str] | None = None,
    item_weighted: bool = False,
    allow_batchnorm: bool = False,
    allow_dropout: bool = False,
    min_steps: int = 2,
    max_steps: int = 3,
    clipping: Sequence[str] = CLIPPING,
    schedulers: Sequence[str | None] = (None,),
    # Not bfloat16 by default: Adam's first update is lr * sign(g), and the sign
    # of a near-zero gradient is bfloat16 noise, so a correct step can differ
    # by a whole lr from the full batch (1.33 x allowed; reported).  Ask for it.
    dtypes: Sequence[str] = ("float32", "float64"),
    devices: Sequence[str] = ("cpu",),
    max_seed: int = 2**16,
) -> st.SearchStrategy[Case]:
    """Return a strategy for :class:`~equiv.cases.case.Case` objects composed from
    :func:`micro_batch_splits`, :func:`models`, :func:`optimizers` and
    :func:`losses`.

    Defaults: batch sizes 1..12; 1 micro-batch up to one sample each
    (``min_micro_batches``/``max_micro_batches``); every model family fitting
    the loss (``families``: model families for sample losses, token families
    are used for the token loss); every optimizer (``optimizer_names``); the
    sample-mean losses unless ``item_weighted=True`` (``loss_names`` picks
    exactly); no BatchNorm, no dropout; 2..3 steps (at least 2, so leaks
    across steps show); ``clipping`` among "none", "inactive" (a norm of 1e6)
    and "active" (a norm far below the gradient's); no LR scheduler
    (``schedulers`` lists names of :data:`SCHEDULERS`, None for none); working
    dtypes float32 and float64 (bfloat16 only when listed; the float64 tier
    runs for every case); device "cpu"; seeds 0..``max_seed``.  Shrinks
    toward a batch of 1 or 2 in few pieces, an MLP, SGD, MSE, two steps, seed 0.
    """
    _check_int("min_batch_size", min_batch_size, at_least=1)
    _check_int("max_batch_size", max_batch_size, at_least=1)
    _check_int("min_micro_batches", min_micro_batches, at_least=1)
    if max_micro_batches is not None:
        _check_int("max_micro_batches", max_micro_batches, at_least=1)
        if max_micro_batches < min_micro_batches:
            raise InvalidArgument(
                f"min_micro_batches={min_micro_batches} must be at most max_micro_batches={max_micro_batches}"
            )
    if min_batch_size > max_batch_size:
        raise InvalidArgument(f"min_batch_size={min_batch_size} must be at most max_batch_size={max_batch_size}")
    if min_micro_batches > max_batch_size:
        raise InvalidArgument(
            f"min_micro_batches={min_micro_batches} is more than max_batch_size={max_batch_size}: "
            "every micro-batch needs a sample"
        )
    # At least 2 steps: gradients or state a step leaks only show in the next one.
    _check_int("min_steps", min_steps, at_least=2)
    _check_int("max_steps", max_steps, at_least=2)
    if min_steps > max_steps:
        raise InvalidArgument(f"min_steps={min_steps} must be at most max_steps={max_steps}")
    _check_int("max_seed", max_seed, at_least=0)
    for flag in ("item_weighted", "allow_batchnorm", "allow_dropout"):
        _check_flag(flag, locals()[flag])
    loss_pool = SAMPLE_LOSSES + (ITEM_WEIGHTED_LOSSES if item_weighted else ())
    chosen_losses = loss_pool if loss_names is None else _check_names("loss_names", loss_names, tuple(LOSSES))
    chosen_optimizers = OPTIMIZERS if optimizer_names is None else _check_names(
        "optimizer_names", optimizer_names, OPTIMIZERS)
    chosen_clipping = _check_names("clipping", clipping, CLIPPING)
    chosen_schedulers = _check_names("schedulers", schedulers, tuple(SCHEDULERS))
    chosen_dtypes = _check_names("dtypes", dtypes, tuple(DTYPES))
    if isinstance(devices, str) or not devices:
        raise InvalidArgument(f"devices must be a non-empty sequence of device names but was {devices!r}")
    # Which model strategy serves which loss; validate the families once, here.
    sample_families = tuple(f for f in (families or MODEL_FAMILIES) if f in MODEL_FAMILIES)
    token_families = tuple(f for f in (families or TOKEN_FAMILIES) if f in TOKEN_FAMILIES)
    if families is not None:
        _check_names("families", families, tuple(dict.fromkeys(MODEL_FAMILIES + TOKEN_FAMILIES)))
    model_strategies: dict[str, st.SearchStrategy[Spec]] = {}
    for loss in chosen_losses:
        tokens = loss in ITEM_WEIGHTED_LOSSES
        pool = token_families if tokens else sample_families
        if not pool:
            raise InvalidArgument(
                f"loss {loss!r} needs a model family among {list(TOKEN_FAMILIES if tokens else MODEL_FAMILIES)}, "
                f"but families={list(families or ())}"
            )
        batchnorm = allow_batchnorm and any(f in ("mlp", "conv1d", "conv2d") for f in pool)
        model_strategies[loss] = models(
            families=pool, tokens=tokens, allow_batchnorm=batchnorm, allow_dropout=allow_dropout)
    optimizer_strategy = optimizers(names=chosen_optimizers)
    low_batch = max(min_batch_size, min_micro_batches)

    @st.composite
    def draw_case(draw: st.DrawFn) -> Case:
        batch_size = draw(st.integers(low_batch, max_batch_size))
        top = batch_size if max_micro_batches is None else min(max_micro_batches, batch_size)
        sizes = draw(_splits(batch_size, min_micro_batches, top))
        loss = draw(st.sampled_from(chosen_losses))
        model, model_kwargs = draw(model_strategies[loss])
        # BatchNorm1d after a linear layer cannot train on a single sample
        # (one value per channel): such a micro-batch is no case at all.
        assume(not (model == "mlp" and model_kwargs.get("norm") == "batch" and min(sizes) < 2))
        optimizer, optimizer_kwargs = draw(optimizer_strategy)
        clip = draw(st.sampled_from(chosen_clipping))
        scheduler = draw(st.sampled_from(chosen_schedulers))
        return Case(
            batch_size=batch_size,
            micro_batch_sizes=sizes,
            model=model,
            model_kwargs=model_kwargs,
            optimizer=optimizer,
            optimizer_kwargs=optimizer_kwargs,
            loss=loss,
            steps=draw(st.integers(min_steps, max_steps)),
            # inactive: far above any gradient norm of these models; active:
            # far below, so every step is clipped.
            max_grad_norm={"none": None, "inactive": 1e6, "active": draw(st.sampled_from([1e-2, 1e-3]))}[clip],
            scheduler=scheduler,
            scheduler_kwargs=dict(SCHEDULERS[scheduler]),
            dtype=draw(st.sampled_from(chosen_dtypes)),
            device=draw(st.sampled_from(list(devices))),
            seed=draw(st.integers(0, max_seed)),
        )

    return draw_case()

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

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hypothesis import assume
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument

from equiv.batches import even_sizes
from equiv.cases.case import DTYPES, PARAM_GROUPS, Case
from equiv.cases.family_draws import family_kwargs
from equiv.cases.optimizer_draws import optimizer_kwargs
from equiv.losses import LOSSES

__all__ = [
    "CLIPPING",
    "DEFAULT_MAX_BATCH_SIZE",
    "DEFAULT_MAX_EXTRA_SAMPLES",
    "DEFAULT_MAX_MICRO_BATCHES",
    "FEW_MICRO_BATCHES",
    "FROZEN_LAYERS",
    "ITEM_WEIGHTED_LOSSES",
    "LOSS_SCALING",
    "MATRIX_ONLY_OPTIMIZERS",
    "MODEL_FAMILIES",
    "OPTIMIZERS",
    "PARAM_GROUPS",
    "SAMPLE_LOSSES",
    "SCHEDULERS",
    "SEQUENCE_LOSS_FAMILIES",
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
#: Losses drawn only when named (``loss_names``), each with the families its
#: targets need: packed rows (:mod:`equiv.losses.packed`, DPO's rows packing
#: chosen/rejected pairs) and completions' log-probs (:mod:`equiv.losses.policy`).
SEQUENCE_LOSS_FAMILIES: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("packed_token_ce", "packed_sequence_ce", "packed_row_ce", "packed_dpo"), ("packed_lm",)),
    **dict.fromkeys(("policy_grpo", "policy_dapo", "policy_dr_grpo"), ("policy",)),
}
_SEQUENCE_FAMILIES: tuple[str, ...] = ("packed_lm", "policy")
#: Every deterministic first-order ``torch.optim`` optimizer the two tiers can
#: judge, simplest first (see :func:`optimizers` for the ones left out and why).
OPTIMIZERS: tuple[str, ...] = (
    "SGD",
    "Adam",
    "AdamW",
    "Adamax",
    "NAdam",
    "RAdam",
    "RMSprop",
    "Adagrad",
    "Adadelta",
    "ASGD",
    "Adafactor",
    "Rprop",
    "Muon",
)
#: Optimizers that take 2-D weights only (Muon orthogonalises each weight matrix; DeepSpeed's as a case names
#: it, every parameter in its Muon group): drawn with a bias-free, norm-free MLP, every parameter a matrix.
MATRIX_ONLY_OPTIMIZERS: frozenset[str] = frozenset({"Muon", "DeepSpeedMuon"})
#: Clipping regimes: no clipping, a norm the gradient never reaches, one it always exceeds.
CLIPPING: tuple[str, ...] = ("none", "inactive", "active")
#: Most cases have up to this many micro-batches (fewer more likely); about one
#: in five has more, up to ``max_micro_batches`` (see :func:`_count_table`).
FEW_MICRO_BATCHES = 8
#: The default bounds of :func:`cases`: N = 32 micro-batches (people run 8,
#: 16, 32), each batch holding its micro-batch count plus 0 to
#: DEFAULT_MAX_EXTRA_SAMPLES more samples (so up to 40 samples for 32
#: micro-batches, up to 16 for 8: small batches shrink in few steps, and a
#: search spends most of its checks shrinking).
DEFAULT_MAX_MICRO_BATCHES = 32
DEFAULT_MAX_EXTRA_SAMPLES = 8
DEFAULT_MAX_BATCH_SIZE = DEFAULT_MAX_MICRO_BATCHES + DEFAULT_MAX_EXTRA_SAMPLES
#: How many micro-batches a case has: ``table[i]`` for one drawn index ``i``,
#: the table sorted, so the count is ONE integer choice that the shrinker
#: lowers like any integer (toward 1), and a case found with 32 micro-batches
#: shrinks to 2 when 2 show the difference.  Weights: fewer pieces more likely
#: up to 8, then 10 entries in 56 (18%; about 20% of Hypothesis's draws) for
#: 9..32 with 16 and 32 (what people run) weighted up: often enough that a bug
#: showing only past 8 is met within a search of 60 cases, rare enough that
#: searches stay cheap (a check with 32 micro-batches costs about twice one with 2).
_FEW_COUNTS = (1,) * 8 + (2,) * 10 + (3,) * 7 + (4,) * 5 + (5,) * 3 + (6,) * 2 + (7, 8)
_MANY_COUNTS = (9, 10, 12, 14, 16, 16, 20, 24, 32, 32)


def _count_table(low: int, top: int) -> tuple[int, ...]:
    """The micro-batch counts to draw from (an index into them), within
    ``low``..``top``: counts past 8 rescaled from 9..32 onto 9..``top``,
    then every count clamped into the bounds (so the table stays sorted and
    its weights stay put when the bounds cut it)."""
    span = DEFAULT_MAX_MICRO_BATCHES - (FEW_MICRO_BATCHES + 1)
    many = (
        [
            FEW_MICRO_BATCHES + 1 + round((n - FEW_MICRO_BATCHES - 1) * (top - FEW_MICRO_BATCHES - 1) / span)
            for n in _MANY_COUNTS
        ]
        if top > FEW_MICRO_BATCHES
        else []
    )
    return tuple(min(max(n, low), top) for n in (*_FEW_COUNTS, *many))


#: Which layers a case may freeze (:attr:`equiv.Case.frozen_layers`): none, the first,
#: all but the head, the second (a middle layer, or the head of a 2-layer model), the head.
FROZEN_LAYERS: tuple[int | tuple[int, ...], ...] = (0, 1, -1, (1,), (-1,))


#: LR schedulers a case may step once per optimizer step (None: no scheduler),
#: simplest first, so a search shrinks to no scheduler, then to StepLR.  Each
#: changes the lr at every one of a case's 2..3 steps (so a step stepped too
#: often, too early or on a skipped window shows): step decays, milestones,
#: warm-up, cosine (with restarts, the per-epoch schedule of SGDR stepped per
#: window), and the composites people chain (warm-up then cosine: SequentialLR;
#: warm-up times decay: ChainedScheduler).  Left out: ReduceLROnPlateau, whose
#: step(metrics) needs a loss the contract does not define (the window's mean?
#: a validation loss?), so no reference could drive it the way a step does;
#: OneCycleLR and CyclicLR, which set absolute learning rates (max_lr,
#: base_lr) over the drawn optimizer's lr and cycle momentum, which not every
#: optimizer has; LambdaLR and MultiplicativeLR, whose lambdas a case cannot
#: hold as plain values.
SCHEDULERS: dict[str | None, dict[str, Any]] = {
    None: {},
    "StepLR": {"step_size": 1, "gamma": 0.5},
    "ExponentialLR": {"gamma": 0.7},
    "MultiStepLR": {"milestones": [1, 2], "gamma": 0.3},
    "LinearLR": {"start_factor": 0.25, "total_iters": 3},
    "CosineAnnealingLR": {"T_max": 3, "eta_min": 0.0},
    "CosineAnnealingWarmRestarts": {"T_0": 2},
    "ChainedScheduler": {
        "schedulers": [["LinearLR", {"start_factor": 0.25, "total_iters": 2}], ["ExponentialLR", {"gamma": 0.7}]]
    },
    "SequentialLR": {
        "schedulers": [["LinearLR", {"start_factor": 0.25, "total_iters": 1}], ["CosineAnnealingLR", {"T_max": 2}]],
        "milestones": [1],
    },
}

#: Dynamic loss scaling regimes (torch.amp.GradScaler), for steps that take a
#: ``grad_scaler``: none; "dynamic", a power-of-two scale (exact: unscaling
#: only moves exponents) that may grow after clean windows; "overflow", the
#: same with one sample's inputs +inf in one window, which must skip that
#: whole window and back the scale off once.  Simplest first: a search shrinks
#: to no loss scale, then to no overflow.
LOSS_SCALING: tuple[str, ...] = ("none", "dynamic", "overflow")
#: Model families whose inputs are integer tokens: no +inf can be put in them,
#: so no "overflow" case is drawn with one.
_TOKEN_INPUT_FAMILIES = frozenset({"attention", "token_mlp", "packed_lm", "policy"})


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
def _cut_into(draw: st.DrawFn, batch_size: int, pieces: int) -> tuple[int, ...]:
    """``batch_size`` samples cut into ``pieces`` micro-batches: one integer
    per cut, each shrinking toward 1 with the rest in the last piece.  Always
    ``pieces - 1`` choices whatever their values, so lowering an early size is
    a shrink the shrinker can take (a cut that stopped when the samples ran
    out would need more choices once an early piece is smaller, and the
    shrinker rejects a candidate that runs past its choices)."""
    sizes: list[int] = []
    left = batch_size
    for index in range(pieces - 1):
        # Leave a sample for every piece still to come.
        size = draw(st.integers(1, left - (pieces - 1 - index)))
        sizes.append(size)
        left -= size
    return (*sizes, left)


@st.composite
def _splits(draw: st.DrawFn, batch_size: int, min_pieces: int, max_pieces: int) -> tuple[int, ...]:
    # The number of pieces first (one choice, shrinking toward min_pieces), then the cuts.
    return _cut_into(draw, batch_size, draw(st.integers(min_pieces, max_pieces)))


def micro_batch_splits(
    batch_size: int, *, min_pieces: int = 1, max_pieces: int | None = None
) -> st.SearchStrategy[tuple[int, ...]]:
    """Return a strategy for ordered compositions of ``batch_size``: tuples of
    positive micro-batch sizes, in order, that add up to ``batch_size``.

    The number of pieces lies in [``min_pieces`` (default 1), ``max_pieces``
    (default ``batch_size``: one sample each)], drawn first; then each size
    is drawn anywhere it fits, so splits are deliberately uneven.  Shrinks
    toward few pieces, and toward small pieces first with the rest in the
    last one (e.g. ``(1, 2)`` for a batch of 3 in two pieces).
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
def models(
    *,
    families: Sequence[str] | None = None,
    tokens: bool = False,
    allow_batchnorm: bool = False,
    allow_dropout: bool = False,
    tiny: bool = False,
) -> st.SearchStrategy[Spec]:
    """Return a strategy for ``(model, model_kwargs)`` pairs naming tiny models
    in :data:`equiv.cases.models.MODELS`.

    ``families`` defaults to every family of :data:`MODEL_FAMILIES` (MLP with
    optional LayerNorm, Conv1d/Conv2d stacks with optional GroupNorm, GRU,
    LSTM, embedding + MultiheadAttention) or, with ``tokens=True`` (default
    False), of :data:`TOKEN_FAMILIES` (per-token logits for the token-level
    loss).  BatchNorm layers only with ``allow_batchnorm=True`` and dropout
    only with ``allow_dropout=True`` (both default False): no accumulation can
    reproduce them.  ``tiny=True`` (default False) draws only the smallest
    shapes of each family (one hidden layer, sequences of 1 to 3): what
    :func:`cases` uses for cases with many micro-batches.  Shrinks toward the
    first family and its smallest shape.
    """
    _check_flag("tokens", tokens)
    _check_flag("tiny", tiny)
    _check_flag("allow_batchnorm", allow_batchnorm)
    _check_flag("allow_dropout", allow_dropout)
    known = TOKEN_FAMILIES + _SEQUENCE_FAMILIES if tokens else MODEL_FAMILIES
    chosen = (
        (TOKEN_FAMILIES if tokens else MODEL_FAMILIES)
        if families is None
        else _check_names("families", families, known)
    )
    if allow_batchnorm and not any(f in ("mlp", "conv1d", "conv2d") for f in chosen):
        raise InvalidArgument(f"allow_batchnorm=True, but none of families={list(chosen)} has BatchNorm")
    return st.one_of(
        [
            st.tuples(
                st.just(family),
                family_kwargs(
                    family, tokens=tokens, allow_batchnorm=allow_batchnorm, allow_dropout=allow_dropout, tiny=tiny
                ),
            )
            for family in chosen
        ]
    )


# -------------------------------------------------------------- optimizers
def optimizers(*, names: Sequence[str] | None = None) -> st.SearchStrategy[Spec]:
    """Return a strategy for ``(optimizer, optimizer_kwargs)`` pairs: a
    ``torch.optim`` class name and its hyperparameters.

    ``names`` defaults to :data:`OPTIMIZERS`, every deterministic first-order
    optimizer (SGD with momentum / Nesterov / dampening / weight decay, Adam
    and AdamW with amsgrad, Adamax, NAdam, RAdam, RMSprop with centering and
    momentum, Adagrad, Adadelta, ASGD with its running average, Adafactor
    with factored second moments, Rprop).  Hyperparameters range widely on
    purpose: learning rates over decades, eps up to 1 (which breaks the
    adaptive optimizers' invariance to the gradient's scale), betas with no
    momentum.  Shrinks toward SGD without momentum.

    ``Muon`` orthogonalises each update with a Newton-Schulz iteration that
    runs in bfloat16 whatever the parameters' dtype, so even the float64
    truth carries bfloat16 rounding.  Its floor models that rounding as it is:
    the exact tier's direct float64 samples (the batch shuffled, normalised
    after backward) go through the same bfloat16 iteration and land a
    bfloat16 flip away from the truth, so a correct accumulation (another
    float64 rounding order, flipping as many) passes, while orthogonalising
    each micro-batch (stepping per micro-batch) is O(1) off.  It takes 2-D
    weights only (:data:`MATRIX_ONLY_OPTIMIZERS`): drawn with a bias-free,
    norm-free MLP.  Left out of ``torch.optim``: ``LBFGS`` (a closure
    re-evaluates the loss several times per step: not one update from the
    accumulated gradient) and ``SparseAdam`` (sparse gradients only).  Rprop and Adafactor
    take sign-like first steps (Adafactor's on vectors: ``g / |g|``), like
    Adam's: measured with the reference accumulator over 500 drawn cases each
    (all families, token losses, schedulers, up to 32 micro-batches) their
    worst difference stayed below 0.15 x allowed in both tiers.
    """
    chosen = OPTIMIZERS if names is None else _check_names("names", names, OPTIMIZERS)
    return st.one_of([st.tuples(st.just(name), optimizer_kwargs(name)) for name in chosen])


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
    max_batch_size: int | None = None,
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
    loss_scaling: Sequence[str] = ("none",),
    param_groups: Sequence[str | None] = (None, *PARAM_GROUPS),
    frozen_layers: Sequence[int | tuple[int, ...]] = FROZEN_LAYERS,
    # Not bfloat16 by default: Adam's first update, lr * sign(g), of a near-zero g is bfloat16 noise, so a
    # correct step can differ by a whole lr from the full batch (1.33 x allowed; reported).  Ask for it.
    dtypes: Sequence[str] = ("float32", "float64"),
    devices: Sequence[str] = ("cpu",),
    max_seed: int = 2**16,
) -> st.SearchStrategy[Case]:
    """Return a strategy for :class:`~equiv.cases.case.Case` objects composed from :func:`micro_batch_splits`,
    :func:`models`, :func:`optimizers` and :func:`losses`.

    Micro-batches: ``min_micro_batches`` (1) to ``max_micro_batches`` (None: :data:`DEFAULT_MAX_MICRO_BATCHES`, 32),
    never more than the batch has samples.  About four cases in five have at most :data:`FEW_MICRO_BATCHES` (8), fewer
    more likely, cut anywhere; the others have 9 up to ``max_micro_batches`` (16 and 32 weighted up), cut as evenly as
    possible or anywhere, with the tiny shapes of :func:`models` (``tiny=True``) so that N forward passes stay cheap.  A
    batch holds its micro-batch count (at least ``min_batch_size``, 1) plus 0 to :data:`DEFAULT_MAX_EXTRA_SAMPLES` (8)
    samples, or, when ``max_batch_size`` is given, plus 0 up to that many samples, capped at ``max_batch_size``
    (micro-batch counts are capped there too: a micro-batch needs a sample).

    The rest: every model family fitting the loss (``families``: model families for sample losses, token families are
    used for the token loss); every optimizer (``optimizer_names``); the sample-mean losses unless
    ``item_weighted=True`` (``loss_names`` picks exactly); no BatchNorm, no dropout; 2..3 steps (at least 2, so leaks
    across steps show); ``clipping`` among "none", "inactive" (a norm of 1e6) and "active" (a norm far below the
    gradient's); no LR scheduler (``schedulers`` lists names of :data:`SCHEDULERS`, None for none); no loss scaling
    (``loss_scaling`` lists regimes of :data:`LOSS_SCALING`: "dynamic" draws a power-of-two ``loss_scale`` from 2 to
    2**16 and a ``scale_growth_interval`` of None, 1 or 2 clean windows, "overflow" also an ``overflow_at`` window and
    sample, never in a model whose inputs are tokens); ``param_groups``: one group (None) or a recipe of
    :data:`PARAM_GROUPS`, each equally often; the layers frozen in half the cases, as fine-tuning freezes them
    (``frozen_layers``: the choices to draw from, among :data:`FROZEN_LAYERS`: the bottom, the base under a trainable
    head, a middle layer with trainable layers below it, the head); working dtypes float32 and float64 (bfloat16 only
    when listed; the float64 tier runs for every case); device "cpu"; seeds 0..``max_seed``.

    Shrinks toward a batch of 1 or 2 in few pieces, a small model, SGD, MSE, one parameter group, nothing frozen, two
    steps, no scheduler, no loss scale (then no overflow, no growth, the overflow in the first window's first sample),
    seed 0: the micro-batch count is one choice, and no other choice changes meaning with it, so a case found with 32
    micro-batches still shrinks to 2 when 2 show the difference.
    """
    # The keywords as given (locals() holds exactly them here), checked and
    # turned into what each case is drawn from, in the order of the messages.
    return _draw_case(_CasePlan.of(_CaseBounds(**locals())))


@dataclass(frozen=True, kw_only=True)
class _CaseBounds:
    """The keywords of :func:`cases`, as given (checked by :meth:`_CasePlan.of`)."""

    min_batch_size: int
    max_batch_size: int | None
    min_micro_batches: int
    max_micro_batches: int | None
    families: Sequence[str] | None
    optimizer_names: Sequence[str] | None
    loss_names: Sequence[str] | None
    item_weighted: bool
    allow_batchnorm: bool
    allow_dropout: bool
    min_steps: int
    max_steps: int
    clipping: Sequence[str]
    schedulers: Sequence[str | None]
    loss_scaling: Sequence[str]
    param_groups: Sequence[str | None]
    frozen_layers: Sequence[int | tuple[int, ...]]
    dtypes: Sequence[str]
    devices: Sequence[str]
    max_seed: int


@dataclass(frozen=True, kw_only=True)
class _CasePlan:
    """What :func:`cases` draws each case from: its bounds checked, its choices
    and the strategies for the model, the optimizer, the groups, the frozen layers."""

    low_batch: int
    max_batch_size: int | None
    extra_samples: int
    counts: st.SearchStrategy[int]
    clipping: tuple[str, ...]
    losses: tuple[str, ...]
    #: (loss, tiny) -> the models that serve that loss.
    models: dict[tuple[str, bool], st.SearchStrategy[Spec]]
    frozen: st.SearchStrategy[int | tuple[int, ...]]
    optimizers: st.SearchStrategy[Spec]
    groups: st.SearchStrategy[str | None]
    schedulers: tuple[str | None, ...]
    min_steps: int
    max_steps: int
    dtypes: tuple[str, ...]
    devices: list[str]
    max_seed: int
    scaling: list[str]

    @classmethod
    def of(cls, bounds: _CaseBounds) -> _CasePlan:
        max_micro_batches = _checked_micro_batches(bounds)
        # At least 2 steps: gradients or state a step leaks only show in the next one.
        _check_int("min_steps", bounds.min_steps, at_least=2)
        _check_int("max_steps", bounds.max_steps, at_least=2)
        if bounds.min_steps > bounds.max_steps:
            raise InvalidArgument(f"min_steps={bounds.min_steps} must be at most max_steps={bounds.max_steps}")
        _check_int("max_seed", bounds.max_seed, at_least=0)
        for flag in ("item_weighted", "allow_batchnorm", "allow_dropout"):
            _check_flag(flag, getattr(bounds, flag))
        loss_pool = SAMPLE_LOSSES + (ITEM_WEIGHTED_LOSSES if bounds.item_weighted else ())
        losses = (
            loss_pool if bounds.loss_names is None else _check_names("loss_names", bounds.loss_names, tuple(LOSSES))
        )
        optimizer_names = (
            OPTIMIZERS
            if bounds.optimizer_names is None
            else _check_names("optimizer_names", bounds.optimizer_names, OPTIMIZERS)
        )
        clipping = _check_names("clipping", bounds.clipping, CLIPPING)
        schedulers = _check_names("schedulers", bounds.schedulers, tuple(SCHEDULERS))
        # In LOSS_SCALING's order whatever the order given, so "none" is what a case shrinks to.
        scaling = sorted(_check_names("loss_scaling", bounds.loss_scaling, LOSS_SCALING), key=LOSS_SCALING.index)
        groups = _check_names("param_groups", bounds.param_groups, (None, *PARAM_GROUPS))
        frozen = _frozen_layers(bounds.frozen_layers)
        dtypes = _check_names("dtypes", bounds.dtypes, tuple(DTYPES))
        if isinstance(bounds.devices, str) or not bounds.devices:
            raise InvalidArgument(f"devices must be a non-empty sequence of device names but was {bounds.devices!r}")
        models = _model_strategies(bounds, losses)
        low_batch = max(bounds.min_batch_size, bounds.min_micro_batches)
        if bounds.max_batch_size is None:
            top_count, extra_samples = max_micro_batches, DEFAULT_MAX_EXTRA_SAMPLES
        else:
            top_count, extra_samples = min(max_micro_batches, bounds.max_batch_size), bounds.max_batch_size - low_batch
        return cls(
            low_batch=low_batch,
            max_batch_size=bounds.max_batch_size,
            extra_samples=extra_samples,
            counts=st.sampled_from(_count_table(bounds.min_micro_batches, top_count)),
            clipping=clipping,
            losses=losses,
            models=models,
            frozen=frozen,
            optimizers=optimizers(names=optimizer_names),
            # One group (None) first, so it is what a case shrinks to; each recipe as
            # often (three in four cases have two groups by default: a search meets
            # groups with active clipping in about one case in four).
            groups=st.sampled_from(sorted(groups, key=lambda g: g is not None)),
            schedulers=schedulers,
            min_steps=bounds.min_steps,
            max_steps=bounds.max_steps,
            dtypes=dtypes,
            devices=list(bounds.devices),
            max_seed=bounds.max_seed,
            scaling=scaling,
        )


def _checked_micro_batches(bounds: _CaseBounds) -> int:
    """Check the batch and micro-batch bounds; the top micro-batch count (None:
    the default, raised to what the lower bounds ask for)."""
    min_batch_size, max_batch_size = bounds.min_batch_size, bounds.max_batch_size
    min_micro_batches, max_micro_batches = bounds.min_micro_batches, bounds.max_micro_batches
    _check_int("min_batch_size", min_batch_size, at_least=1)
    _check_int("min_micro_batches", min_micro_batches, at_least=1)
    if max_batch_size is not None:
        _check_int("max_batch_size", max_batch_size, at_least=1)
    if max_micro_batches is not None:
        _check_int("max_micro_batches", max_micro_batches, at_least=1)
    if max_batch_size is not None and max_micro_batches is not None and max_micro_batches > max_batch_size:
        raise InvalidArgument(
            f"max_micro_batches={max_micro_batches} is more than max_batch_size={max_batch_size}: "
            "every micro-batch needs a sample"
        )
    if max_micro_batches is None:
        max_micro_batches = max(DEFAULT_MAX_MICRO_BATCHES, min_micro_batches)
    if max_micro_batches < min_micro_batches:
        raise InvalidArgument(
            f"min_micro_batches={min_micro_batches} must be at most max_micro_batches={max_micro_batches}"
        )
    if max_batch_size is not None and min_batch_size > max_batch_size:
        raise InvalidArgument(f"min_batch_size={min_batch_size} must be at most max_batch_size={max_batch_size}")
    if max_batch_size is not None and min_micro_batches > max_batch_size:
        raise InvalidArgument(
            f"min_micro_batches={min_micro_batches} is more than max_batch_size={max_batch_size}: "
            "every micro-batch needs a sample"
        )
    return max_micro_batches


def _frozen_layers(frozen_layers: Sequence[int | tuple[int, ...]]) -> st.SearchStrategy[int | tuple[int, ...]]:
    """Nothing frozen in half the cases when that is allowed (and what a case
    shrinks to); each placement as often: the bottom, the base under a
    trainable head, a middle layer with trainable layers below it, the head."""
    # Every family has 2 layers or more, so each choice leaves one to train.
    if isinstance(frozen_layers, Sequence) and any(isinstance(choice, bool) for choice in frozen_layers):
        raise InvalidArgument(f"frozen_layers must list choices among {list(FROZEN_LAYERS)} but was {frozen_layers!r}")
    chosen = [
        choice for choice in FROZEN_LAYERS if choice in _check_names("frozen_layers", frozen_layers, FROZEN_LAYERS)
    ]
    placements = [choice for choice in chosen if choice != 0]
    nothing: list[int | tuple[int, ...]] = [0] * len(placements)
    return st.sampled_from(nothing + placements if 0 in chosen else chosen)


def _model_strategies(bounds: _CaseBounds, losses: tuple[str, ...]) -> dict[tuple[str, bool], st.SearchStrategy[Spec]]:
    """(loss, tiny) -> the models that serve that loss; the families checked once, here."""
    families = bounds.families
    sample_families = tuple(f for f in (families or MODEL_FAMILIES) if f in MODEL_FAMILIES)
    token_families = tuple(f for f in (families or TOKEN_FAMILIES) if f in TOKEN_FAMILIES)
    if families is not None:
        _check_names("families", families, tuple(dict.fromkeys(MODEL_FAMILIES + TOKEN_FAMILIES + _SEQUENCE_FAMILIES)))
    strategies: dict[tuple[str, bool], st.SearchStrategy[Spec]] = {}
    for loss in losses:
        if loss in SEQUENCE_LOSS_FAMILIES:  # the loss's own families (a families filter may not leave them out)
            own = SEQUENCE_LOSS_FAMILIES[loss]
            if families is not None and not set(own) & set(families):
                raise InvalidArgument(
                    f"loss {loss!r} needs a model family among {list(own)}, but families={list(families)}"
                )
            for tiny in (False, True):
                drawn = models(families=own, tokens=True, tiny=tiny)
                # DPO's rows pack chosen/rejected pairs: a function of the loss, not a drawn choice.
                strategies[loss, tiny] = drawn.map(_with_pairs) if loss == "packed_dpo" else drawn
            continue
        tokens = loss in ITEM_WEIGHTED_LOSSES
        pool = token_families if tokens else sample_families
        if not pool:
            raise InvalidArgument(
                f"loss {loss!r} needs a model family among {list(TOKEN_FAMILIES if tokens else MODEL_FAMILIES)}, "
                f"but families={list(families or ())}"
            )
        batchnorm = bounds.allow_batchnorm and any(f in ("mlp", "conv1d", "conv2d") for f in pool)
        for tiny in (False, True):
            strategies[loss, tiny] = models(
                families=pool, tokens=tokens, allow_batchnorm=batchnorm, allow_dropout=bounds.allow_dropout, tiny=tiny
            )
    return strategies


def _with_pairs(spec: Spec) -> Spec:
    return spec[0], {**spec[1], "pairs": True}


@st.composite
def _draw_case(draw: st.DrawFn, plan: _CasePlan) -> Case:
    """One case.  Every choice means the same whatever the count, so that
    lowering the count alone (one integer) is a shrink the shrinker can take:
    the batch is the count plus a drawn surplus (not a range that depends on
    the count), the model takes the same choices tiny or not, and the cut is
    drawn last, with its choices drawn even when an even cut is used (a
    9-piece even cut then shrinks to 2 uneven pieces, not to 2 even ones that
    hide a mean of means).  The helpers draw with ``draw`` (no strategy of
    their own), so the choices are the same as when this was one function."""
    count = draw(plan.counts)
    batch_size = max(plan.low_batch, count) + draw(st.integers(0, plan.extra_samples))
    if plan.max_batch_size is not None:
        batch_size = min(batch_size, plan.max_batch_size)
    # Only cases with more than FEW_MICRO_BATCHES micro-batches are cut as
    # evenly as possible (how a batch of B is cut into N: sizes differ by
    # one at most); the choice is drawn for every case, and False (cut
    # anywhere) is what it shrinks to.
    even = draw(st.booleans())
    max_grad_norm = _draw_clip_norm(draw, plan.clipping)
    loss = draw(st.sampled_from(plan.losses))
    trained = _draw_model_and_optimizer(draw, plan, loss=loss, tiny=count > FEW_MICRO_BATCHES)
    scheduler = draw(st.sampled_from(plan.schedulers))
    steps = draw(st.integers(plan.min_steps, plan.max_steps))
    dtype = draw(st.sampled_from(plan.dtypes))
    device = draw(st.sampled_from(plan.devices))
    seed = draw(st.integers(0, plan.max_seed))
    # Before the cut (whose number of choices follows the count), so that
    # lowering the count leaves these choices where they were.
    scaled = _draw_loss_scaling(draw, plan.scaling, model=trained["model"], steps=steps, batch_size=batch_size)
    sizes = _cut_into(draw, batch_size, count)
    if count > FEW_MICRO_BATCHES and even:
        sizes = tuple(even_sizes(batch_size, count))
    # BatchNorm1d after a linear layer cannot train on a single sample
    # (one value per channel): such a micro-batch is no case at all.
    assume(not (trained["model"] == "mlp" and trained["model_kwargs"].get("norm") == "batch" and min(sizes) < 2))
    return Case(
        batch_size=batch_size,
        micro_batch_sizes=sizes,
        **trained,
        loss=loss,
        steps=steps,
        max_grad_norm=max_grad_norm,
        scheduler=scheduler,
        scheduler_kwargs=dict(SCHEDULERS[scheduler]),
        **scaled,
        dtype=dtype,
        device=device,
        seed=seed,
    )


def _draw_model_and_optimizer(draw: st.DrawFn, plan: _CasePlan, *, loss: str, tiny: bool) -> dict[str, Any]:
    """The case's model, its frozen layers, its optimizer and parameter groups, as
    :class:`~equiv.cases.case.Case` fields: the model is drawn for the loss (its
    tiny shapes for a case with many micro-batches), and a matrix-only optimizer
    takes a bias-free, norm-free MLP."""
    model, model_kwargs = draw(plan.models[loss, tiny])
    frozen = draw(plan.frozen)
    optimizer, optimizer_kwargs = draw(plan.optimizers)
    if optimizer in MATRIX_ONLY_OPTIMIZERS:
        # Every parameter a matrix: an MLP without biases or norms (a function of the
        # draw, so shrinking the optimizer back to SGD gives the drawn model back).
        assume(model == "mlp")
        model_kwargs = {**model_kwargs, "bias": False, "norm": "none"}
    groups = draw(plan.groups)
    # "no_decay" splits off biases and norm weights, which a matrix-only model has none of.
    assume(not (optimizer in MATRIX_ONLY_OPTIMIZERS and groups == "no_decay"))
    return {
        "model": model,
        "model_kwargs": model_kwargs,
        "frozen_layers": frozen,
        "optimizer": optimizer,
        "optimizer_kwargs": optimizer_kwargs,
        "param_groups": groups,
    }


def _draw_clip_norm(draw: st.DrawFn, clipping: tuple[str, ...]) -> float | None:
    """The clip norm of a drawn regime: inactive, far above any gradient norm
    of these models; active, far below, so every step is clipped (its norm
    drawn only then)."""
    clip = draw(st.sampled_from(clipping))
    if clip == "active":
        return draw(st.sampled_from([1e-2, 1e-3]))
    return {"none": None, "inactive": 1e6}[clip]


def _draw_loss_scaling(
    draw: st.DrawFn, scaling: list[str], *, model: str, steps: int, batch_size: int
) -> dict[str, Any]:
    """The loss-scaling fields of a drawn regime (none: no field)."""
    regime = draw(st.sampled_from(scaling))
    scaled: dict[str, Any] = {}
    if regime != "none":
        scaled["loss_scale"] = 2.0 ** draw(st.integers(1, 16))
        scaled["scale_growth_interval"] = draw(st.sampled_from([None, 1, 2]))
    if regime == "overflow":
        # +inf in one sample's inputs: a token model has none to set.
        assume(model not in _TOKEN_INPUT_FAMILIES)
        scaled["overflow_at"] = (draw(st.integers(0, steps - 1)), draw(st.integers(0, batch_size - 1)))
    return scaled

"""Public Hypothesis strategies for accumulation cases: ``equiv.strategies``.

A thin public namespace, as Hypothesis's own ``strategies`` module is; the
code lives in :mod:`equiv.cases.strategies`.  Use them in your own tests::

    from hypothesis import given
    from equiv.cases import strategies as eqst

    @given(eqst.cases(optimizer_names=["AdamW"]))
    def test_my_step(case):
        equiv.check(my_step, case).assert_ok()
"""

from equiv.cases.strategies import (
    CLIPPING,
    DEFAULT_MAX_BATCH_SIZE,
    DEFAULT_MAX_EXTRA_SAMPLES,
    DEFAULT_MAX_MICRO_BATCHES,
    FEW_MICRO_BATCHES,
    ITEM_WEIGHTED_LOSSES,
    MODEL_FAMILIES,
    OPTIMIZERS,
    PARAM_GROUPS,
    SAMPLE_LOSSES,
    SCHEDULERS,
    TOKEN_FAMILIES,
    cases,
    losses,
    micro_batch_splits,
    models,
    optimizers,
)

__all__ = [
    "CLIPPING",
    "DEFAULT_MAX_BATCH_SIZE",
    "DEFAULT_MAX_EXTRA_SAMPLES",
    "DEFAULT_MAX_MICRO_BATCHES",
    "FEW_MICRO_BATCHES",
    "ITEM_WEIGHTED_LOSSES",
    "MODEL_FAMILIES",
    "OPTIMIZERS",
    "PARAM_GROUPS",
    "SAMPLE_LOSSES",
    "SCHEDULERS",
    "TOKEN_FAMILIES",
    "cases",
    "losses",
    "micro_batch_splits",
    "models",
    "optimizers",
]

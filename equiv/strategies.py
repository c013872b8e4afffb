"""Public Hypothesis strategies for accumulation cases: ``equiv.strategies``.

A thin public namespace, as Hypothesis's own ``strategies`` module is; the
code lives in :mod:`equiv.cases.strategies` (and :func:`cases_for` in
:mod:`equiv.checking.search_space`).  Use them in your own tests, drawing only cases
your step can take (no clip norm for a step without ``max_grad_norm``, so a
search never shrinks to a case that says nothing about the step)::

    from hypothesis import given
    import equiv, equiv.testing

    @given(equiv.strategies.cases_for(my_step, optimizer_names=["AdamW"]))
    def test_my_step(case):
        equiv.testing.assert_equivalent(my_step, case)
"""

from equiv.cases.strategies import (
    CLIPPING,
    DEFAULT_MAX_BATCH_SIZE,
    DEFAULT_MAX_EXTRA_SAMPLES,
    DEFAULT_MAX_MICRO_BATCHES,
    FEW_MICRO_BATCHES,
    FROZEN_LAYERS,
    ITEM_WEIGHTED_LOSSES,
    LOSS_SCALING,
    MATRIX_ONLY_OPTIMIZERS,
    MODEL_FAMILIES,
    OPTIMIZERS,
    PARAM_GROUPS,
    SAMPLE_LOSSES,
    SCHEDULERS,
    SEQUENCE_LOSS_FAMILIES,
    TOKEN_FAMILIES,
    cases,
    losses,
    micro_batch_splits,
    models,
    optimizers,
)
from equiv.checking.search_space import cases_for

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
    "cases_for",
    "losses",
    "micro_batch_splits",
    "models",
    "optimizers",
]

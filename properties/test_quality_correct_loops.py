"""Correct steps written as real training code writes them are never failed.

The zoo's correct loops (:mod:`equiv.zoo.correct`) each do float32 arithmetic
inside equiv's float64 run: a default-dtype tensor of counts, a running loss
in ``torch.zeros(1)``, a clip norm in float32.  For a user who trains in
float32 or lower none of that costs anything, so the default search passes
them (counting precision notes); for a user who trains in float64 it is a
finding of class "precision", never a mathematical mismatch.
"""

import pytest

from equiv.checking.search_space import SearchSpace
from equiv.checking.verify import verify
from equiv.outcomes import Outcome
from equiv.zoo.correct import CORRECT_STEPS, FLOAT32_ON_THE_GRADIENT

#: Enough cases to meet clipping, token losses and several optimizers, in seconds.
EXAMPLES = 30


@pytest.mark.parametrize("name", sorted(CORRECT_STEPS))
def test_the_default_search_passes_a_correct_real_loop(name: str) -> None:
    result = verify(
        CORRECT_STEPS[name],
        SearchSpace(item_weighted=True),
        max_examples=EXAMPLES,
        seed=0,
        replay_in_fresh_process=False,
    )
    assert result, result.message()
    if name in FLOAT32_ON_THE_GRADIENT:
        assert result.precision_notes > 0, "the float32 arithmetic was never noticed"
    else:
        assert result.precision_notes == 0, result.precision_note


def test_for_float64_training_it_is_a_precision_finding_not_a_mismatch() -> None:
    # One step is enough here: tests/test_precision.py holds both to it case by case.
    result = verify(
        CORRECT_STEPS["scales_by_inverse_item_count"],
        SearchSpace(item_weighted=True),
        max_examples=EXAMPLES,
        seed=0,
        replay_in_fresh_process=False,
        train_dtype="float64",
    )
    assert result.outcome is Outcome.PRECISION, result.message()

"""Quality of the search on packed sequences and RL normalisers: equiv.verify
FINDS every step of :data:`equiv.zoo.sequence_bugs.PACKED_BUGS` and
:data:`~equiv.zoo.sequence_bugs.POLICY_BUGS` on the loss its report is about,
shrinks it to a case that says what is wrong, and finds nothing wrong with the
reference accumulator on any of these losses (every correct variant passes).

The searches name the loss (``SearchSpace(losses=...)``): packed and policy
losses are drawn only when named, each with the model family its targets need.
"""

from collections.abc import Callable

import pytest
from search_claims import assert_found_and_shrunk

import equiv
from equiv.cases.strategies import SEQUENCE_LOSS_FAMILIES
from equiv.checking.search_space import SearchSpace
from equiv.checking.verify import verify
from equiv.zoo.sequence_bugs import PACKED_BUGS, POLICY_BUGS


def pieces(case: equiv.Case) -> int:
    return len(case.micro_batch_sizes)


#: bug -> what its shrunk counterexample must satisfy (and why).
SHRUNK: dict[str, Callable[[equiv.Case], bool]] = {
    # The sign is wrong on any case: one row holding one pair, one micro-batch.
    "dpo_pairs_swapped": lambda c: c.batch_size == 1 and c.model_kwargs["pairs"],
    # Rows with different numbers of sequences, no accumulation needed: two rows, one micro-batch.
    "row_mean_of_sequence_means": lambda c: c.batch_size == 2 and pieces(c) == 1,
    # Weighting by rows is exact with one micro-batch: two of one row each.
    "sequence_means_weighted_by_rows": lambda c: c.micro_batch_sizes == (1, 1),
    # Micro-batch means (SkyRL's legacy token mean), sequence weights (Trinity-RFT's default), kept-token
    # normalisers (AReaL #1730): each exact for one micro-batch, found with two of one completion each.
    "token_mean_of_micro_batch_means": lambda c: c.micro_batch_sizes == (1, 1),
    "token_means_weighted_by_sequences": lambda c: c.micro_batch_sizes == (1, 1),
    "selected_count_per_micro_batch": lambda c: c.micro_batch_sizes == (1, 1),
}
BUGS = {**PACKED_BUGS, **POLICY_BUGS}


def test_every_bug_has_a_shrink_claim() -> None:
    assert set(SHRUNK) == set(BUGS)


@pytest.mark.parametrize("name", sorted(BUGS))
def test_search_finds_and_shrinks(name: str) -> None:
    step, loss = BUGS[name]
    case = assert_found_and_shrunk(name, step, SHRUNK[name], space=SearchSpace(losses=(loss,)))
    assert case.loss == loss


@pytest.mark.parametrize("loss", sorted(SEQUENCE_LOSS_FAMILIES))
def test_search_finds_nothing_wrong_with_the_reference(loss: str) -> None:
    result = verify(equiv.accumulator_step, SearchSpace(losses=(loss,)), replay_in_fresh_process=False)
    assert not result.found, result.message()
    assert result.examples > 0

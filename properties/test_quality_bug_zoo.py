"""Quality of the search: equiv.verify FINDS every bug in the zoo, and shrinks
it to a case that says what is wrong.  The blind-spot bugs (exact unless a
setting the search could not draw before is drawn) have their own suite:
test_quality_blind_spots.py; the GradScaler bugs too: test_quality_grad_scaler.py.

Each search runs under the loaded Hypothesis profile (ci: derandomized, so
the same counterexample every run).  Shrunk-case assertions state what the
smallest exposing case must look like, not the exact case.
"""

from collections.abc import Callable

import pytest
from hypothesis import given, note, settings
from search_claims import assert_found_and_shrunk

import equiv
from equiv import strategies as eqst
from equiv.checking.search_space import SearchSpace
from equiv.checking.verify import VerifyResult, verify
from equiv.zoo.bugs import BLIND_SPOT_BUGS, BUGS, GRAD_SCALER_BUGS, ITEM_WEIGHTED_BUGS


def two_pieces(case: equiv.Case) -> bool:
    return len(case.micro_batch_sizes) == 2


#: bug -> what its shrunk counterexample must satisfy (and why).
SHRUNK: dict[str, Callable[[equiv.Case], bool]] = {
    # N times the gradient shows as soon as there are two micro-batches.
    "unscaled_sum": two_pieces,
    # Exact for equal splits: needs two micro-batches of different sizes.
    "mean_of_means": lambda c: two_pieces(c) and len(set(c.micro_batch_sizes)) == 2,
    # Only an active clip norm tells clipping per micro-batch from clipping once.
    "clip_per_micro_batch": lambda c: two_pieces(c) and c.max_grad_norm is not None and c.max_grad_norm <= 1e-2,
    # A leak shows at the second step even with one micro-batch.
    "leaks_gradients": lambda c: c.steps == 2,
    "zero_grad_inside_loop": two_pieces,
    "step_per_micro_batch": two_pieces,
    "drops_last_micro_batch": two_pieces,
    # bfloat16 rounding of every gradient shows on the smallest case.
    "low_precision_buffer": lambda c: c.batch_size <= 2,
    "divides_twice": two_pieces,
    # Needs a scheduler and more than one micro-batch per step; the simplest scheduler of the search does.
    "scheduler_per_micro_batch": lambda c: c.scheduler == "StepLR" and len(c.micro_batch_sizes) >= 2,
    # Sample weights differ from token weights only across micro-batches of a token loss.
    "sample_weighted_token_loss": lambda c: c.loss == "token_cross_entropy" and len(c.micro_batch_sizes) >= 2,
    # Counting padding as items is wrong already for one micro-batch with padding.
    "counts_padding_tokens": lambda c: c.loss == "token_cross_entropy",
}


def search(name: str) -> VerifyResult:
    item_weighted = name in ITEM_WEIGHTED_BUGS
    # Token bugs are exact for sample losses by design: search the token loss only.  No fresh-process
    # replay (a torch import, seconds per search): these bugs keep no state, each test replays its
    # shrunk case in process, and test_quality_blind_spots.py tests the fresh replay on a step that does.
    return verify(
        BUGS[name],
        SearchSpace(losses=eqst.ITEM_WEIGHTED_LOSSES if item_weighted else ()),
        replay_in_fresh_process=False,
    )


def test_the_zoo_holds_at_least_10_kinds_of_bug_each_with_a_shrink_claim() -> None:
    assert len(BUGS) >= 10
    # Every bug has a claim here or, for a blind spot or a GradScaler bug, in its own suite.
    assert set(SHRUNK) == set(BUGS) - BLIND_SPOT_BUGS - GRAD_SCALER_BUGS


@pytest.mark.parametrize("name", sorted(set(BUGS) - BLIND_SPOT_BUGS - GRAD_SCALER_BUGS))
def test_search_finds_and_shrinks_a_counterexample_to(name: str) -> None:
    assert_found_and_shrunk(name, BUGS[name], SHRUNK[name], result=search(name))


def test_search_finds_no_counterexample_for_the_reference() -> None:
    # Not the conv families: their GroupNorm option occasionally exceeds the
    # float64 allowance by rounding alone under a targeted search (see
    # test_reference_accumulator.without_group_norm); the claims there cover conv.
    families = [f for f in (*eqst.MODEL_FAMILIES, *eqst.TOKEN_FAMILIES) if not f.startswith("conv")]
    result = verify(equiv.accumulator_step, SearchSpace(item_weighted=True, families=families))
    assert not result.found, result.message()
    assert result.examples > 0


@given(eqst.cases(allow_batchnorm=True, allow_dropout=True, families=["mlp", "conv1d", "conv2d", "gru", "attention"]))
@settings(max_examples=30)
def test_batchnorm_and_dropout_are_reported_inherently_non_equivalent_with_the_reason(case: equiv.Case) -> None:
    verdict = equiv.check(equiv.accumulator_step, case)
    note(verdict.message())
    kwargs = case.model_kwargs
    has_batchnorm = kwargs.get("norm") == "batch"
    has_dropout = kwargs.get("dropout", 0.0) > 0
    if has_batchnorm or has_dropout:
        assert verdict.status == "inherently_non_equivalent"
        reasons = " ".join(verdict.inherent)
        assert ("BatchNorm" in reasons) == has_batchnorm
        assert ("Dropout" in reasons or "MultiheadAttention" in reasons) == has_dropout
        # Each reason says why no accumulation can match: statistics per micro-batch, masks per pass.
        assert all("statistics" in r or "per forward pass" in r for r in verdict.inherent), reasons
        assert not verdict  # never a pass
    else:
        verdict.assert_ok()

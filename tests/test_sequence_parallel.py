"""Sequence parallelism under engine "tp": the token-level MoE split over its TP ranks by positions,
and the router aux / z-loss scalings that depend on the TP size (Megatron-LM PR #5047, commit cac8d1a)."""

import pytest
from hypothesis import find, settings

import equiv
from equiv.cases.case import Case, InvalidCase
from equiv.checking.distributed import DistributedCase, check_distributed
from equiv.checking.distributed_search import DistributedSearchSpace, distributed_cases, verify_distributed
from equiv.outcomes import Outcome
from equiv.zoo.aux_loss_bugs import (
    AUX_SEARCH_ZOO,
    per_token_router_loss_times_local_tokens,
    per_token_router_loss_times_tp_cp_tokens,
)

TOKEN_MOE = Case(
    batch_size=1,
    micro_batch_sizes=(1,),
    model="token_moe",
    model_kwargs={"z_weight": 0.01},
    loss="token_mse_aux",
    steps=2,
)
MLP = Case(batch_size=1, micro_batch_sizes=(1,), model_kwargs={"hidden": (8,), "activation": "tanh"})
TP_ZOO = {name: entry for name, entry in AUX_SEARCH_ZOO.items() if entry.engine == "tp"}


def test_a_position_wise_model_under_tp_is_split_by_positions_over_the_tp_ranks() -> None:
    dcase = DistributedCase.of(TOKEN_MOE, [[1, 2]], tensor_parallel=2)
    assert (dcase.world_size, dcase.data_ranks, dcase.sequence_slices) == (2, 1, 2)
    assert dcase.rank_slice(0) == (slice(0, 3), slice(0, 2)) and dcase.rank_slice(1) == (slice(0, 3), slice(2, 4))
    assert eval(dcase.source("equiv."), {"equiv": equiv}) == dcase  # the Reproduce line rebuilds it
    # The MLP keeps whole samples on every TP rank: its nn.Linear pairs are what TP shards.
    mlp = DistributedCase.of(MLP, [[1, 2]], tensor_parallel=2)
    assert mlp.sequence_slices == 1 and mlp.rank_slice(1) == slice(0, 3)


def test_sequence_parallelism_refuses_what_it_cannot_split() -> None:
    with pytest.raises(InvalidCase, match="tensor_parallel=2 needs a sequence length divisible"):
        DistributedCase.of(TOKEN_MOE.replace(model_kwargs={"seq_len": 5}), [[1]], tensor_parallel=2)
    with pytest.raises(InvalidCase, match="tensor_parallel=2 splits every sequence's positions"):
        DistributedCase.of(TOKEN_MOE.replace(loss="mse_aux"), [[1]], tensor_parallel=2)
    with pytest.raises(InvalidCase, match="runs sequence-parallel under engine='tp'"):
        check_distributed(
            equiv.accumulator_step, DistributedCase.of(TOKEN_MOE, [[1], [1]], tensor_parallel=2), engine="fsdp2+tp"
        )


def test_the_tp_search_draws_the_moe_as_the_sequence_parallel_token_moe() -> None:
    drawn = find(distributed_cases(models=("moe",), engine="tp"), lambda d: True, settings=settings(database=None))
    assert (drawn.case.model, drawn.case.loss) == ("token_moe", "token_mse_aux")
    assert drawn.tensor_parallel == 2 and drawn.sequence_slices == 2 and drawn.data_ranks == 1
    assert drawn.case.model_kwargs["z_weight"] > 0
    DistributedSearchSpace(engines=("tp",), models=("mlp", "moe"))  # drawable
    with pytest.raises(ValueError, match=r"engine 'fsdp2\+tp' .* models must be a subset of \('mlp',\)"):
        DistributedSearchSpace(engines=("fsdp2+tp",), models=("moe",))
    with pytest.raises(ValueError, match=r"engine 'tp' .* models must be a subset of \('mlp', 'moe'\)"):
        DistributedSearchSpace(engines=("tp",), models=("tokens",))


@pytest.mark.distributed
@pytest.mark.parametrize("name", sorted(TP_ZOO))
def test_each_tp_router_loss_weighting_gets_its_verdict(name: str) -> None:
    """Under a second each (the first about 5 s: the fork server starts): 2 TP slices of [1, 2]."""
    entry = TP_ZOO[name]
    verdict = check_distributed(entry.step, DistributedCase.of(TOKEN_MOE, [[1, 2]], tensor_parallel=2), engine="tp")
    assert verdict.status is entry.expected, verdict.message()
    assert "sequence parallel (2 TP ranks" in verdict.message()


@pytest.mark.distributed
def test_the_per_token_path_short_of_the_tp_tokens_is_found_by_the_search_and_shrunk() -> None:
    """About 3 s: Megatron-LM PR #5047 under TP, found and shrunk to one 1-sample micro-batch; its fix passes."""
    result = verify_distributed(
        per_token_router_loss_times_local_tokens, engines=("tp",), models=("moe",), max_examples=10, seed=0
    )
    assert result.found and result.outcome is Outcome.NOT_EQUIVALENT and result.engine == "tp", result.message()
    dcase = result.counterexample
    assert dcase is not None and dcase.rank_micro_batch_sizes == ((1,),) and dcase.sequence_slices == 2
    assert "tensor_parallel=2), engine='tp')" in result.message()
    fixed = verify_distributed(
        per_token_router_loss_times_tp_cp_tokens, engines=("tp",), models=("moe",), max_examples=5, seed=0
    )
    assert not fixed.found, fixed.message()

"""Orthogonalising optimizers across ranks (issue 46 item 5): torch.optim.Muon drawn on bias-free MLPs where a
run can be judged (DDP), a step that orthogonalises each rank's own gradient flagged, and the engines where no
Muon run can be judged said so (FSDP2: inherent; DeepSpeed ZeRO-1/2: refused) instead of failed."""

import importlib.util

import pytest
from hypothesis import given, settings

from equiv.accumulator import accumulator_step
from equiv.cases.case import Case, InvalidCase
from equiv.checking.distributed import DistributedCase, check_distributed
from equiv.checking.distributed_search import DistributedSearchSpace, verify_distributed
from equiv.outcomes import Outcome
from equiv.zoo.distributed_bugs import global_item_count
from equiv.zoo.orthogonalising_bugs import updates_averaged_over_ranks

_MUON = Case(
    batch_size=1,
    micro_batch_sizes=(1,),
    model_kwargs={"hidden": (8,), "activation": "tanh", "bias": False},
    optimizer="Muon",
    optimizer_kwargs={"lr": 0.02},
    steps=2,
)
_SPLIT = [[1, 2], [1, 3]]


@given(DistributedSearchSpace(optimizers=("SGD", "Muon"), models=("mlp", "tokens")).strategy(clipping=True))
@settings(max_examples=30, deadline=None)
def test_muon_is_drawn_on_bias_free_mlps_only(drawn: tuple[DistributedCase, str]) -> None:
    case = drawn[0].case
    if case.optimizer == "Muon":
        assert case.model == "mlp" and case.model_kwargs["bias"] is False
        case.build_model()  # every parameter a matrix: Muon accepts it
    else:
        assert "bias" not in case.model_kwargs


def test_a_search_space_refuses_muon_where_no_run_can_be_judged() -> None:
    with pytest.raises(ValueError, match=r"cannot hold 'Muon' under engine 'fsdp2': .*bfloat16"):
        DistributedSearchSpace(engines=("ddp", "fsdp2"), optimizers=("SGD", "Muon"))
    with pytest.raises(ValueError, match=r"take 2-D weights only: they need models with 'mlp'"):
        DistributedSearchSpace(models=("tokens",), optimizers=("Muon",))
    with pytest.raises(ValueError, match=r"optimizers must be a non-empty subset of .*got \('Lion',\)"):
        DistributedSearchSpace(optimizers=("Lion",))


@pytest.mark.deepspeed
def test_muon_under_deepspeed_is_refused_in_one_line() -> None:
    with pytest.raises(InvalidCase, match=r"^engine='deepspeed' hands the client optimizer one flat 1-D partition"):
        check_distributed(accumulator_step, DistributedCase.of(_MUON, _SPLIT), engine="deepspeed")


@pytest.mark.distributed
def test_a_correct_muon_step_passes_under_ddp_and_averaged_orthogonal_updates_fail() -> None:
    dcase = DistributedCase.of(_MUON, _SPLIT)
    # Muon's own bfloat16 Newton-Schulz rounding is in the truth and in every rank alike: a correct step passes.
    correct = check_distributed(global_item_count, dcase)
    assert correct, correct.message()
    # Each rank orthogonalises its own partial gradient: O(1) off, on every rank, in the update.
    averaged = check_distributed(updates_averaged_over_ranks, dcase)
    assert averaged.outcome == Outcome.NOT_EQUIVALENT
    assert all(any(d.quantity == "update" and d.step == 1 for d in rank.mismatches) for rank in averaged.ranks)
    # The same step under SGD (linear in the gradient) is exact: the class is the orthogonalisation's.
    sgd = DistributedCase.of(_MUON.replace(optimizer="SGD", optimizer_kwargs={"lr": 0.05}), _SPLIT)
    assert check_distributed(updates_averaged_over_ranks, sgd)


@pytest.mark.distributed
def test_muon_under_fsdp2_is_inherent_not_the_steps_failure() -> None:
    verdict = check_distributed(accumulator_step, DistributedCase.of(_MUON, _SPLIT), engine="fsdp2")
    assert verdict.outcome == Outcome.INHERENTLY_NON_EQUIVALENT
    assert all("DTensor" in reason for rank in verdict.ranks for reason in rank.inherent)


@pytest.mark.distributed
def test_the_distributed_search_draws_muon_and_finds_averaged_orthogonal_updates() -> None:
    result = verify_distributed(
        updates_averaged_over_ranks, models=("mlp",), optimizers=("Muon",), max_examples=4, seed=0
    )
    assert result.counterexample is not None and result.verdict is not None
    assert result.counterexample.case.optimizer == "Muon"
    assert result.verdict.outcome == Outcome.NOT_EQUIVALENT


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is not None, reason="needs DeepSpeed absent")
def test_muon_under_deepspeed_without_deepspeed_says_deepspeed_is_missing() -> None:
    with pytest.raises(InvalidCase, match=r"needs DeepSpeed"):
        check_distributed(accumulator_step, DistributedCase.of(_MUON, _SPLIT), engine="deepspeed")

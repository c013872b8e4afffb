"""Orthogonalising optimizers across ranks (issue 46 item 5): torch.optim.Muon drawn on bias-free MLPs under DDP,
FSDP2 and tensor parallelism (whose DTensor matrix it orthogonalises whole; in float64 runs its bfloat16
Newton-Schulz is lifted to float64, in the truth and every rank alike), a step that orthogonalises each rank's own
gradient flagged, and under DeepSpeed ZeRO-1/2 torch's Muon refused, pointing at DeepSpeed's own Muon (the case's
optimizer "DeepSpeedMuon", judged against its single-process step)."""

import importlib.util

import pytest
from hypothesis import given, settings

from equiv.accumulator import accumulator_step
from equiv.cases.case import Case, InvalidCase
from equiv.checking.distributed import DistributedCase, check_distributed, matrix_optimizer_refusal
from equiv.checking.distributed_search import DistributedSearchSpace, standard_distributed_cases, verify_distributed
from equiv.outcomes import Outcome
from equiv.zoo.deepspeed_bugs import deepspeed_global_item_count, deepspeed_local_token_mean
from equiv.zoo.distributed_bugs import global_item_count, local_mean_per_rank_fsdp2
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
    with pytest.raises(ValueError, match=r"cannot hold 'Muon' under engine 'deepspeed': .*flat 1-D partition"):
        DistributedSearchSpace(engines=("ddp", "deepspeed"), optimizers=("SGD", "Muon"))
    with pytest.raises(ValueError, match=r"cannot hold 'DeepSpeedMuon' under engine 'fsdp2': .*DTensor shards"):
        DistributedSearchSpace(engines=("fsdp2",), optimizers=("DeepSpeedMuon",))
    DistributedSearchSpace(engines=("ddp", "fsdp2"), optimizers=("SGD", "Muon"))  # FSDP2 hands Muon DTensor matrices
    with pytest.raises(ValueError, match=r"take 2-D weights only: they need models with 'mlp'"):
        DistributedSearchSpace(models=("tokens",), optimizers=("Muon",))
    with pytest.raises(ValueError, match=r"optimizers must be a non-empty subset of .*got \('Lion',\)"):
        DistributedSearchSpace(optimizers=("Lion",))


@pytest.mark.deepspeed
def test_muon_under_deepspeed_is_refused_in_one_line() -> None:
    with pytest.raises(InvalidCase, match=r"^engine='deepspeed' hands the client .* optimizer='DeepSpeedMuon'$"):
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


def test_muons_newton_schulz_runs_in_float64_in_a_float64_run_and_in_bfloat16_otherwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The float64 tier judges the mathematics: Muon's own bfloat16 iteration is lifted there (in the truth and the
    # candidate alike), and left as torch ships it in the working dtype, whose tier it costs precision in.
    import torch
    import torch.optim._muon as torch_muon

    from equiv.judging.runs import run_candidate, run_reference

    orthogonalise, dtypes = torch_muon._zeropower_via_newtonschulz, []

    def recorded(*args: object, **kwargs: object) -> torch.Tensor:
        update = orthogonalise(*args, **kwargs)
        dtypes.append(update.dtype)
        return update

    monkeypatch.setattr(torch_muon, "_zeropower_via_newtonschulz", recorded)
    run_reference(_MUON, torch.float64)
    run_candidate(_MUON, accumulator_step, torch.float64)
    assert dtypes and set(dtypes) == {torch.float64}
    dtypes.clear()
    run_candidate(_MUON, accumulator_step, torch.float32)
    assert dtypes and set(dtypes) == {torch.bfloat16}


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("engine", "dcase"),
    [
        ("fsdp2", DistributedCase.of(_MUON, _SPLIT)),
        ("tp", DistributedCase.of(_MUON, [[1, 2, 3]], tensor_parallel=2)),
    ],
)
def test_a_correct_muon_step_passes_on_dtensor_matrices(engine: str, dcase: DistributedCase) -> None:
    # Measured before the float64 lift: Muon's bfloat16 sums of the shards' partial products put a correct FSDP2
    # step ~3e-2 off the single process (1.9e11 x the exact allowance), a verdict no step could pass.
    verdict = check_distributed(accumulator_step, dcase, engine=engine)
    assert verdict, verdict.message()


@pytest.mark.distributed
def test_a_per_rank_mean_under_fsdp2_is_flagged_with_muon() -> None:
    verdict = check_distributed(local_mean_per_rank_fsdp2, DistributedCase.of(_MUON, _SPLIT), engine="fsdp2")
    assert verdict.outcome == Outcome.NOT_EQUIVALENT
    assert all(any(d.step == 1 and d.tier == "exact" for d in rank.mismatches) for rank in verdict.ranks)


@pytest.mark.distributed
def test_the_distributed_search_draws_muon_and_finds_averaged_orthogonal_updates() -> None:
    result = verify_distributed(
        updates_averaged_over_ranks, models=("mlp",), optimizers=("Muon",), max_examples=4, seed=0
    )
    assert result.counterexample is not None and result.verdict is not None
    assert result.counterexample.case.optimizer == "Muon"
    assert result.verdict.outcome == Outcome.NOT_EQUIVALENT


@pytest.mark.distributed
def test_the_distributed_search_draws_muon_under_fsdp2_and_finds_a_per_rank_mean() -> None:
    result = verify_distributed(
        local_mean_per_rank_fsdp2, engines=("fsdp2",), models=("mlp",), optimizers=("Muon",), max_examples=4, seed=0
    )
    assert result.counterexample is not None and result.verdict is not None
    assert result.counterexample.case.optimizer == "Muon"
    assert result.verdict.outcome == Outcome.NOT_EQUIVALENT


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is not None, reason="needs DeepSpeed absent")
def test_muon_under_deepspeed_without_deepspeed_says_deepspeed_is_missing() -> None:
    with pytest.raises(InvalidCase, match=r"needs DeepSpeed"):
        check_distributed(accumulator_step, DistributedCase.of(_MUON, _SPLIT), engine="deepspeed")


def test_deepspeeds_muon_runs_where_deepspeed_or_whole_weights_run_it_and_torch_muon_points_there() -> None:
    assert matrix_optimizer_refusal("ddp", "DeepSpeedMuon") is None
    assert matrix_optimizer_refusal("deepspeed-zero1", "DeepSpeedMuon") is None
    refused = matrix_optimizer_refusal("fsdp2", "DeepSpeedMuon")
    assert refused is not None and "DTensor shards" in refused
    torch_muon = matrix_optimizer_refusal("deepspeed", "Muon")
    assert torch_muon is not None and "optimizer='DeepSpeedMuon'" in torch_muon
    assert matrix_optimizer_refusal("fsdp2", "Muon") is None and matrix_optimizer_refusal("tp", "Muon") is None
    # The standard splits hold torch's Muon under DDP and FSDP2.
    for engine in ("ddp", "fsdp2"):
        assert standard_distributed_cases(2, engine)["bias-free MLP, Muon"].case.optimizer == "Muon"


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is not None, reason="needs DeepSpeed absent")
def test_deepspeeds_muon_without_deepspeed_is_refused_when_the_case_is_made() -> None:
    with pytest.raises(
        InvalidCase, match=r"^optimizer 'DeepSpeedMuon' needs deepspeed: pip install 'equiv\[deepspeed\]'$"
    ):
        _MUON.replace(optimizer="DeepSpeedMuon")


@pytest.mark.distributed
@pytest.mark.deepspeed
@pytest.mark.parametrize(("engine", "world_size"), [("deepspeed", 2), ("deepspeed-zero1", 3)])
def test_deepspeeds_own_muon_under_zero_matches_its_single_process_step(engine: str, world_size: int) -> None:
    # DeepSpeed #7807: Muon under ZeRO-1/2 orthogonalising partially reduced gradients.  Judged against
    # DeepSpeed's Muon on whole weights in one process, parameters and momentum, uneven micro-batches.
    dcase = DistributedCase.of(_MUON.replace(optimizer="DeepSpeedMuon"), [[1, r + 2] for r in range(world_size)])
    assert standard_distributed_cases(world_size, engine)["bias-free MLP, Muon"].case.optimizer == "DeepSpeedMuon"
    correct = check_distributed(deepspeed_global_item_count, dcase, engine=engine)
    assert correct, correct.message()
    per_rank = check_distributed(deepspeed_local_token_mean, dcase, engine=engine)
    assert per_rank.outcome == Outcome.NOT_EQUIVALENT
    # ZeRO's Muon overwrites the gradient with its update in place: no witness is read, none is made up.
    assert all(rank.witness is None for rank in per_rank.ranks)


@pytest.mark.distributed
@pytest.mark.deepspeed
def test_deepspeeds_muon_on_rank_local_gradients_is_flagged_under_ddp() -> None:
    # The control for the ZeRO test above: DeepSpeed's Muon fed each rank's own partial gradient (#7807's
    # class of bug) is O(1) off, while the same optimizer on the averaged gradient passes.
    dcase = DistributedCase.of(_MUON.replace(optimizer="DeepSpeedMuon"), _SPLIT)
    assert check_distributed(global_item_count, dcase)
    averaged = check_distributed(updates_averaged_over_ranks, dcase)
    assert averaged.outcome == Outcome.NOT_EQUIVALENT


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.deepspeed
def test_the_search_draws_deepspeeds_muon_under_its_engine_and_shrinks_a_per_rank_token_mean() -> None:
    found = verify_distributed(
        deepspeed_local_token_mean,
        engines=("deepspeed",),
        models=("mlp",),
        optimizers=("DeepSpeedMuon",),
        max_examples=4,
        seed=0,
    )
    assert found.counterexample is not None and found.verdict is not None
    assert found.counterexample.case.optimizer == "DeepSpeedMuon"
    assert found.verdict.outcome == Outcome.NOT_EQUIVALENT

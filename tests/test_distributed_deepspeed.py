"""check_distributed under DeepSpeed's own accumulation (issue 46 item 4): engine="deepspeed" (ZeRO-2) and
"deepspeed-zero1" wrap each rank's model and the case's optimizer with deepspeed.initialize; the step calls
engine.backward and engine.step as DeepSpeed users do.  Skipped cleanly without DeepSpeed."""

import importlib.util

import pytest

from equiv.cases.case import Case, InvalidCase
from equiv.checking.distributed import DistributedCase, check_distributed
from equiv.checking.distributed_search import standard_distributed_cases
from equiv.zoo.deepspeed_bugs import deepspeed_global_item_count, deepspeed_local_token_mean, deepspeed_mean_of_means

_TOKENS = Case(batch_size=1, micro_batch_sizes=(1,), model="token_mlp", loss="token_cross_entropy", steps=2)
_MLP = Case(batch_size=1, micro_batch_sizes=(1,), model_kwargs={"hidden": (8,), "activation": "tanh"}, steps=2)


def _split(world_size: int) -> list[list[int]]:
    return [[1, rank + 2] for rank in range(world_size)]  # ranks differ in samples, micro-batches in size


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is not None, reason="needs DeepSpeed absent")
def test_a_deepspeed_engine_without_deepspeed_is_refused_in_one_line() -> None:
    with pytest.raises(InvalidCase, match=r"^engine='deepspeed' needs DeepSpeed: pip install 'equiv\[deepspeed\]'$"):
        check_distributed(deepspeed_global_item_count, DistributedCase.of(_MLP, _split(2)), engine="deepspeed")


@pytest.mark.deepspeed
def test_deepspeed_needs_one_micro_batch_count_on_every_rank() -> None:
    with pytest.raises(InvalidCase, match="gradient_accumulation_steps is one number for every rank"):
        check_distributed(deepspeed_global_item_count, DistributedCase.of(_MLP, [[1], [1, 2]]), engine="deepspeed")
    # The standard splits leave out the one with uneven micro-batch counts under it.
    assert "uneven micro-batch counts, Adam" not in standard_distributed_cases(2, "deepspeed")


@pytest.mark.distributed
@pytest.mark.deepspeed
@pytest.mark.parametrize(("engine", "world_size"), [("deepspeed", 2), ("deepspeed-zero1", 3)])
def test_a_correct_deepspeed_step_passes_at_zero_1_and_2(engine: str, world_size: int) -> None:
    # Adam: its state (ZeRO's flat partitions, gathered and cut back into parameters) is compared too.
    case = _TOKENS.replace(optimizer="Adam", optimizer_kwargs={"lr": 0.05})
    verdict = check_distributed(
        deepspeed_global_item_count, DistributedCase.of(case, _split(world_size)), engine=engine
    )
    # Passing includes the state: a state tensor missing from a snapshot would be an infinite mismatch.
    assert verdict, verdict.message()


@pytest.mark.distributed
@pytest.mark.deepspeed
@pytest.mark.parametrize(
    ("step", "case", "engine", "normaliser"),
    [
        (deepspeed_local_token_mean, _TOKENS, "deepspeed", "per-rank mean"),
        (deepspeed_mean_of_means, _MLP, "deepspeed-zero1", "mean of means"),
    ],
)
def test_a_per_rank_mean_and_a_mean_of_means_fail_under_deepspeed(
    step: object, case: Case, engine: str, normaliser: str
) -> None:
    verdict = check_distributed(step, DistributedCase.of(case, _split(2)), engine=engine)  # type: ignore[arg-type]
    assert not verdict
    # the witness read from the gradient partitions ZeRO stepped, gathered and cut back by DeepSpeed's layout
    assert [rank.witness.normaliser if rank.witness else None for rank in verdict.ranks] == [normaliser] * 2
    assert all(not rank for rank in verdict.ranks)
    assert all(d.quantity == "update" for rank in verdict.ranks for d in rank.mismatches if d.step == 1)
    assert "DeepSpeed ZeRO-" in verdict.message()


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.deepspeed
def test_the_distributed_search_draws_under_deepspeed_and_shrinks_a_per_rank_token_mean() -> None:
    from equiv.checking.distributed_search import verify_distributed

    found = verify_distributed(
        deepspeed_local_token_mean, engines=("deepspeed",), models=("tokens",), max_examples=6, seed=0
    )
    assert found.outcome == "not_equivalent", found
    # shrunk to the smallest split that still shows it: one micro-batch of one sequence on each of 2 ranks
    assert found.to_dict()["counterexample"]["rank_micro_batch_sizes"] == [[1], [1]]


@pytest.mark.distributed
@pytest.mark.deepspeed
def test_deepspeeds_own_collectives_are_counted_as_the_engines_and_none_as_the_steps() -> None:
    counted: dict[tuple[str, int], int] = {}
    for engine in ("deepspeed", "deepspeed-zero1"):
        for micro_batches in (1, 3):
            dcase = DistributedCase.of(_MLP.replace(steps=1), [[1] * micro_batches] * 2)
            verdict = check_distributed(deepspeed_global_item_count, dcase, tiers=("exact",), engine=engine)
            assert verdict, verdict.message()
            counted[engine, micro_batches] = max(verdict.collectives_per_step())
            # The step's own: its item count all-reduced once a window; none of DeepSpeed's reductions.
            assert verdict.step_collectives_per_step() == [{"all_reduce": 1}]
            assert "collectives of engine.backward and engine.step" in verdict.message()
    # ZeRO-2 reduces the gradients at every engine.backward, ZeRO-1 once a window (at its boundary).
    assert counted["deepspeed", 3] - counted["deepspeed", 1] == 2
    assert counted["deepspeed-zero1", 3] == counted["deepspeed-zero1", 1]


@pytest.mark.distributed
@pytest.mark.deepspeed
def test_a_client_sgds_momentum_under_zero_is_read_from_its_flat_partition() -> None:
    # ZeRO keys a torch SGD's momentum_buffer by the flat partition (DeepSpeed's Muon keeps whole matrices).
    case = _MLP.replace(optimizer="SGD", optimizer_kwargs={"lr": 0.05, "momentum": 0.9})
    verdict = check_distributed(deepspeed_global_item_count, DistributedCase.of(case, _split(2)), engine="deepspeed")
    assert verdict, verdict.message()

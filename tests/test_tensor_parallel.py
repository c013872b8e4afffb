"""Clipping under tensor parallelism: parallelize_module (ColwiseParallel /
RowwiseParallel) on a 1-D TP mesh, and FSDP2 over TP on a 2-D mesh, gloo ranks
on the CPU.  The window's gradient norm must cover every shard of every
parameter, replicated ones once, once per window."""

import pytest
from torch import nn

import equiv
from equiv.checking.distributed import DistributedCase, check_distributed
from equiv.checking.distributed_search import verify_distributed
from equiv.distributed.tensor_parallel import tensor_parallel_plan
from equiv.outcomes import Outcome
from equiv.zoo.tensor_parallel_bugs import TP_ZOO, clip_tp_shard_with_local_norm

MLP = {"hidden": (8,), "activation": "tanh"}  # two Linear layers: one column-wise / row-wise pair
#: An active clip norm for this MLP's gradients: every clipping mistake shows.
CLIPPED = equiv.Case(batch_size=1, micro_batch_sizes=(1,), model_kwargs=MLP, steps=2, max_grad_norm=1e-2)
#: engine -> a split: under "tp" one data rank for both TP ranks; under "fsdp2+tp"
#: two data ranks with equal shards (the zoo weights micro-batches by its own samples).
SPLITS = {"tp": [[1, 2]], "fsdp2+tp": [[1, 2], [2, 1]]}


@pytest.mark.distributed
@pytest.mark.parametrize("engine", sorted(SPLITS))
@pytest.mark.parametrize("name", sorted(TP_ZOO))
def test_tp_zoo_step_comes_to_what_it_must(engine: str, name: str) -> None:
    entry = TP_ZOO[name]
    verdict = check_distributed(
        entry.step, DistributedCase.of(CLIPPED, SPLITS[engine], tensor_parallel=2), engine=engine
    )
    assert verdict.status is entry.expected, verdict.message()
    assert verdict.engine == engine and verdict.case.world_size == 2 * len(SPLITS[engine])


@pytest.mark.distributed
def test_accumulator_clips_exactly_under_fsdp2_tp_with_uneven_data_shards() -> None:
    # The item count is summed over the data ranks only (the TP ranks of one data rank see the same items).
    dcase = DistributedCase.of(
        CLIPPED.replace(optimizer="Adam", optimizer_kwargs={"lr": 1e-2}), [[1, 3], [2, 1]], tensor_parallel=2
    )
    verdict = check_distributed(equiv.accumulator_step, dcase, engine="fsdp2+tp")
    verdict.assert_ok()
    assert "FSDP2 over tensor parallel (2 x 2 mesh)" in verdict.message()
    assert verdict.reduce_scatters_per_step() == {verdict.fsdp_units}  # one sync per window


@pytest.mark.distributed
def test_search_finds_the_local_shard_norm_under_tp() -> None:
    result = verify_distributed(
        clip_tp_shard_with_local_norm, engines=("tp",), models=("mlp",), max_examples=10, seed=0
    )
    assert result.found and result.outcome is Outcome.NOT_EQUIVALENT, result.message()
    assert result.counterexample is not None and result.counterexample.tensor_parallel == 2
    assert result.counterexample.case.max_grad_norm is not None  # clipping is what it gets wrong
    assert "tensor_parallel=2" in result.message()


def test_tensor_parallel_split_must_fit_the_engine() -> None:
    with pytest.raises(equiv.InvalidCase, match="engine='tp' runs one data rank"):
        check_distributed(
            equiv.accumulator_step, DistributedCase.of(CLIPPED, [[1], [1]], tensor_parallel=2), engine="tp"
        )
    with pytest.raises(equiv.InvalidCase, match=r"needs DistributedCase\.of"):
        check_distributed(equiv.accumulator_step, DistributedCase.of(CLIPPED, [[1]]), engine="tp")
    with pytest.raises(equiv.InvalidCase, match=r"tensor_parallel=2 needs engine 'tp' or 'fsdp2\+tp'"):
        check_distributed(equiv.accumulator_step, DistributedCase.of(CLIPPED, [[1], [1]], tensor_parallel=2))
    with pytest.raises(equiv.InvalidCase, match="needs at least 2 data ranks"):
        check_distributed(
            equiv.accumulator_step, DistributedCase.of(CLIPPED, [[1]], tensor_parallel=2), engine="fsdp2+tp"
        )
    with pytest.raises(equiv.InvalidCase, match="tensor_parallel must be a positive int"):
        DistributedCase.of(CLIPPED, [[1]], tensor_parallel=0)
    with pytest.raises(ValueError, match="models must be a subset of"):
        verify_distributed(clip_tp_shard_with_local_norm, engines=("tp",), models=("tokens",))


def test_plan_pairs_linear_layers_and_names_what_it_cannot_shard() -> None:
    plan = tensor_parallel_plan(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)))
    assert [type(style).__name__ for style in plan.values()] == ["ColwiseParallel", "RowwiseParallel"]
    with pytest.raises(ValueError, match=r"nn\.Linear layers only"):
        tensor_parallel_plan(nn.Sequential(nn.Embedding(5, 4), nn.Linear(4, 4)))
    with pytest.raises(ValueError, match="model has 3"):
        tensor_parallel_plan(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Linear(8, 2)))
    with pytest.raises(ValueError, match="only element-wise layers"):
        tensor_parallel_plan(nn.Sequential(nn.Linear(4, 8), nn.Softmax(-1), nn.Linear(8, 3)))


def test_distributed_case_with_tensor_parallel_round_trips_its_repr() -> None:
    dcase = DistributedCase.of(CLIPPED, [[1, 2], [3]], tensor_parallel=2)
    assert dcase.world_size == 4 and dcase.data_rank(3) == 1 and dcase.rank_micro_batches(2) == (3,)
    assert dcase.rank_slice(1) == slice(0, 3) and dcase.rank_slice(2) == slice(3, 6)
    assert eval(repr(dcase), {"DistributedCase": DistributedCase, "Case": equiv.Case}) == dcase
    assert dcase.to_dict()["tensor_parallel"] == 2


@pytest.mark.distributed
def test_reference_accumulator_passes_drawn_splits_under_both_tp_engines() -> None:
    # Drawn: data ranks with their own micro-batch sizes (uneven under FSDP2 + TP), SGD or Adam, clipped or not.
    result = verify_distributed(
        equiv.accumulator_step, engines=("tp", "fsdp2+tp"), models=("mlp",), max_examples=6, seed=0
    )
    assert not result.found, result.message()
    assert result.examples == 6

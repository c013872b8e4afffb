"""The witness of ``check_distributed`` under every step engine (issue 44): FSDP2, tensor, context and sequence
parallelism and their compositions, as under DDP (tests/test_witness_check.py).

Each buggy step below applies its own divisor; the weights it gave each micro-batch's loss SUM are counted here
from the case's own batch (each rank's part of it, as :meth:`DistributedCase.rank_slice` cuts it), never typed in.
The verdict's recovered weights must equal them within 1 % and name the normaliser, the failure kind the same name.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import jsonschema
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

import equiv
import equiv.checking.distributed as distributed_module
from equiv.cases.distributed import DistributedCase
from equiv.checking.distributed import check_distributed
from equiv.distributed.context_parallel import layout
from equiv.losses import item_count, loss_sum_and_count
from equiv.results.protocol import schema
from equiv.zoo.context_parallel_bugs import cp_global_token_count
from equiv.zoo.distributed_bugs import FSDP2_BUGS, local_token_mean_per_rank

TOKENS = equiv.Case(
    batch_size=1,
    micro_batch_sizes=(1,),
    steps=2,
    model="token_mlp",
    loss="token_cross_entropy",
    optimizer="SGD",
    optimizer_kwargs={"lr": 0.1},
)
SAMPLES = equiv.Case(batch_size=6, micro_batch_sizes=(6,), steps=2)


def _sync(model: nn.Module, last: bool) -> contextlib.AbstractContextManager[None]:
    """The gradient sync on the last micro-batch only, as the engine offers it (FSDP2's flag, DDP's no_sync)."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(last)
    elif isinstance(model, DistributedDataParallel) and not last:
        return model.no_sync()
    return contextlib.nullcontext()


def per_rank_token_mean(model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: Any, loss_fn: Any) -> None:
    """Each rank's summed loss over its OWN items (its slice's under split sequences), the engine averaging the
    ranks: transformers #34242's per-device token mean under any engine."""
    optimizer.zero_grad(set_to_none=True)
    items = max(float(sum(int(item_count(loss_fn, targets)) for _, targets in micro_batches)), 1.0)
    for index, (inputs, targets) in enumerate(micro_batches):
        with _sync(model, index == len(micro_batches) - 1):
            loss_sum, _ = loss_sum_and_count(loss_fn, model(inputs), targets)
            (loss_sum / items).backward()
    optimizer.step()


def per_data_rank_token_mean(
    model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: Any, loss_fn: Any
) -> None:
    """Under context parallelism: the items counted over the rank's context-parallel group only (its data rank's
    sequences, every slice), never over the data ranks; times C, which DDP's average over data x context leaves."""
    optimizer.zero_grad(set_to_none=True)
    items = torch.tensor(float(sum(int(item_count(loss_fn, targets)) for _, targets in micro_batches)))
    dist.all_reduce(items, group=layout().context_parallel_group)
    for index, (inputs, targets) in enumerate(micro_batches):
        with _sync(model, index == len(micro_batches) - 1):
            loss_sum, _ = loss_sum_and_count(loss_fn, model(inputs), targets)
            (loss_sum * (layout().size / float(items))).backward()
    optimizer.step()


def mean_of_means(model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: Any, loss_fn: Any) -> None:
    """Each micro-batch's mean over its items divided by the rank's micro-batches (transformers #34191)."""
    optimizer.zero_grad(set_to_none=True)
    for index, (inputs, targets) in enumerate(micro_batches):
        with _sync(model, index == len(micro_batches) - 1):
            (loss_fn(model(inputs), targets) / len(micro_batches)).backward()
    optimizer.step()


#: (owner, items) of one unit the witness weighs: a data rank's micro-batch, or a rank's slice of one.
Unit = tuple[int, float]


def _units(dcase: DistributedCase, step: int, *, by_slice: bool) -> list[list[Unit]]:
    """Each owner's units at ``step``, counted from the case's batch: by slice, every rank its part of each of its
    micro-batches; else every data rank its micro-batches (every slice of them: its group's parts added up)."""
    case = dcase.case
    loss_fn = case.build_loss()
    _, targets = case.batches(case.build_model())[step]
    owners: dict[int, list[list[float]]] = {}
    for rank in range(dcase.world_size):
        pieces = targets[dcase.rank_slice(rank)].split(list(dcase.rank_micro_batches(rank)))
        counts = [float(loss_fn.count(piece)) for piece in pieces]
        owners.setdefault(rank if by_slice else dcase.data_rank(rank), []).append(counts)
    group = 1 if by_slice else dcase.tensor_parallel  # a TP group's ranks see the same items: counted once
    return [[(owner, sum(column) / group) for column in zip(*parts, strict=True)] for owner, parts in owners.items()]


def _per_rank_mean(owners: list[list[Unit]]) -> tuple[list[float], list[int]]:
    """1/(R N_r) for each unit with an item, N_r its owner's items, R the owners; and each unit's owner."""
    weights, ranks = [], []
    for units in owners:
        total = sum(count for _, count in units)
        for owner, count in units:
            if count > 0:
                weights.append(1.0 / (len(owners) * total))
                ranks.append(owner)
    return weights, ranks


def _mean_of_means(owners: list[list[Unit]]) -> tuple[list[float], list[int]]:
    """1/(R k_r n_i): each micro-batch's mean over its owner's k_r micro-batches, the R owners averaged."""
    weights = [1.0 / (len(owners) * len(units) * count) for units in owners for _, count in units]
    return weights, [owner for units in owners for owner, _ in units]


def _first_failing_step(verdict: Any) -> int:
    return min(d.step for v in verdict.ranks for d in v.mismatches if d.tier == "exact") - 1  # rows are 1-based


def _assert_witness(verdict: Any, applied: list[float], ranks: list[int], normaliser: str) -> None:
    assert not verdict, verdict.message()
    for rank in verdict.ranks:
        if rank:
            continue
        assert rank.witness is not None and rank.witness.run is not None, verdict.message()
        assert rank.witness.run == pytest.approx(applied, rel=0.01)
        assert rank.witness.ranks == tuple(ranks)
        assert rank.witness.normaliser == normaliser
        assert rank.failure_kind is not None and rank.failure_kind.name == normaliser  # one name
        assert rank.to_dict()["weights"]["normaliser"] == normaliser
    first = next(rank for rank in verdict.ranks if not rank)
    assert first.witness.clause() in verdict.line()
    assert f"Kind of failure: {normaliser}" in verdict.message()
    jsonschema.validate(verdict.to_dict(), schema())


#: (engine, split, tensor_parallel, context_parallel): the per-rank token mean's splits; every rank holds tokens.
PER_RANK_SPLITS = [
    ("fsdp2", ((1, 1), (2, 1)), 1, 1),
    ("fsdp2", ((1, 1), (2, 1), (1, 1)), 1, 1),
    ("tp", ((1, 2),), 2, 1),  # token_mlp is position-wise: sequence parallel, each TP rank a slice
    ("cp", ((1, 2),), 1, 2),
    ("cp", ((1, 2),), 1, 3),
    ("fsdp2+cp", ((1, 2),), 1, 2),
]


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("engine", "split", "tensor_parallel", "context_parallel"),
    PER_RANK_SPLITS,
    ids=[f"{e}, {len(s) * t * c} ranks" for e, s, t, c in PER_RANK_SPLITS],
)
def test_a_per_rank_token_mean_is_named_under_every_engine(
    engine: str, split: tuple[tuple[int, ...], ...], tensor_parallel: int, context_parallel: int
) -> None:
    dcase = DistributedCase.of(TOKENS, split, tensor_parallel=tensor_parallel, context_parallel=context_parallel)
    verdict = check_distributed(per_rank_token_mean, dcase, engine=engine)
    by_slice = dcase.sequence_slices > 1  # each rank divided its own slice's tokens: the ranks of the grid
    applied, ranks = _per_rank_mean(_units(dcase, _first_failing_step(verdict), by_slice=by_slice))
    _assert_witness(verdict, applied, ranks, "per-rank mean")


@pytest.mark.distributed
def test_the_zoos_per_rank_token_mean_is_named_under_sequence_parallelism() -> None:
    """The zoo's DDP step under engine='tp' on a position-wise model (DDP over the TP ranks, each a slice)."""
    dcase = DistributedCase.of(TOKENS, ((1, 2),), tensor_parallel=2)
    verdict = check_distributed(local_token_mean_per_rank, dcase, engine="tp")
    applied, ranks = _per_rank_mean(_units(dcase, _first_failing_step(verdict), by_slice=True))
    _assert_witness(verdict, applied, ranks, "per-rank mean")


@pytest.mark.distributed
def test_a_per_rank_token_mean_is_named_under_fsdp2_over_tensor_parallel() -> None:
    """Four ranks, 2 data x 2 TP (about 12 s on 2 cores): the shards are 2-D DTensors' local tensors."""
    dcase = DistributedCase.of(SAMPLES, ((1, 2), (3, 1)), tensor_parallel=2)
    verdict = check_distributed(per_rank_token_mean, dcase, engine="fsdp2+tp")
    applied, ranks = _per_rank_mean(_units(dcase, _first_failing_step(verdict), by_slice=False))
    _assert_witness(verdict, applied, ranks, "per-rank mean")


@pytest.mark.distributed
def test_a_per_data_rank_mean_under_context_parallelism_is_named_in_micro_batches() -> None:
    """Every slice of a micro-batch got one weight: the slices are added up, the ranks are the data ranks."""
    dcase = DistributedCase.of(TOKENS, ((1, 2), (2, 1)), context_parallel=2)
    verdict = check_distributed(per_data_rank_token_mean, dcase, engine="cp")
    applied, ranks = _per_rank_mean(_units(dcase, _first_failing_step(verdict), by_slice=False))
    _assert_witness(verdict, applied, ranks, "per-rank mean")
    assert set(ranks) == {0, 1}


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("engine", "dcase"),
    [
        ("fsdp2", DistributedCase.of(TOKENS, ((1, 2), (3, 1)))),
        ("tp", DistributedCase.of(SAMPLES, ((1, 2, 3),), tensor_parallel=2)),  # the nn.Linear plan: shards
    ],
    ids=["fsdp2", "tp"],
)
def test_a_mean_of_micro_batch_means_is_named_on_sharded_gradients(engine: str, dcase: DistributedCase) -> None:
    verdict = check_distributed(mean_of_means, dcase, engine=engine)
    applied, ranks = _mean_of_means(_units(dcase, _first_failing_step(verdict), by_slice=False))
    _assert_witness(verdict, applied, ranks, "mean of means")


CORRECT = [
    ("fsdp2", equiv.accumulator_step, DistributedCase.of(TOKENS, ((1, 1), (2, 1)))),
    ("tp", equiv.accumulator_step, DistributedCase.of(SAMPLES, ((1, 2, 3),), tensor_parallel=2)),
    ("cp", cp_global_token_count, DistributedCase.of(TOKENS, ((1, 2),), context_parallel=2)),
    ("fsdp2+cp", equiv.accumulator_step, DistributedCase.of(TOKENS, ((1, 2),), context_parallel=2)),
]


@pytest.mark.distributed
@pytest.mark.parametrize(("engine", "step", "dcase"), CORRECT, ids=[engine for engine, _, _ in CORRECT])
def test_a_correct_step_carries_no_witness_and_reads_none(
    engine: str, step: Callable[..., None], dcase: DistributedCase, monkeypatch: pytest.MonkeyPatch
) -> None:
    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("a passing verdict read a witness")

    monkeypatch.setattr(distributed_module, "rank_witnesses", never)
    verdict = check_distributed(step, dcase, engine=engine)
    assert verdict, verdict.message()
    assert all(rank.witness is None and rank.failure_kind is None for rank in verdict.ranks)
    assert all("weights" not in rank.to_dict() for rank in verdict.ranks)
    assert "weights" not in verdict.line() and "Kind of failure" not in verdict.message()


@pytest.mark.distributed
def test_a_search_defers_the_witness_under_fsdp2(monkeypatch: pytest.MonkeyPatch) -> None:
    """witness_deferred() still keeps the ranks from being launched again, sharded engines included."""
    from equiv.checking.distributed_witness import witness_deferred

    launches: list[str] = []
    original = distributed_module.rank_witnesses

    def counted(*args: Any, **kwargs: Any) -> Any:
        launches.append("witness")
        return original(*args, **kwargs)

    monkeypatch.setattr(distributed_module, "rank_witnesses", counted)
    with witness_deferred():
        verdict = check_distributed(per_rank_token_mean, DistributedCase.of(TOKENS, ((1, 1), (2, 1))), engine="fsdp2")
    assert not verdict and launches == []
    assert all(rank.witness is None for rank in verdict.ranks)


@pytest.mark.distributed
def test_a_policys_precision_finding_under_fsdp2_reads_no_witness(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 16-bit reduction that the rerun without the policy explains is precision, not a weighting: no witness (its
    float64 rerun would weigh every item alike and call the kind unclassified)."""
    entry = FSDP2_BUGS["bfloat16_reduce"]

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("a precision outcome read a witness")

    monkeypatch.setattr(distributed_module, "rank_witnesses", never)
    case = SAMPLES.replace(model_kwargs={"hidden": (8,), "activation": "tanh"}, max_grad_norm=0.05)
    verdict = check_distributed(
        entry.candidate, DistributedCase.of(case, ((1, 2, 3), (2, 1, 1))), engine="fsdp2", mp_policy=entry.mp_policy
    )
    assert verdict.outcome == entry.expected == "precision", verdict.message()
    assert all(rank.witness is None and rank.failure_kind is None for rank in verdict.ranks)

"""equiv under DistributedDataParallel: W=2 gloo ranks on the CPU.

Each check spawns two processes, so this file holds few, meaningful cases.
The fault candidates live at module level: spawned ranks import them.
"""

import multiprocessing
import os
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

import equiv
from equiv.checking.distributed import DistributedCase, DistributedCheckError, check_distributed
from equiv.distributed.matching import DDP_BUCKET_REBUILD
from equiv.judging.runs import run_reference
from equiv.outcomes import Fault
from equiv.zoo.distributed_bugs import (
    forward_outside_no_sync,
    local_mean_per_rank,
    no_sync_missing,
    scale_made_in_the_default_dtype,
)

# Spawned process groups are slow to start: tox -e slow runs them, tox -e tests leaves them out.
pytestmark = pytest.mark.distributed

MLP = {"hidden": (8,), "activation": "tanh"}
BASE = equiv.Case(
    batch_size=1, micro_batch_sizes=(1,), model_kwargs=MLP, optimizer="Adam", optimizer_kwargs={"lr": 1e-2}, steps=2
)


def no_stray_processes() -> bool:
    return not multiprocessing.active_children()


def test_accumulator_matches_full_batch_with_uneven_ranks_and_one_allreduce_per_window() -> None:
    # Rank 0 holds 4 samples in 2 micro-batches, rank 1 holds 2 in 1; clipping is active.
    dcase = DistributedCase.of(BASE.replace(max_grad_norm=0.05, steps=3), [[1, 3], [2]])
    verdict = check_distributed(equiv.accumulator_step, dcase)
    verdict.assert_ok()
    assert len(verdict.ranks) == 2 and all(verdict.ranks)
    assert verdict.allreduces_per_step("exact") == {1}
    assert verdict.allreduces_per_step("noise") == {1}
    parameter_bytes = sum(p.numel() for p in dcase.case.build_model().module.parameters()) * 8
    assert verdict.bytes_per_step("exact") == parameter_bytes  # float64 gradients, once
    assert no_stray_processes()


def test_accumulator_normalises_by_the_global_token_count() -> None:
    # Ranks hold different numbers of real (non-padding) tokens.
    token_case = BASE.replace(model="token_mlp", model_kwargs={}, loss="token_cross_entropy")
    verdict = check_distributed(equiv.accumulator_step, DistributedCase.of(token_case, [[1, 2], [3, 1, 1]]))
    verdict.assert_ok()
    assert verdict.allreduces_per_step() == {1}


def test_local_mean_per_rank_is_caught_when_ranks_hold_different_counts() -> None:
    verdict = check_distributed(local_mean_per_rank, DistributedCase.of(BASE, [[1], [3]]))
    assert not verdict and verdict.status == "not_equivalent"
    first = verdict.ranks[0].first_mismatch
    assert first is not None and first.step == 1 and first.quantity == "update"
    assert "rank 0 of 2: Not equivalent to full-batch training" in verdict.message()


@pytest.mark.parametrize("candidate", [no_sync_missing, forward_outside_no_sync], ids=lambda c: c.__name__)
def test_missing_or_misplaced_no_sync_costs_one_allreduce_per_micro_batch(candidate: object) -> None:
    verdict = check_distributed(candidate, DistributedCase.of(BASE, [[1, 1, 2], [2, 1, 1]]))  # type: ignore[arg-type]
    verdict.assert_ok()  # numerically right...
    assert verdict.allreduces_per_step() == {3}  # ...at three times the communication


def test_overflow_on_one_rank_skips_the_window_on_every_rank() -> None:
    # Sample 5 of step 1 is in rank 1's shard (rank 0 holds samples 0-3).
    scaled = BASE.replace(
        batch_size=6,
        micro_batch_sizes=[6],
        optimizer="SGD",
        optimizer_kwargs={"lr": 0.1, "momentum": 0.9},
        steps=3,
        loss_scale=2.0**10,
        overflow_at=[1, 5],
    )
    dcase = DistributedCase.of(scaled, [[2, 2], [1, 1]])
    truth = run_reference(dcase.case, torch.float64)
    # The full-batch reference skips step 1 and backs its scale off once...
    assert all(torch.equal(truth[2].params[n], truth[1].params[n]) for n in truth[1].params)
    assert [float(s.optimizer_state["grad_scaler:scale"]) for s in truth] == [1024.0, 1024.0, 512.0, 512.0]
    # ...and so must every rank (updates, optimizer state and the scale are compared).
    verdict = check_distributed(equiv.accumulator_step, dcase)
    verdict.assert_ok()
    assert verdict.allreduces_per_step() == {1}


# ------------------------------------------------------------------ precision
def test_a_default_dtype_scale_factor_is_a_precision_note_across_ranks_and_fails_when_strict() -> None:
    # 7 samples a step: 2 / 7 is not a float32 number, so the float64 run is off by float32 rounding.
    dcase = DistributedCase.of(BASE.replace(optimizer="SGD", optimizer_kwargs={"lr": 0.1}), [[1, 2], [3, 1]])
    verdict = check_distributed(scale_made_in_the_default_dtype, dcase)
    verdict.assert_ok()
    assert verdict.outcome == "equivalent"
    off = [v for v in verdict.ranks if v.mismatches]
    assert off, "the float64 run should differ by float32 rounding"
    assert {d.tier for v in off for d in v.mismatches} == {"exact"}
    # Told apart by the ranks' re-run with torch's default dtype set to float64, as equiv.check does.
    assert all(v.precision is not None and v.precision.cause == "default_dtype" for v in off)
    assert "Precision note: float32-sized differences inside the float64 run" in verdict.message()

    strict = check_distributed(scale_made_in_the_default_dtype, dcase, strict=True)
    assert not strict and strict.outcome == "precision" and strict.status == "not_equivalent"
    with pytest.raises(equiv.EquivalenceError, match="it fails because strict precision was asked for"):
        strict.assert_ok()
    reproduce = strict.message().splitlines()[-1]
    assert reproduce.startswith("Reproduce: equiv.check_distributed(") and reproduce.endswith(", strict=True)")
    with pytest.raises(ValueError, match="train_dtype must be one of"):
        check_distributed(scale_made_in_the_default_dtype, dcase, train_dtype="int8")
    assert no_stray_processes()


# ------------------------------------------------------------------ faults
def raises_on_rank_1(model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: list, loss_fn: object) -> None:
    if dist.get_rank() == 1:
        raise ValueError("rank 1 cannot go on")
    equiv.accumulator_step(model, optimizer, micro_batches, loss_fn)  # type: ignore[arg-type]


def hangs_on_rank_1(model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: list, loss_fn: object) -> None:
    if dist.get_rank() == 1:
        time.sleep(3600)
    equiv.accumulator_step(model, optimizer, micro_batches, loss_fn)  # type: ignore[arg-type]


def dies_on_rank_1(model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: list, loss_fn: object) -> None:
    if dist.get_rank() == 1:
        os._exit(3)
    equiv.accumulator_step(model, optimizer, micro_batches, loss_fn)  # type: ignore[arg-type]


FAULT_CASE = DistributedCase.of(BASE, [[1, 1], [2]])


def test_a_rank_that_raises_is_named_with_the_case() -> None:
    with pytest.raises(DistributedCheckError) as info:
        check_distributed(raises_on_rank_1, FAULT_CASE, timeout_s=60)
    text = str(info.value)
    assert "rank 1 raised (exact tier, step 0: in the candidate)" in text
    assert "rank 1 cannot go on" in text
    assert "DistributedCase.of(Case(batch_size=4" in text
    assert info.value.fault is Fault.RAISED
    assert no_stray_processes()


def test_a_rank_that_hangs_ends_the_check_within_the_timeout() -> None:
    started = time.monotonic()
    with pytest.raises(
        DistributedCheckError, match=r"did not finish within 8 s: .*rank 1 hung \(exact tier, step 0"
    ) as info:
        check_distributed(hangs_on_rank_1, FAULT_CASE, timeout_s=8)
    assert info.value.fault is Fault.HUNG
    # The deadline bounds the wait (the slack is process start-up and clean-up).
    assert time.monotonic() - started < 60
    assert no_stray_processes()


def test_a_rank_that_dies_is_named_with_its_exit_code() -> None:
    with pytest.raises(DistributedCheckError, match=r"rank 1 died with exit code 3 \(exact tier, step 0") as info:
        check_distributed(dies_on_rank_1, FAULT_CASE, timeout_s=60)
    assert info.value.fault is Fault.DIED
    assert no_stray_processes()


def global_count_per_micro_batch(
    model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: list, loss_fn: object
) -> None:
    """Each micro-batch divided by its own all-reduced count: one all-reduce per
    micro-batch, so ranks holding different numbers of micro-batches make
    different numbers of collectives."""
    optimizer.zero_grad(set_to_none=True)
    for inputs, targets in micro_batches:
        count = torch.tensor(len(targets))
        dist.all_reduce(count)
        (loss_fn(model(inputs), targets) * len(targets) / count).backward()  # type: ignore[operator]
    optimizer.step()


def skips_the_last_backward_on_rank_1(
    model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: list, loss_fn: object
) -> None:
    optimizer.zero_grad(set_to_none=True)
    for index, (inputs, targets) in enumerate(micro_batches):
        loss = loss_fn(model(inputs), targets)  # type: ignore[operator]
        if dist.get_rank() == 1 and index == len(micro_batches) - 1:
            continue  # and with it DDP's gradient all-reduce
        loss.backward()
    optimizer.step()


@pytest.mark.parametrize(
    ("candidate", "shards", "expected"),
    [
        # Rank 0 holds two micro-batches, rank 1 one: rank 0's second count meets rank 1's next step.
        (
            global_count_per_micro_batch,
            [[1, 1], [2]],
            r"^mismatched collectives: rank 0 called all_reduce of shape \[\] int64 as its collective #5 "
            r"\(exact tier, step 0: in the candidate, after the step's DDP forward 1\); rank 1 made no collective #5: it "
            r"went on to exact tier, step 1; "
            r"candidate global_count_per_micro_batch",
        ),
        (
            skips_the_last_backward_on_rank_1,
            [[1, 1], [2, 1]],
            r"^mismatched collectives: rank 0 called all_reduce of shape \[67\] float64 as its collective #5 "
            r"\(exact tier, step 0: in the candidate, after the step's DDP forward 2\); rank 1 made no collective #5: it "
            r"went on to exact tier, step 1",
        ),
    ],
    ids=["count_per_micro_batch", "skipped_backward"],
)
def test_mismatched_collectives_are_named_at_once_not_after_the_timeout(
    candidate: object,
    shards: list[list[int]],
    expected: str,
) -> None:
    # Without the comparison gloo pairs the wrong calls: this ended after the
    # 120 s timeout ("Timed out waiting 120000ms for recv operation").
    started = time.monotonic()
    with pytest.raises(DistributedCheckError, match=expected) as info:
        check_distributed(candidate, DistributedCase.of(BASE, shards))  # type: ignore[arg-type]
    assert info.value.fault is Fault.COLLECTIVE_MISMATCH
    assert time.monotonic() - started < 30  # the timeout is 120 s
    assert no_stray_processes()


def test_ddp_ranks_that_sync_a_different_number_of_times_are_named_not_left_to_the_timeout() -> None:
    # Rank 1 syncs both of its micro-batches, rank 0 its one: rank 1 rebuilds DDP's buckets (a broadcast
    # in C++) at its second forward while rank 0 goes on. Before the rebuild was in the collective log,
    # this waited in gloo until the timeout ("Timed out waiting ... for recv operation", Fault.HUNG).
    case = BASE.replace(batch_size=3, micro_batch_sizes=(1, 1, 1), steps=1)
    with pytest.raises(DistributedCheckError) as info:
        check_distributed(no_sync_missing, DistributedCase.of(case, [[1], [1, 1]]), timeout_s=30)
    message = str(info.value)
    assert info.value.fault is Fault.COLLECTIVE_MISMATCH, message
    assert message.startswith(
        "mismatched collectives: rank 0 made no collective #5: it went on to the end of the exact tier's steps; "
        f"rank 1 called {DDP_BUCKET_REBUILD} as its collective #5 (exact tier, step 0: in the candidate, after the "
        "step's DDP forward 1); candidate no_sync_missing"
    ), message
    assert "did not finish within" not in message and "Timed out" not in message, message
    assert no_stray_processes()


def test_bad_distributed_input_is_refused() -> None:
    with pytest.raises(equiv.InvalidCase, match=r"rank 1 has micro-batch sizes \(\)"):
        DistributedCase.of(BASE, [[1], []])
    with pytest.raises(TypeError, match="cannot be sent to the ranks"):
        check_distributed(lambda *args: None, FAULT_CASE)
    with pytest.raises(ValueError, match="timeout_s must be a positive number of seconds, got 0"):
        check_distributed(equiv.accumulator_step, FAULT_CASE, timeout_s=0)

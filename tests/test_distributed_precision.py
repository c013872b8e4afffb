"""The accumulation buffer's precision across ranks: a DDP or FSDP2 step computing its
gradient in bfloat16 (its own buffer, Megatron-FSDP ISEEKYAN #149; DDP's bf16_compress_hook)
is a precision finding, judged by the same rerun and rule as equiv.check, never a
mathematical mismatch; a mathematical bug computed in bfloat16 still is one.

The checks spawn gloo ranks (marker ``distributed``); the searches are ``slow`` too.
"""

import inspect
from typing import Any

import pytest
import torch

import equiv
from equiv.checking.distributed import DistributedCase, DistributedVerdict, check_distributed
from equiv.checking.distributed_search import verify_distributed
from equiv.cli import main
from equiv.distributed.launcher import run_on_ranks
from equiv.judging.runs import lifted_low_precision
from equiv.outcomes import Outcome
from equiv.zoo.distributed_bugs import (
    SEARCH_ZOO,
    bfloat16_buffer_before_sync,
    bfloat16_buffer_local_mean,
    bfloat16_compressed_all_reduce,
    bfloat16_sharded_buffer,
    float32_buffer_before_sync,
    float32_sharded_buffer,
)

MLP = equiv.Case(batch_size=1, micro_batch_sizes=(1,), model_kwargs={"hidden": (8,), "activation": "tanh"}, steps=2)
SPLIT = DistributedCase.of(MLP, [[1, 2], [2, 1]])
LIFTED = "with the step's bfloat16 and float16 lifted to each tier's dtype"


class Launches:
    """run_on_ranks, recording what each launch ran (the rerun a launch was is in its description)."""

    def __init__(self) -> None:
        self.described: list[str] = []

    def __call__(self, task: Any, world_size: int, **kwargs: Any) -> list[Any]:
        self.described.append(kwargs["describe"])
        return run_on_ranks(task, world_size, **kwargs)

    def lifted(self) -> int:
        return sum(LIFTED in describe for describe in self.described)


def _assert_bfloat16_finding(verdict: DistributedVerdict) -> None:
    assert verdict.status is Outcome.NOT_EQUIVALENT and verdict.outcome is Outcome.PRECISION, verdict.message()
    failing = [v for v in verdict.ranks if v.mismatches]
    assert failing and all(v.precision is not None and v.precision.cause == "bfloat16_arithmetic" for v in failing)
    # The sensitivity, per dtype judged: far below bfloat16's rounding (3.9e-3) in both.
    resolved = dict(failing[0].precision.resolves)  # type: ignore[union-attr]
    assert set(resolved) == {"float32", "float64"} and resolved["float64"] < 1e-12 < resolved["float32"] < 1e-4
    message = verdict.message()
    assert "bfloat16-sized differences in the float32 and float64 runs" in message
    assert "The check resolves relative differences down to" in message
    assert "it fails because you train with float32 master weights and gradients" in message
    # Float32 training (the default) fails it again: the Reproduce line adds no flag.
    reproduce = message.splitlines()[-1]
    assert reproduce.startswith("Reproduce: equiv.check_distributed(") and "train_dtype" not in reproduce


@pytest.mark.distributed
def test_a_bfloat16_buffer_under_ddp_is_a_precision_finding_told_apart_from_a_float32_one() -> None:
    launches = Launches()
    verdict = check_distributed(bfloat16_buffer_before_sync, SPLIT, launcher=launches)
    _assert_bfloat16_finding(verdict)
    assert launches.lifted() == 1, launches.described  # the ranks ran the lifted rerun, once
    # A user training in bfloat16 rounds this much itself: a pass with the note.
    bf16_training = check_distributed(bfloat16_buffer_before_sync, SPLIT, train_dtype="bfloat16")
    assert bf16_training and bf16_training.outcome is Outcome.EQUIVALENT, bf16_training.message()
    assert "Precision note: bfloat16-sized differences" in bf16_training.message()
    # A float32 buffer: exact in float32 training, a passing float32-sized note in the float64 run.
    f32 = check_distributed(float32_buffer_before_sync, SPLIT)
    assert f32, f32.message()
    assert {v.precision.cause for v in f32.ranks if v.precision is not None} == {"float32_sized"}


@pytest.mark.distributed
def test_a_bfloat16_sharded_buffer_under_fsdp2_is_a_precision_finding() -> None:
    _assert_bfloat16_finding(check_distributed(bfloat16_sharded_buffer, SPLIT, engine="fsdp2"))
    f32 = check_distributed(float32_sharded_buffer, SPLIT, engine="fsdp2")
    assert f32, f32.message()


@pytest.mark.distributed
def test_ddp_bf16_compress_hook_is_a_precision_finding_its_hook_lifted_too() -> None:
    # The hook runs inside the autograd engine, where the step's own lift does not reach.
    _assert_bfloat16_finding(check_distributed(bfloat16_compressed_all_reduce, SPLIT))


@pytest.mark.distributed
def test_a_mathematical_bug_computed_in_bfloat16_stays_a_mismatch() -> None:
    # A mean of rank means (transformers #34191) in a bfloat16 buffer: small enough that the
    # ranks run it lifted, and it still fails there.
    launches = Launches()
    verdict = check_distributed(bfloat16_buffer_local_mean, DistributedCase.of(MLP, [[1, 2], [2]]), launcher=launches)
    assert verdict.outcome is Outcome.NOT_EQUIVALENT, verdict.message()
    assert all(v.precision is None for v in verdict.ranks)
    assert launches.lifted() == 1, launches.described


@pytest.mark.distributed
def test_under_a_16_bit_mp_policy_the_policy_rerun_decides_not_the_lift() -> None:
    # Lifting bfloat16 would lift the policy's own casts: the policy's rerun without it answers.
    launches = Launches()
    policy = torch.distributed.fsdp.MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)
    verdict = check_distributed(equiv.accumulator_step, SPLIT, engine="fsdp2", mp_policy=policy, launcher=launches)
    assert verdict.outcome is Outcome.PRECISION and verdict.precision_note, verdict.message()
    assert all(v.precision is None for v in verdict.ranks) and launches.lifted() == 0, launches.described


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("name", ["bfloat16_buffer_before_sync", "bfloat16_sharded_buffer"])
def test_the_search_finds_a_bfloat16_buffer_as_a_precision_finding_and_shrinks_it(name: str) -> None:
    entry = SEARCH_ZOO[name]
    result = verify_distributed(entry.step, engines=(entry.engine,), models=entry.models, max_examples=25, seed=0)
    assert result.found and result.outcome is Outcome.PRECISION and result.engine == entry.engine, result.message()
    dcase = result.counterexample
    assert dcase is not None and dcase.world_size == 2 and dcase.case.steps == 1, result.message()
    assert "Precision (candidate" in result.message() and "Not equivalent to full-batch" not in result.message()


@pytest.mark.slow
@pytest.mark.distributed
def test_the_search_passes_a_float32_buffer() -> None:
    entry = SEARCH_ZOO["float32_buffer_before_sync"]
    result = verify_distributed(entry.step, engines=(entry.engine,), models=entry.models, max_examples=10, seed=0)
    assert not result.found and result.precision_notes > 0, result.message()


def test_a_lifted_function_keeps_its_signature_and_computes_in_the_runs_dtype() -> None:
    def hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP reads the parameter names
        return bucket.to(torch.bfloat16), torch.zeros(1, dtype=torch.float16)

    lifted = lifted_low_precision(hook, torch.float64)
    assert list(inspect.signature(lifted).parameters) == ["state", "bucket"]
    tensor = torch.tensor([1 / 3], dtype=torch.float64)
    rounded, made = lifted(None, tensor)
    assert rounded.dtype == made.dtype == torch.float64 and rounded.item() == 1 / 3
    assert [t.dtype for t in hook(None, tensor)] == [torch.bfloat16, torch.float16]  # unlifted, as it was


@pytest.mark.distributed
def test_the_search_takes_the_users_training_dtype_from_the_shell(capsys: pytest.CaptureFixture[str]) -> None:
    # bf16_compress_hook rounds on every split: a failing finding for float32 training, a note for bfloat16.
    target = [
        "verify-distributed",
        "equiv.zoo.distributed_bugs:bfloat16_compressed_all_reduce",
        "--models",
        "tokens",
        "--max-examples",
        "3",
        "--seed",
        "0",
    ]
    assert main(target) == 1
    out = capsys.readouterr().out
    assert "Precision (candidate bfloat16_compressed_all_reduce)" in out and "train_dtype" not in out
    assert main([*target, "--train-dtype", "bfloat16"]) == 0
    assert "no counterexample; 3 with a precision note" in capsys.readouterr().out
    with pytest.raises(ValueError, match="train_dtype must be one of"):
        verify_distributed(bfloat16_compressed_all_reduce, train_dtype="int8")

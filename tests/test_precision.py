"""A verdict in the user's precision: float32-sized differences inside the float64 run pass with a note.

Two correct loops people run (:mod:`equiv.zoo.correct`) make a float32 number inside equiv's float64 run:
a fine-tuning recipe that scales the summed gradient by ``1.0 / num_tokens`` (a
tensor of counts, so the quotient is in torch's default dtype), and a clip
coefficient computed with ``dtype=torch.float32``.  In float32, bfloat16 or
float16 training each is as exact as the full batch, so they pass, with a note
saying what, where, how large and why; they fail (class "precision") only for a
user who trains in float64 or asks for strict precision.
"""

from __future__ import annotations

import json

import pytest
import torch

import equiv
from equiv.cases.standard import STANDARD_CASES
from equiv.checking.search_space import SearchSpace
from equiv.cli import main
from equiv.outcomes import Outcome
from equiv.zoo.bugs import mean_of_means
from equiv.zoo.correct import CORRECT_STEPS

SGD = STANDARD_CASES["SGD momentum, uneven 1+5+10"]
CLIPPED = STANDARD_CASES["SGD, active clipping 3+5"]


#: The zoo's correct real-world loops, by the names these tests use.
STEPS = {
    "token_scale": CORRECT_STEPS["scales_by_inverse_item_count"],
    "float32_clip": CORRECT_STEPS["clips_in_float32"],
}


@pytest.fixture
def steps() -> dict[str, object]:
    return dict(STEPS)


def test_a_default_dtype_constant_passes_with_a_note_that_says_what_where_how_large_and_why(
    steps: dict[str, object],
) -> None:
    verdict = equiv.check(steps["token_scale"], SGD)  # type: ignore[arg-type]
    assert verdict and verdict.status is Outcome.EQUIVALENT, verdict.message()
    assert verdict.precision is not None and verdict.precision.cause == "default_dtype"
    note = verdict.precision_note or ""
    assert "float32-sized differences inside the float64 run" in note
    assert "float32 rounds at 6e-08" in note and "at step" in note
    assert "with the default dtype set to float64 the step matches" in note
    assert "harmless in float32, bfloat16 or float16 training" in note
    assert verdict.message().startswith(
        "Equivalent to full-batch training (candidate scales_by_inverse_item_count) in float32"
    )
    verdict.assert_ok()


@pytest.mark.parametrize(
    ("train_dtype", "strict", "why"),
    [
        (torch.float64, False, "you train in float64"),
        ("float64", False, "you train in float64"),
        (None, True, "strict precision was asked for"),
    ],
)
def test_it_fails_as_precision_for_float64_training_or_strict(
    steps: dict[str, object], train_dtype: object, strict: bool, why: str
) -> None:
    verdict = equiv.check(steps["token_scale"], SGD, train_dtype=train_dtype, strict=strict)  # type: ignore[arg-type]
    assert not verdict and verdict.outcome is Outcome.PRECISION
    assert f"it fails because {why}" in verdict.message()
    # The replay line carries what made it fail, so it fails again as printed.
    assert ("strict=True" if strict else "train_dtype='float64'") in verdict.message().splitlines()[-1]


def test_float32_or_lower_training_is_the_default(steps: dict[str, object]) -> None:
    for train_dtype in ("float32", torch.bfloat16, "float16"):
        assert equiv.check(steps["token_scale"], SGD, train_dtype=train_dtype)  # type: ignore[arg-type]


def test_explicit_float32_arithmetic_is_named_as_such(steps: dict[str, object]) -> None:
    verdict = equiv.check(steps["float32_clip"], CLIPPED)  # type: ignore[arg-type]
    assert verdict and verdict.precision is not None and verdict.precision.cause == "float32_sized"
    assert "not torch's default dtype (setting it to float64 leaves the difference)" in (verdict.precision_note or "")
    assert not equiv.check(steps["float32_clip"], CLIPPED, strict=True)  # type: ignore[arg-type]


def test_a_real_bug_is_never_a_precision_note() -> None:
    # Mean of micro-batch means: far past float32 rounding, in every tier.
    verdict = equiv.check(mean_of_means, SGD)
    assert verdict.status is Outcome.NOT_EQUIVALENT and verdict.precision is None


def test_bad_precision_settings_are_refused_by_name(steps: dict[str, object]) -> None:
    with pytest.raises(ValueError, match=r"train_dtype must be one of .* got 'float8'"):
        equiv.check(steps["token_scale"], SGD, train_dtype="float8")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="strict must be True or False, got 'yes'"):
        equiv.check(steps["token_scale"], SGD, strict="yes")  # type: ignore[arg-type]


def test_the_standard_cases_and_the_search_pass_a_correct_real_loop(
    steps: dict[str, object], capsys: pytest.CaptureFixture[str]
) -> None:
    verdicts = equiv.check(steps["token_scale"])  # type: ignore[arg-type]
    assert verdicts, verdicts.message()
    assert "Precision note (" in verdicts.summary()
    result = equiv.verify(
        steps["token_scale"],
        SearchSpace(families=("mlp",), optimizers=("SGD", "Adam")),  # type: ignore[arg-type]
        max_examples=15,
        seed=1,
        replay_in_fresh_process=False,
    )
    assert result and result.precision_notes > 0 and "with a precision note" in result.message()
    strict = equiv.verify(
        steps["token_scale"],
        SearchSpace(families=("mlp",), optimizers=("SGD", "Adam")),  # type: ignore[arg-type]
        max_examples=15,
        seed=1,
        replay_in_fresh_process=False,
        train_dtype="float64",
    )
    assert strict.outcome is Outcome.PRECISION
    assert "--train-dtype float64" in strict.replay_hint()
    # From the shell: exit 0 for float32 training, 1 for float64.
    case = ["--case", json.dumps(SGD.to_dict())]
    target = "equiv.zoo.correct:scales_by_inverse_item_count"
    assert main(["check", target, *case]) == 0
    assert main(["check", target, *case, "--train-dtype", "float64"]) == 1
    assert main(["check", target, *case, "--strict-precision"]) == 1
    capsys.readouterr()


@pytest.mark.parametrize("name", sorted(CORRECT_STEPS))
def test_every_correct_real_loop_passes_every_standard_case(name: str) -> None:
    verdicts = equiv.check(CORRECT_STEPS[name])
    assert verdicts, verdicts.message()
    assert verdicts.counts()["equivalent"] >= len(STANDARD_CASES) // 2


def test_a_bfloat16_accumulation_buffer_is_a_precision_finding_told_apart_from_a_float32_one() -> None:
    # ISEEKYAN #149 (Megatron-FSDP): bf16 gradient accumulation at 3.5e-5 relative, float32 buffers at 2.7e-8.
    from equiv.zoo.bugs import low_precision_buffer

    bf16 = equiv.check(low_precision_buffer, SGD)
    assert bf16.status is Outcome.NOT_EQUIVALENT and bf16.outcome is Outcome.PRECISION
    assert bf16.precision is not None and bf16.precision.cause == "bfloat16_arithmetic"
    note = bf16.precision_note or ""
    assert "bfloat16-sized differences in the float32 and float64 runs" in note
    assert "you train with float32 master weights and gradients" in note
    # The sensitivity, per dtype judged: far below bfloat16's rounding (3.9e-3) in both.
    resolved = dict(bf16.precision.resolves)
    assert set(resolved) == {"float32", "float64"} and resolved["float64"] < 1e-12 < resolved["float32"] < 1e-4
    assert "The check resolves relative differences down to" in note
    # bfloat16 training rounds this much itself: a pass; float32 training named explicitly still fails.
    assert equiv.check(low_precision_buffer, SGD, train_dtype="bfloat16")
    assert not equiv.check(low_precision_buffer, SGD, train_dtype="float32")
    # A float32 buffer is exact in float32 training: a passing float32-sized note only.
    f32 = equiv.check(CORRECT_STEPS["float32_buffer"], SGD)
    assert f32 and f32.precision is not None and f32.precision.cause == "float32_sized"


def test_a_mathematical_bug_in_a_bfloat16_step_stays_a_mismatch() -> None:
    # Lifting bfloat16 to the run's dtype leaves a mean of means a mean of means.
    from equiv.zoo.bugs import _buffered_step

    def bf16_mean_of_means(model, optimizer, micro_batches, loss_fn, *, max_grad_norm=None):  # type: ignore[no-untyped-def]
        _buffered_step(model, optimizer, micro_batches[:1], loss_fn, torch.bfloat16, max_grad_norm)

    verdict = equiv.check(bf16_mean_of_means, SGD)
    assert verdict.outcome is Outcome.NOT_EQUIVALENT and verdict.precision is None

"""Dynamic loss scaling across a window: one overflow skips the whole window."""

import json
import re

import pytest
import torch

import equiv
from equiv.judging.compare import LOSS_SCALE_KEY
from equiv.judging.runs import run_reference
from equiv.zoo import bugs as zoo
from equiv.zoo.distributed_bugs import overflow_checked_on_last_micro_batch

SCALED = equiv.Case(
    batch_size=6,
    micro_batch_sizes=(1, 2, 3),
    model_kwargs={"hidden": (8,)},
    optimizer="Adam",
    optimizer_kwargs={"lr": 1e-2},
    steps=3,
    loss_scale=2.0**8,
    overflow_at=(1, 0),
)


@pytest.mark.parametrize("sample", range(6))
def test_reference_skips_the_window_whichever_micro_batch_overflows(sample: int) -> None:
    equiv.check(equiv.accumulator_step, SCALED.replace(overflow_at=[1, sample])).assert_ok()


def test_overflow_flag_assigned_instead_of_ored_is_caught() -> None:
    verdict = equiv.check(overflow_checked_on_last_micro_batch, SCALED)
    assert verdict.status == "not_equivalent"
    first = verdict.first_mismatch
    # Step 1 (the overflowing window) is stepped instead of skipped.
    assert first is not None and first.step == 2 and first.quantity == "update"
    # An overflow in the last micro-batch is the one case the bug still handles.
    assert equiv.check(overflow_checked_on_last_micro_batch, SCALED.replace(overflow_at=[1, 5]))


@pytest.mark.parametrize("autocast", ["float16", "bfloat16"])
def test_mixed_precision_window_with_an_overflow_is_skipped_like_the_full_batch(autocast: str) -> None:
    # AMP: float32 parameters, forward under autocast; float64 truth stays exact.
    case = SCALED.replace(autocast=autocast)
    verdict = equiv.check(equiv.accumulator_step, case)
    verdict.assert_ok()
    assert verdict.worst["noise"].dtype == "float32"
    assert not equiv.check(overflow_checked_on_last_micro_batch, case)


def test_summed_losses_reach_a_natural_float16_overflow_sooner_than_a_mean() -> None:
    # Pinned (found by properties/test_loss_scale_window.py): back-propagating
    # the SUM (5x the mean here) overflows float16 at scale 2**14 where the
    # mean does not.  Both are the full batch's mathematics, so the verdict is
    # "no exact reference for this skip decision", not a bug of the accumulator.
    case = equiv.Case(
        batch_size=5,
        micro_batch_sizes=(5,),
        model_kwargs={"hidden": (8,)},
        optimizer_kwargs={"lr": 0.1, "momentum": 0.9},
        loss_scale=2.0**14,
        overflow_at=(0, 0),
        autocast="float16",
    )
    verdict = equiv.check(equiv.accumulator_step, case)
    assert verdict.status == "inherently_non_equivalent"
    assert any("summed loss normalised after backward overflow at different scales" in r for r in verdict.inherent)
    assert verdict.mismatches and verdict.diverged_tiers() == ["noise"]  # float64 is never autocast


def test_a_full_batch_step_that_overflows_naturally_has_no_exact_reference() -> None:
    # At 2**40 even the full batch overflows in float16, which float64 never does.
    case = SCALED.replace(overflow_at=None, loss_scale=2.0**40, autocast="float16", steps=2)
    verdict = equiv.check(equiv.accumulator_step, case)
    assert verdict.status == "inherently_non_equivalent"
    assert any(
        "overflows in float32 with float16 autocast at loss scale 1.09951e+12" in reason for reason in verdict.inherent
    )


def test_scaled_case_is_not_applicable_to_a_candidate_without_the_scaler() -> None:
    verdict = equiv.check(zoo.unscaled_sum, SCALED)
    assert verdict.status == "not_applicable"
    assert verdict.not_applicable == ("unscaled_sum takes no grad_scaler (the case sets loss_scale=256.0)",)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"loss_scale": None}, "overflow_at=(1, 0) needs loss_scale"),
        ({"overflow_at": [3, 0]}, "overflow_at=(3, 0) is outside steps 0..2 x samples 0..5"),
        ({"overflow_at": [0, 6]}, "overflow_at=(0, 6) is outside steps 0..2 x samples 0..5"),
        ({"loss_scale": -1.0, "overflow_at": None}, "loss_scale must be positive or None, got -1.0"),
        ({"autocast": "float8"}, "autocast must be 'float16', 'bfloat16' or None, got 'float8'"),
        (
            {"scale_growth_interval": 0},
            "scale_growth_interval must be a positive int (clean windows before the scale doubles) or None, got 0",
        ),
        ({"scale_growth_interval": True}, "scale_growth_interval must be a positive int"),
        (
            {"loss_scale": None, "overflow_at": None, "scale_growth_interval": 2},
            "scale_growth_interval=2 needs loss_scale",
        ),
    ],
    ids=[
        "no_scaler",
        "step_out_of_range",
        "sample_out_of_range",
        "negative_scale",
        "bad_autocast",
        "growth_zero",
        "growth_bool",
        "growth_without_scale",
    ],
)
def test_bad_loss_scale_fields_name_the_value(changes: dict[str, object], message: str) -> None:
    with pytest.raises(equiv.InvalidCase, match=re.escape(message)):
        SCALED.replace(**changes)


def test_overflow_needs_float_inputs() -> None:
    case = SCALED.replace(model="token_mlp", model_kwargs={}, loss="token_cross_entropy")
    with pytest.raises(equiv.InvalidCase, match="overflow_at needs float inputs"):
        equiv.check(equiv.accumulator_step, case)


def scales(case: equiv.Case) -> list[float]:
    """The full-batch run's loss scale before the first step and after each."""
    return [float(snapshot.optimizer_state[LOSS_SCALE_KEY]) for snapshot in run_reference(case, torch.float64)]


def test_a_growth_interval_grows_the_scale_within_the_case_and_an_overflow_backs_it_off_once() -> None:
    # Interval 1: doubles after every clean window; window 1 overflows: halved once, not per micro-batch.
    assert scales(SCALED.replace(scale_growth_interval=1)) == [256.0, 512.0, 256.0, 512.0]
    # Interval 2: the count of clean windows restarts after the overflow, so no growth within 3 steps.
    assert scales(SCALED.replace(scale_growth_interval=2)) == [256.0, 256.0, 128.0, 128.0]
    # torch's default interval (2000) is never reached by a case.
    assert scales(SCALED.replace(overflow_at=None)) == [256.0] * 4


@pytest.mark.parametrize("interval", [1, 2])
def test_reference_is_exact_while_the_scale_grows(interval: int) -> None:
    for overflow_at in (None, (0, 3), (2, 5)):
        equiv.check(
            equiv.accumulator_step,
            SCALED.replace(scale_growth_interval=interval, overflow_at=overflow_at, max_grad_norm=0.05),
        ).assert_ok()


def test_growth_interval_round_trips_through_json_and_repr() -> None:
    case = SCALED.replace(scale_growth_interval=2)
    # (JSON turns model_kwargs' tuples into lists: compare what it stores.)
    read_back = equiv.Case.from_dict(json.loads(json.dumps(case.to_dict())))
    assert read_back.scale_growth_interval == 2 and read_back.to_dict() == json.loads(json.dumps(case.to_dict()))
    assert "scale_growth_interval=2" in repr(case) and "scale_growth_interval" not in repr(SCALED)
    built = case.build_grad_scaler()
    assert built is not None and built.get_growth_interval() == 2

"""Verdicts on accumulation people actually use.

These pin today's behaviour: if a peer changes, a test fails (rather than the
peers report silently changing).  Accelerate and Lightning tests need the
extras (`pip install equiv[peers]`) and skip with a reason without them.
"""

import pytest

import equiv
from equiv.reporting.peers import CONFIGURATIONS, smallest_counterexample
from equiv.zoo.adapters import MindSporeAccumulator, MindSporeGradientAccumulation, textbook_step, torchtitan_step

EVEN = CONFIGURATIONS["equal splits, SGD"]
ADAM = CONFIGURATIONS["equal splits, Adam"]
UNEVEN = CONFIGURATIONS["uneven splits 1+4+7"]
TOKENS = CONFIGURATIONS["token loss, causal LM, equal splits"]
CLIPPED = CONFIGURATIONS["clipping (active), equal splits"]


def first_update_mismatch(candidate: object, case: equiv.Case) -> equiv.TensorDiff:
    verdict = equiv.check(candidate, case)  # type: ignore[arg-type]
    assert verdict.status == "not_equivalent", verdict.message()
    first = verdict.first_mismatch
    assert first is not None and first.kind == "update"
    return first


def test_textbook_loop_passes_equal_splits_and_fails_uneven_ones_with_two_micro_batches() -> None:
    assert equiv.check(textbook_step, EVEN)
    assert equiv.check(textbook_step, CLIPPED)
    assert first_update_mismatch(textbook_step, UNEVEN).step == 1
    shrunk, _ = smallest_counterexample(textbook_step)
    assert shrunk is not None
    assert len(shrunk.micro_batch_sizes) == 2 and len(set(shrunk.micro_batch_sizes)) == 2


def test_textbook_loop_averages_token_means_in_the_causal_lm() -> None:
    # Equal numbers of sequences, unequal numbers of real tokens: the 2024 transformers bug class.
    assert first_update_mismatch(textbook_step, TOKENS).step == 1
    assert equiv.check(equiv.accumulator_step, TOKENS)


@pytest.mark.parametrize("case", [EVEN, ADAM, UNEVEN, TOKENS, CLIPPED], ids=["even", "adam", "uneven", "tokens", "clip"])
def test_torchtitan_style_loop_is_exact_everywhere(case: equiv.Case) -> None:
    equiv.check(torchtitan_step, case).assert_ok()


def test_mindspore_r13_port_sums_without_scaling() -> None:
    # N=3 times the gradient: SGD's update is 3x (relative error 2) ...
    assert abs(first_update_mismatch(MindSporeGradientAccumulation(), EVEN).max_rel_diff - 2.0) < 1e-6
    # ... and under Adam only eps sees it: caught in the float64 tier.
    verdict = equiv.check(MindSporeGradientAccumulation(), ADAM)
    assert any(d.tier == "exact" and d.kind == "update" for d in verdict.mismatches)


def test_mindspore_2_port_cannot_clip_and_misses_short_tails() -> None:
    assert equiv.check(MindSporeAccumulator(), EVEN)
    # The notebook's Accumulator has no clipping: a clipping case does not apply to it (not a failure).
    verdict = equiv.check(MindSporeAccumulator(), CLIPPED)
    assert verdict.status == "not_applicable", verdict.message()
    assert verdict.not_applicable == ("MindSporeAccumulator() takes no max_grad_norm (the case sets max_grad_norm=0.01)",)
    # accumulate_step=4 with 3 micro-batches per window: the counter never reaches the step in the first window.
    assert first_update_mismatch(MindSporeAccumulator(4), EVEN).max_rel_diff == 1.0


def test_accelerate_divides_a_short_tail_window_by_the_full_n() -> None:
    accelerate = pytest.importorskip("equiv.zoo.adapters.accelerate", reason="needs the accelerate extra")
    assert equiv.check(accelerate.AccelerateStep(), EVEN)
    assert equiv.check(accelerate.AccelerateStep(), CLIPPED)
    assert first_update_mismatch(accelerate.AccelerateStep(), UNEVEN).step == 1
    # N=4 configured, 3 micro-batches: stepped at the end of data but scaled by 3/4.
    assert abs(first_update_mismatch(accelerate.AccelerateStep(4), EVEN).max_rel_diff - 0.25) < 1e-6
    # Without sync_with_dataloader the short window is not stepped at all.
    assert first_update_mismatch(accelerate.AccelerateStep(4, sync_with_dataloader=False), EVEN).max_rel_diff == 1.0


def test_lightning_divides_a_short_tail_window_by_the_full_n() -> None:
    lightning = pytest.importorskip("equiv.zoo.adapters.lightning", reason="needs the lightning extra")
    assert equiv.check(lightning.LightningStep(), EVEN)
    assert equiv.check(lightning.LightningStep(), CLIPPED)  # clips once, after accumulation
    assert first_update_mismatch(lightning.LightningStep(), UNEVEN).step == 1
    assert abs(first_update_mismatch(lightning.LightningStep(4), EVEN).max_rel_diff - 0.25) < 1e-6


def test_stateful_adapters_start_afresh_for_each_run() -> None:
    # One adapter object checked twice: the second run must not inherit the counter.
    adapter = MindSporeAccumulator()
    assert equiv.check(adapter, EVEN) and equiv.check(adapter, EVEN)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: MindSporeGradientAccumulation(0), "mini_steps must be a positive int or None, got 0"),
        (lambda: MindSporeAccumulator(-1), "accumulate_step must be a positive int or None, got -1"),
    ],
    ids=["mini_steps", "accumulate_step"],
)
def test_bad_adapter_arguments_name_the_value(build: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build()  # type: ignore[operator]

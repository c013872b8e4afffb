"""check() rejects known accumulation bugs (mean of means, unscaled sums, per-micro-batch clipping, ...), for the right reason."""

import equiv
from equiv.results.verdict import TensorDiff, Verdict
from equiv.zoo import bugs as zoo

MLP = {"hidden": (8, 8), "activation": "tanh"}


def case(**changes: object) -> equiv.Case:
    base = equiv.Case(
        batch_size=8, micro_batch_sizes=(4, 4), model_kwargs=MLP, optimizer="SGD", optimizer_kwargs={"lr": 0.1}, steps=2
    )
    return base.replace(**changes)


def update_mismatches(verdict: Verdict, tier: str) -> list[TensorDiff]:
    return [d for d in verdict.mismatches if d.quantity == "update" and d.tier == tier]


def test_unscaled_sum_with_sgd_is_n_times_the_update() -> None:
    verdict = equiv.check(zoo.unscaled_sum, case())
    assert not verdict
    assert verdict.status == "not_equivalent"
    first = verdict.first_mismatch
    assert first is not None and first.step == 1 and first.quantity == "update"
    # With SGD the whole update is N=2 times too large: relative error exactly 1.
    assert abs(first.max_rel_diff - 1.0) < 1e-6
    assert verdict.diverged_tiers() == ["exact", "noise"]


def test_unscaled_sum_with_adam_is_caught_in_the_float64_tier() -> None:
    verdict = equiv.check(zoo.unscaled_sum, case(optimizer="Adam", optimizer_kwargs={"lr": 1e-2}))
    assert not verdict
    # Adam divides the scale away except through eps: the update differs by
    # far less than float32 noise, but float64 shows it.
    assert update_mismatches(verdict, "exact")
    exact_updates = max(update_mismatches(verdict, "exact"), key=lambda d: d.ratio)
    assert exact_updates.ratio > 1e3
    # The first moment is N times too large in any dtype.
    assert any(d.quantity == "state" and d.name.endswith(":exp_avg") for d in verdict.mismatches)


def test_unscaled_sum_under_active_clipping_shows_only_in_the_exact_tier_below_float32_rounding() -> None:
    # The clip normalises the N x sum away but for its epsilon: float32 training cannot see it,
    # so it passes with a precision note, and fails only in strict precision, in the exact tier only.
    passing = equiv.check(zoo.unscaled_sum, case(max_grad_norm=1e-3))
    assert passing and passing.precision is not None and passing.precision.cause == "float32_sized"
    verdict = equiv.check(zoo.unscaled_sum, case(max_grad_norm=1e-3), strict=True)
    assert not verdict and verdict.outcome == "precision"
    assert verdict.diverged_tiers() == ["exact"]
    assert verdict.worst["noise"].ratio < 1


def test_mean_of_means_passes_even_splits_and_fails_uneven_ones() -> None:
    assert equiv.check(zoo.mean_of_means, case(micro_batch_sizes=(4, 4)))
    verdict = equiv.check(zoo.mean_of_means, case(micro_batch_sizes=(1, 7)))
    assert verdict.status == "not_equivalent"
    first = verdict.first_mismatch
    assert first is not None and first.step == 1 and first.quantity == "update"
    assert first.ratio > 1e6


def test_clip_per_micro_batch_is_caught_only_when_clipping_is_active() -> None:
    assert equiv.check(zoo.clip_per_micro_batch, case(micro_batch_sizes=(3, 5), max_grad_norm=1e3))
    verdict = equiv.check(zoo.clip_per_micro_batch, case(micro_batch_sizes=(3, 5), max_grad_norm=0.05))
    assert not verdict
    assert verdict.first_mismatch is not None and verdict.first_mismatch.step == 1


def test_leaked_gradients_show_at_the_second_step() -> None:
    verdict = equiv.check(zoo.leaks_gradients, case(micro_batch_sizes=(3, 5)))
    assert not verdict
    # The first step is right; the leak is summed into the second.
    assert min(d.step for d in verdict.mismatches) == 2
    assert verdict.first_mismatch is not None and verdict.first_mismatch.quantity == "update"


def test_mismatch_message_reads_like_assert_close() -> None:
    verdict = equiv.check(zoo.mean_of_means, case(micro_batch_sizes=(1, 7)))
    message = verdict.message()
    for expected in [
        "Not equivalent to full-batch training (candidate mean_of_means)",
        "Diverged at step 1 of 2, exact tier (float64)",
        "Mismatched elements:",
        "Greatest absolute difference:",
        "allowed)",
        "Greatest relative difference:",
        "Allowed = 32 x full-batch floor",
        "Reproduce: equiv.check(mean_of_means, equiv.Case(batch_size=8, micro_batch_sizes=(1, 7)",
    ]:
        assert expected in message, f"{expected!r} missing from:\n{message}"
    try:
        verdict.assert_ok()
    except equiv.EquivalenceError as exc:
        assert str(exc) == message
        assert exc.verdict is verdict
    else:
        raise AssertionError("assert_ok() did not raise for a mismatch")


def test_batchnorm_and_dropout_are_reported_as_inherent_with_reason() -> None:
    bn = equiv.check(equiv.accumulator_step, case(model_kwargs={**MLP, "norm": "batch"}, micro_batch_sizes=(3, 5)))
    assert bn.status == "inherently_non_equivalent" and not bn
    assert any("BatchNorm" in reason and "statistics" in reason for reason in bn.inherent)
    dropout = equiv.check(equiv.accumulator_step, case(model_kwargs={**MLP, "dropout": 0.5}))
    assert dropout.status == "inherently_non_equivalent"
    assert any("Dropout" in reason and "p=0.5" in reason for reason in dropout.inherent)
    assert "Inherently not equivalent" in dropout.message()

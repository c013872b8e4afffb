"""A mismatch says what it is in words: NaN named, no update, k x the update, the worst element."""

from __future__ import annotations

import math

import torch

import equiv
from equiv.zoo.bugs import BUGS

TOY = equiv.Case(
    batch_size=8,
    micro_batch_sizes=(1, 3, 4),
    model="scalar_linear",
    data="toy_2x",
    optimizer_kwargs={"lr": 0.02},
    steps=1,
)


def no_step(model, optimizer, micro_batches, loss_fn):  # type: ignore[no-untyped-def]
    for inputs, targets in micro_batches:
        loss_fn(model(inputs), targets).backward()


def nan_gradients(model, optimizer, micro_batches, loss_fn):  # type: ignore[no-untyped-def]
    optimizer.zero_grad()
    for inputs, targets in micro_batches:
        (loss_fn(model(inputs), targets) * float("nan")).backward()
    optimizer.step()


def test_a_mean_of_means_reads_as_an_update_of_the_wrong_size_with_the_worst_element() -> None:
    first = equiv.check(BUGS["mean_of_means"], TOY).first_mismatch
    assert first is not None
    # w = 2.04 after the full batch, 1.444 after the mean of the 1 + 3 + 4 micro-batch means.
    assert math.isclose(first.expected, 2.04, rel_tol=1e-12)
    assert math.isclose(first.actual, 1.0 + 4 / 9, rel_tol=1e-12)
    assert math.isclose(first.update_ratio, (1 + 4 / 9) / 2.04, rel_tol=1e-12) and first.cosine == 1.0
    text = first.describe()
    assert "At index (0, 0): full-batch update 2.04, the candidate's 1.44444" in text
    assert "The update is 0.7081 x the full-batch update along it, cosine 1.0000" in text


def test_a_step_that_never_steps_is_told_it_made_no_update() -> None:
    message = equiv.check(no_step, TOY).message()
    assert "No update: the candidate did not move this parameter (is optimizer.step() called" in message


def test_nan_is_named_with_where_it_first_appears() -> None:
    first = equiv.check(nan_gradients, TOY).first_mismatch
    assert first is not None and first.nan_count == 1 and first.first_not_finite == (0, 0)
    message = first.describe()
    assert "Not finite: 1 NaN in the update of 'weight' of the candidate, the first at index (0, 0)" in message
    assert "1.798e+308" not in message  # an infinite relative difference reads as inf, not as the largest float


def test_a_correct_step_shows_no_diagnosis_and_state_rows_have_no_update_ratio() -> None:
    verdict = equiv.check(
        BUGS["unscaled_sum"],
        equiv.Case(batch_size=4, micro_batch_sizes=(2, 2), optimizer="Adam", optimizer_kwargs={"lr": 1e-3}),
    )
    state_rows = [d for d in verdict.mismatches if d.quantity == "state"]
    assert state_rows and all(math.isnan(d.update_ratio) for d in state_rows)
    assert equiv.check(equiv.accumulator_step, TOY)
    assert torch.get_default_dtype() == torch.float32  # the precision re-run put it back


def test_the_reproduce_line_runs_as_printed_after_import_equiv() -> None:
    message = equiv.check(BUGS["mean_of_means"], TOY).message()
    line = next(text for text in message.splitlines() if text.startswith("Reproduce: ")).removeprefix("Reproduce: ")
    assert line.startswith("equiv.check(mean_of_means, equiv.Case(")
    replayed = eval(line, {"equiv": equiv, "mean_of_means": BUGS["mean_of_means"]})
    assert replayed.message() == message


def replaces_a_parameter(model, optimizer, micro_batches, loss_fn):  # type: ignore[no-untyped-def]
    model.weight = torch.nn.Parameter(model.weight.detach().clone())
    equiv.accumulator_step(model, optimizer, micro_batches, loss_fn)


def casts_to_half(model, optimizer, micro_batches, loss_fn):  # type: ignore[no-untyped-def]
    equiv.accumulator_step(model, optimizer, micro_batches, loss_fn)
    model.to(torch.float16)


def test_a_replaced_parameter_and_a_dtype_change_are_named() -> None:
    replaced = equiv.check(replaces_a_parameter, TOY)
    assert "Note: the step replaced parameter 'weight' with a new tensor: the optimizer no longer holds it" in (
        replaced.message()
    )
    cast = equiv.check(casts_to_half, TOY)
    assert "Note: the step changed the dtype of 'weight' from float64 to float16" in cast.message()
    assert not equiv.check(equiv.accumulator_step, TOY).notes


def steps_twice(model, optimizer, micro_batches, loss_fn):  # type: ignore[no-untyped-def]
    optimizer.zero_grad()
    total = sum(len(targets) for _, targets in micro_batches)
    for inputs, targets in micro_batches:
        (loss_fn(model(inputs), targets) * len(targets) / total).backward()
    optimizer.step()
    optimizer.step()  # again, on the same gradients


def test_an_optimizer_stepped_twice_is_named_as_a_whole_multiple() -> None:
    for optimizer, kwargs in (("SGD", {"lr": 0.02}), ("Adam", {"lr": 1e-3})):
        message = equiv.check(steps_twice, TOY.replace(optimizer=optimizer, optimizer_kwargs=kwargs)).message()
        assert "Likely: 2 x the full-batch update in its direction: optimizer.step() called 2 times" in message, message
        assert "(this window has 3 micro-batches)" in message
    adam = equiv.check(steps_twice, TOY.replace(optimizer="Adam", optimizer_kwargs={"lr": 1e-3})).message()
    assert "Optimizer steps counted (weight:step): the candidate's 2, the full batch's 1 after step 1" in adam


def test_a_sum_never_divided_and_a_mean_divided_again_name_the_micro_batch_count() -> None:
    even = TOY.replace(micro_batch_sizes=(4, 4))
    summed = equiv.check(BUGS["unscaled_sum"], even).message()
    assert "Likely: 2 x the full-batch update in its direction" in summed
    assert "the loss summed over the window's 2 micro-batches and never divided by 2" in summed
    halved = equiv.check(BUGS["divides_twice"], even).message()
    assert "Likely: 1/2 of the full-batch update in its direction: the window's micro-batch count" in halved


def test_a_mean_of_uneven_means_is_not_called_a_multiple() -> None:
    assert "Likely:" not in equiv.check(BUGS["mean_of_means"], TOY).message()

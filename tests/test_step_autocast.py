"""A step that runs its own forward under ``torch.autocast`` is judged in that precision.

The check reads the autocast in force where the step calls its model (as the audit does per
forward) and judges each case as ``Case(autocast=...)`` would: the full-batch reference and its
floors under the same autocast.  A correct step passes, a wrongly weighted one still fails; an
explicit case autocast the step contradicts is not applicable, in one line.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings

import equiv
from equiv.cases.standard import STANDARD_CASES
from equiv.checking.search_space import SearchSpace
from equiv.cli import main

UNEVEN = STANDARD_CASES["Adam, uneven 1+2"]


def bfloat16_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, micro_batches: Any, loss_fn: Any) -> None:
    """Correct accumulation, forward and loss under bfloat16 autocast (the AMP recipe on the CPU)."""
    optimizer.zero_grad()
    total = sum(loss_fn.count(targets) for _, targets in micro_batches)
    for inputs, targets in micro_batches:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_fn.sum(model(inputs), targets) / total
        loss.backward()
    optimizer.step()


def bfloat16_mean_of_means(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, micro_batches: Any, loss_fn: Any
) -> None:
    """The textbook bug (each micro-batch's mean divided by their count) under bfloat16 autocast."""
    optimizer.zero_grad()
    for inputs, targets in micro_batches:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_fn(model(inputs), targets) / len(micro_batches)
        loss.backward()
    optimizer.step()


def test_a_correct_autocast_step_passes_every_standard_case() -> None:
    verdicts = equiv.check(bfloat16_step)
    applicable = [v for v in verdicts.verdicts.values() if v.status is not equiv.Outcome.NOT_APPLICABLE]
    assert len(applicable) == 14
    assert not verdicts.failed and not verdicts.errors, verdicts.message()
    assert all(v.case.autocast == "bfloat16" for v in applicable)
    assert all(
        any("torch.autocast(bfloat16): judged in that precision" in note for note in v.notes) for v in applicable
    )
    assert "the step's own torch.autocast(bfloat16)" in verdicts.summary()


def test_the_textbook_bug_under_autocast_still_fails_as_a_mean_of_means() -> None:
    verdict = equiv.check(bfloat16_mean_of_means, UNEVEN)
    assert verdict.status is equiv.Outcome.NOT_EQUIVALENT
    assert verdict.failure_kind is not None and verdict.failure_kind.name == "mean of means", verdict.message()
    assert "judged in that precision" in verdict.message()
    assert verdict.case.autocast == "bfloat16"  # its reproduce line judges it the same way


def test_the_case_autocast_the_step_contradicts_is_not_applicable_in_one_line() -> None:
    verdict = equiv.check(bfloat16_step, dataclasses.replace(UNEVEN, autocast="float16"))
    assert verdict.status is equiv.Outcome.NOT_APPLICABLE
    (reason,) = verdict.not_applicable
    assert "torch.autocast(bfloat16)" in reason and "autocast='float16'" in reason
    # The same autocast as the step's: judged as it is, nothing to say.
    same = equiv.check(bfloat16_step, dataclasses.replace(UNEVEN, autocast="bfloat16"))
    assert same and same.notes == ()


def test_a_step_without_autocast_is_judged_as_before() -> None:
    verdict = equiv.check(equiv.accumulator_step, UNEVEN)
    assert verdict and verdict.case.autocast is None and verdict.notes == ()
    assert equiv.check(equiv.accumulator_step).setting == ""


def test_the_search_judges_every_drawn_case_in_the_steps_autocast() -> None:
    assert not equiv.verify(bfloat16_step, max_examples=8, seed=0, replay_in_fresh_process=False).found
    found = equiv.verify(bfloat16_mean_of_means, max_examples=30, seed=0, replay_in_fresh_process=False)
    assert found.found and found.verdict is not None and found.verdict.case.autocast == "bfloat16"


@settings(max_examples=5, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(equiv.strategies.cases_for(bfloat16_step))
def test_your_own_given_tests_judge_each_case_in_the_steps_autocast(case: equiv.Case) -> None:
    verdict = equiv.check(bfloat16_step, case)
    assert verdict, verdict.message()
    assert verdict.case.autocast == "bfloat16"


def test_search_space_autocast_applies_to_every_drawn_case() -> None:
    space = SearchSpace(autocast=torch.bfloat16)
    assert space.autocast == "bfloat16" and "--autocast bfloat16" in space.flags()
    result = equiv.verify(bfloat16_step, space, max_examples=5, seed=0, replay_in_fresh_process=False)
    assert not result.found
    with pytest.raises(Exception, match="autocast must be one of"):
        SearchSpace(autocast="float32")


def test_cli_autocast_flag(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    step_file = tmp_path / "amp_step.py"
    step_file.write_text(
        "import torch\n"
        "def step(model, optimizer, micro_batches, loss_fn):\n"
        "    optimizer.zero_grad()\n"
        "    total = sum(loss_fn.count(t) for _, t in micro_batches)\n"
        "    for x, t in micro_batches:\n"
        "        with torch.autocast('cpu', dtype=torch.bfloat16):\n"
        "            loss = loss_fn.sum(model(x), t) / total\n"
        "        loss.backward()\n"
        "    optimizer.step()\n"
    )
    case = '{"batch_size": 3, "micro_batch_sizes": [1, 2], "optimizer": "Adam", "optimizer_kwargs": {"lr": 0.01}}'
    assert main(["check", f"{step_file}:step", "--case", case, "--autocast", "bfloat16"]) == 0
    assert main(["check", f"{step_file}:step", "--case", case]) == 0
    assert "judged under the step's own torch.autocast(bfloat16)" in capsys.readouterr().out
    main(["check", f"{step_file}:step", "--case", case, "--autocast", "float16"])
    assert "runs its forward under torch.autocast(bfloat16) itself" in capsys.readouterr().out


def forward_set_under_autocast(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, micro_batches: Any, loss_fn: Any
) -> None:
    """The autocast entered inside the model's forward, set on the instance (as accelerate's prepare() does)."""
    if "forward" not in model.__dict__:
        model.forward = torch.autocast("cpu", dtype=torch.bfloat16)(model.forward)  # type: ignore[method-assign]
    optimizer.zero_grad()
    total = sum(loss_fn.count(targets) for _, targets in micro_batches)
    for inputs, targets in micro_batches:
        (loss_fn.sum(model(inputs).float(), targets) / total).backward()
    optimizer.step()


def accelerate_bf16_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, micro_batches: Any, loss_fn: Any
) -> None:
    """accelerate's bfloat16 mixed precision on the CPU: prepare() wraps the model's forward in autocast."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    accelerator = Accelerator(mixed_precision="bf16", cpu=True)
    prepared_model, prepared_optimizer = accelerator.prepare(model, optimizer)
    prepared_optimizer.zero_grad()
    total = sum(loss_fn.count(targets) for _, targets in micro_batches)
    for inputs, targets in micro_batches:
        accelerator.backward(loss_fn.sum(prepared_model(inputs), targets) / total)
    prepared_optimizer.step()


@pytest.mark.parametrize(
    "step",
    [forward_set_under_autocast, pytest.param(accelerate_bf16_step, marks=pytest.mark.peers("accelerate"))],
    ids=["instance", "accelerate"],
)
def test_an_autocast_the_models_forward_enters_is_seen_too(step: Any) -> None:
    verdict = equiv.check(step, UNEVEN)
    assert verdict, verdict.message()
    assert verdict.case.autocast == "bfloat16"

"""Quality of the search where it used to be blind: more than 8 micro-batches,
several parameter groups, frozen layers, coupled weight decay; and a step that
keeps state across calls (exact for any one case alone).

Each blind-spot bug of the zoo is exact unless its setting is drawn, so the
default search must reach that setting to FIND it, and shrink to a case that
still has it.  Correct steps of every such shape must never be flagged.
Searches run under the loaded Hypothesis profile (ci: derandomized).
"""

from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, note, settings
from search_claims import assert_found_and_shrunk
from torch import nn

import equiv
from equiv import strategies as eqst
from equiv.cases.case import PARAM_GROUPS
from equiv.checking.verify import verify
from equiv.losses import item_count, loss_sum_and_count
from equiv.zoo.bugs import BLIND_SPOT_BUGS, BUGS, caches_item_count, forget_item_count

COUPLED = ("SGD", "Adam", "Adamax", "NAdam", "RAdam", "RMSprop", "Adagrad", "Adadelta", "ASGD")


def coupled_decay(case: equiv.Case) -> bool:
    """Weight decay > 0 that is an L2 term in the gradient."""
    kwargs = case.optimizer_kwargs
    return (
        case.optimizer in COUPLED
        and kwargs.get("weight_decay", 0.0) > 0
        and not kwargs.get("decoupled_weight_decay", False)
    )


#: bug -> what its shrunk counterexample must have (the setting that exposes it).
SHRUNK: dict[str, Callable[[equiv.Case], bool]] = {
    # A ring of 8 slots loses micro-batches from the 9th on: the fewest that show it are 9.
    "eight_slot_buffer": lambda c: len(c.micro_batch_sizes) == 9,
    # Two groups and a clip norm the gradient exceeds.
    "clips_first_group_only": lambda c: (
        c.param_groups in PARAM_GROUPS and c.max_grad_norm is not None and c.max_grad_norm <= 1e-2
    ),
    "zero_grads_for_frozen": lambda c: c.frozen_layers != 0,
    # A group parked at lr = 0 (still requiring grad) and a clip norm the gradient exceeds.
    "clips_only_trained_groups": lambda c: (
        c.param_groups == "parked" and c.max_grad_norm is not None and c.max_grad_norm <= 1e-2
    ),
    # A frozen layer with a trainable one below it: a layer index, not a frozen bottom.
    "no_grad_through_frozen": lambda c: isinstance(c.frozen_layers, tuple),
    # Coupled decay counted once per micro-batch: two micro-batches are enough.
    "decay_per_micro_batch": lambda c: coupled_decay(c) and len(c.micro_batch_sizes) == 2,
}


def test_every_blind_spot_bug_has_a_shrink_claim() -> None:
    assert set(SHRUNK) == set(BLIND_SPOT_BUGS)


@pytest.mark.parametrize("name", sorted(BLIND_SPOT_BUGS))
def test_default_search_finds_and_shrinks_a_counterexample_to(name: str) -> None:
    # The default search: nothing restricted, so the setting must come from the strategies' own draws
    # (the fresh-process replay is the state-across-calls test's subject).
    assert_found_and_shrunk(name, BUGS[name], SHRUNK[name], without=lambda case: without_setting(name, case))


def without_setting(name: str, case: equiv.Case) -> equiv.Case:
    if name == "eight_slot_buffer":  # the same samples in 8 micro-batches
        sizes = case.micro_batch_sizes
        return case.replace(micro_batch_sizes=[*sizes[:7], sum(sizes[7:])])
    if name == "clips_first_group_only":
        return case.replace(param_groups=None)
    if name in ("zero_grads_for_frozen", "no_grad_through_frozen"):
        return case.replace(frozen_layers=0)
    if name == "clips_only_trained_groups":
        return case.replace(param_groups=None)
    return case.replace(micro_batch_sizes=[case.batch_size])  # decay_per_micro_batch: one micro-batch


def test_a_step_that_keeps_state_across_calls_is_found_and_told_so() -> None:
    # caches_item_count divides by the item count of the first window it ever
    # saw: any one case alone is exact, so only the calls before a case expose it.
    forget_item_count()
    try:
        result = verify(caches_item_count)
    finally:
        forget_item_count()
    assert result.found, f"no counterexample in {result.examples} cases"
    assert result.verdict is not None and result.verdict.status == "not_equivalent", result.message()
    assert result.state_across_calls is True, result.fresh_replay
    message = result.message("equiv.zoo.bugs:caches_item_count")
    assert "fails only after earlier calls: your step keeps state across calls" in message
    # No one-case replay is offered: alone, the case passes.
    assert "this case:" not in message and "--reproduce" not in message, message
    assert "this search: equiv verify equiv.zoo.bugs:caches_item_count" in message
    # As in the fresh process, the shrunk case with an empty cache is exact here too.
    try:
        equiv.check(caches_item_count, result.counterexample).assert_ok()
    finally:
        forget_item_count()


def correct_loop(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: list,
    loss_fn: Any,
    *,
    max_grad_norm: float | None = None,
    scheduler: Any | None = None,
) -> None:
    """A hand-written correct step, not the Accumulator: each micro-batch's
    summed loss over the window's item count (counted up front), one clip over
    the parameters that have gradients, one step, one scheduler step."""
    optimizer.zero_grad(set_to_none=True)
    total = sum(item_count(loss_fn, targets) for _, targets in micro_batches)
    for inputs, targets in micro_batches:
        loss_sum, _ = loss_sum_and_count(loss_fn, model(inputs), targets)
        (loss_sum / total).backward()
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], max_grad_norm)
    optimizer.step()
    if scheduler is not None:
        scheduler.step()


def assert_correct_steps_pass(case: equiv.Case) -> None:
    """The reference accumulator and a hand-written correct loop, both equivalent on ``case``."""
    for step in (equiv.accumulator_step, correct_loop):
        verdict = equiv.check(step, case)
        note(verdict.message())
        verdict.assert_ok()


# Every unusual shape at once, so each example covers them all: more than 8
# micro-batches, two groups (one of them parked at lr = 0), frozen layers
# anywhere, every optimizer (decay drawn for each), schedulers, token losses.
# (The default search of the reference, in test_quality_bug_zoo.py, covers
# them mixed with the rest.)
UNUSUAL = eqst.cases(
    min_micro_batches=eqst.FEW_MICRO_BATCHES + 1,
    param_groups=list(PARAM_GROUPS),
    frozen_layers=[f for f in eqst.FROZEN_LAYERS if f != 0],
    schedulers=list(eqst.SCHEDULERS),
    item_weighted=True,
)


@given(UNUSUAL)
@settings(max_examples=20)
def test_correct_steps_of_every_unusual_shape_are_never_flagged(case: equiv.Case) -> None:
    assert_correct_steps_pass(case)


# Two micro-batches or more under coupled weight decay: where decay_per_micro_batch fails.
COUPLED_DECAY = eqst.cases(min_micro_batches=2, optimizer_names=list(COUPLED)).filter(coupled_decay)


@given(COUPLED_DECAY)
@settings(max_examples=10)
def test_correct_steps_under_coupled_weight_decay_are_never_flagged(case: equiv.Case) -> None:
    assert_correct_steps_pass(case)


# Muon: its Newton-Schulz iteration rounds in bfloat16 even in the float64 run; the
# floor samples round the same way, so correct steps pass both tiers ...
@given(eqst.cases(optimizer_names=["Muon"], families=["mlp"]))
@settings(max_examples=20)
def test_correct_steps_under_muon_are_never_flagged(case: equiv.Case) -> None:
    assert_correct_steps_pass(case)


# ... and orthogonalising each micro-batch's gradient (a step per micro-batch) is found and shrunk.
def test_per_micro_batch_orthogonalisation_under_muon_is_found() -> None:
    from equiv.checking.search_space import SearchSpace

    result = verify(BUGS["step_per_micro_batch"], SearchSpace(optimizers=("Muon",)), replay_in_fresh_process=False)
    assert result.found and result.verdict is not None and result.verdict.status == "not_equivalent"
    case = result.counterexample
    assert case is not None and case.optimizer == "Muon" and len(case.micro_batch_sizes) == 2, case

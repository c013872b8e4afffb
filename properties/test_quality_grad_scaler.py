"""Quality of the search under dynamic loss scaling (torch.amp.GradScaler):
the default search of a step that takes a ``grad_scaler`` FINDS each
GradScaler bug of the zoo and shrinks it to a case that still has the setting
that exposes it, and no correct scaled step (the reference accumulator, or a
hand-written loop following PyTorch's AMP examples) is ever flagged, whatever
the scale, its growth, the overflowing window, clipping and scheduler.

Each GradScaler bug is exact without its setting (no loss scale, no clipping,
no overflow), so the search must draw it.  Searches run under the loaded
Hypothesis profile (ci: derandomized).
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
from equiv.losses import item_count, loss_sum_and_count
from equiv.zoo.bugs import BUGS, GRAD_SCALER_BUGS


def overflow_before_the_last_window(case: equiv.Case) -> bool:
    return case.overflow_at is not None and case.overflow_at[0] < case.steps - 1


#: bug -> what its shrunk counterexample must have (the setting that exposes it).
SHRUNK: dict[str, Callable[[equiv.Case], bool]] = {
    # Divided by the scale twice: any scale above 1 shows, even the smallest drawn (2).
    "unscales_twice": lambda c: c.loss_scale is not None and c.loss_scale > 1 and c.overflow_at is None,
    # The scaled norm is compared with the clip norm: needs clipping that bites, and a scale.
    "clips_before_unscaling": lambda c: (
        c.loss_scale is not None and c.max_grad_norm is not None and c.max_grad_norm <= 1e-2 and c.overflow_at is None
    ),
    # Only a window that overflows tells a per-micro-batch check from the window's.
    "skips_overflowing_micro_batch": lambda c: c.overflow_at is not None,
    # A skipped window followed by another, and the simplest scheduler that moves the lr.
    "scheduler_steps_on_skipped_window": lambda c: overflow_before_the_last_window(c) and c.scheduler == "StepLR",
}


def test_every_grad_scaler_bug_has_a_shrink_claim() -> None:
    assert set(SHRUNK) == set(GRAD_SCALER_BUGS) and set(GRAD_SCALER_BUGS) <= set(BUGS)


@pytest.mark.parametrize("name", sorted(GRAD_SCALER_BUGS))
def test_default_search_finds_and_shrinks_a_counterexample_to(name: str) -> None:
    # The default search: the loss scale, overflow and growth come from the strategies' own draws
    # for a step that takes a grad_scaler.
    assert_found_and_shrunk(name, BUGS[name], SHRUNK[name], without=lambda case: without_setting(name, case))


def without_setting(name: str, case: equiv.Case) -> equiv.Case:
    if name == "clips_before_unscaling":
        return case.replace(max_grad_norm=None)
    if name in ("skips_overflowing_micro_batch", "scheduler_steps_on_skipped_window"):
        return case.replace(overflow_at=None)
    return case.replace(loss_scale=None, overflow_at=None, scale_growth_interval=None)  # unscales_twice


def correct_scaled_loop(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: list,
    loss_fn: Any,
    *,
    max_grad_norm: float | None = None,
    scheduler: Any | None = None,
    grad_scaler: torch.amp.GradScaler | None = None,
) -> None:
    """A hand-written correct step, not the Accumulator, as PyTorch's AMP examples
    write accumulation: each micro-batch's scaled loss (summed over the window's
    item count), then once per window unscale, clip, ``scaler.step`` (skipped on
    an overflow), ``scaler.update``, and the scheduler only if the optimizer stepped."""
    optimizer.zero_grad(set_to_none=True)
    total = sum(item_count(loss_fn, targets) for _, targets in micro_batches)
    for inputs, targets in micro_batches:
        loss_sum, _ = loss_sum_and_count(loss_fn, model(inputs), targets)
        loss = loss_sum / total
        (grad_scaler.scale(loss) if grad_scaler is not None else loss).backward()
    if grad_scaler is not None:
        grad_scaler.unscale_(optimizer)
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], max_grad_norm)
    if grad_scaler is None:
        optimizer.step()
        stepped = True
    else:
        grad_scaler.step(optimizer)
        # The forums' idiom: update() lowers the scale exactly when step() skipped the window.
        scale_before = grad_scaler.get_scale()
        grad_scaler.update()
        stepped = grad_scaler.get_scale() >= scale_before
    if scheduler is not None and stepped:
        scheduler.step()


# Always scaled, every scheduler kind, clipping regimes drawn: where the bugs above live.
SCALED = eqst.cases(loss_scaling=["dynamic", "overflow"], schedulers=list(eqst.SCHEDULERS))


@given(SCALED)
@settings(max_examples=30)
def test_correct_scaled_steps_are_never_flagged(case: equiv.Case) -> None:
    for step in (equiv.accumulator_step, correct_scaled_loop):
        verdict = equiv.check(step, case)
        note(verdict.message())
        verdict.assert_ok()

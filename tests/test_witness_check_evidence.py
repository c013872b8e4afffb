"""``equiv check``'s witness says which explanation a residual past naming supports, from the step's own evidence
(issue 44): the clip calls made during the failing step (counted against its backward passes) and a refit of G
on every row's gradient of the case's loss.  One hand-written candidate per explanation (each tensor clipped per
micro-batch, the running gradient clipped after each micro-batch, a loss other than the case's, a weighting of
rows inside micro-batches), each asserting its clause names that explanation and none of the others; the same
decision as the audit's (:func:`equiv.judging.witness.explained`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

import equiv
from equiv.cases.standard import STANDARD_CASES
from equiv.results.witness import CLIPPED_EACH, NOT_A_REWEIGHTING, Witness
from equiv.zoo import bugs
from tests.test_witness_check import TOKENS, UNEVEN  # sequences of different real-token counts, several to a batch
from tests.test_witness_residual import _says_only  # each clause names its explanation and none of the others

Backward = Callable[[nn.Module, Tensor, Tensor, Any, float], None]  # model, inputs, targets, loss_fn, step's items


def _stepping(backward: Backward, *, clip_after: float | None = None) -> Callable[..., None]:
    """A step calling ``backward`` on each micro-batch, then (``clip_after``) clipping once by that norm."""

    def step(model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: Any, loss_fn: Any) -> None:
        optimizer.zero_grad(set_to_none=True)
        items = sum(float(loss_fn.count(targets)) for _, targets in micro_batches)
        for inputs, targets in micro_batches:
            backward(model, inputs, targets, loss_fn, items)
        if clip_after is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip_after)
        optimizer.step()

    return step


def _witness(step: Callable[..., None], case: equiv.Case) -> Witness:
    verdict = equiv.check(step, case)
    assert not verdict, verdict.line()
    assert verdict.witness is not None, verdict.message()
    assert verdict.witness.clause() in verdict.line()  # the line a user reads says it
    return verdict.witness


def _summed(model: nn.Module, inputs: Tensor, targets: Tensor, loss_fn: Any, items: float) -> None:
    """The case's loss, each micro-batch's sum over the step's items: the full batch's gradient."""
    (loss_fn.sum(model(inputs), targets) / items).backward()


def test_each_tensor_clipped_per_micro_batch_is_said_from_the_clip_calls_between_backwards() -> None:
    def backward(model: nn.Module, inputs: Tensor, targets: Tensor, loss_fn: Any, items: float) -> None:
        _summed(model, inputs, targets, loss_fn, items)
        for parameter in model.parameters():  # a per-tensor clip of the partial gradient: no re-weighting
            torch.nn.utils.clip_grad_norm_([parameter], 0.01)

    found = _witness(_stepping(backward), UNEVEN)
    assert found.normaliser == NOT_A_REWEIGHTING
    _says_only(found, "clipped per micro-batch")


def test_the_running_gradient_clipped_after_each_micro_batch_is_named_from_the_clip_calls() -> None:
    # transformers #986 (the zoo's bug): a re-weighting no normaliser explains, named from the clip calls
    verdict = equiv.check(bugs.clip_per_micro_batch, STANDARD_CASES["SGD, active clipping 3+5"])
    assert not verdict and verdict.witness is not None
    assert verdict.witness.normaliser == CLIPPED_EACH and verdict.witness.residual < 0.05
    _says_only(verdict.witness, "clipped after each micro-batch")
    assert verdict.failure_kind is not None and verdict.failure_kind.name == CLIPPED_EACH  # one answer


def test_clipped_by_value_after_each_micro_batch_is_said_from_the_torch_nn_utils_clip_grad_function() -> None:
    def backward(model: nn.Module, inputs: Tensor, targets: Tensor, loss_fn: Any, items: float) -> None:
        _summed(model, inputs, targets, loss_fn, items)
        torch.nn.utils.clip_grad.clip_grad_value_(model.parameters(), clip_value=1e-3)  # the module's own name

    found = _witness(_stepping(backward), UNEVEN)
    assert found.normaliser == NOT_A_REWEIGHTING
    _says_only(found, "clipped per micro-batch")
    assert "clip_grad_value_" in found.clause()


def _brier(model: nn.Module, inputs: Tensor, targets: Tensor, loss_fn: Any, items: float) -> None:
    """A Brier score on the real tokens instead of the case's cross-entropy."""
    logits = model(inputs)
    kept = targets != loss_fn.ignore_index
    wanted = torch.nn.functional.one_hot(targets[kept], logits.shape[-1]).to(logits.dtype)
    ((logits[kept].softmax(-1) - wanted).square().sum() / items).backward()


def test_a_loss_other_than_the_case_s_is_said_with_no_clip_call_between_backwards() -> None:
    # clipped once, after the last backward (a limit no gradient here reaches): no clip between micro-batches
    found = _witness(_stepping(_brier, clip_after=1e6), TOKENS)
    assert found.normaliser == NOT_A_REWEIGHTING
    _says_only(found, "another loss")
    assert "no clip call was recorded between micro-batches" in found.clause()


def test_a_weighting_of_rows_inside_micro_batches_is_said_from_the_rows_refit() -> None:
    # each sequence's token mean, the step's sequences averaged: every token weighted by its row's length
    def backward(model: nn.Module, inputs: Tensor, targets: Tensor, loss_fn: Any, items: float) -> None:
        output = model(inputs)
        rows = [
            loss_fn.sum(output[row : row + 1], targets[row : row + 1])
            / max(float(loss_fn.count(targets[row : row + 1])), 1.0)
            for row in range(targets.shape[0])
        ]
        (torch.stack(rows).sum() / TOKENS.batch_size).backward()

    found = _witness(_stepping(backward), TOKENS)
    assert found.normaliser == NOT_A_REWEIGHTING
    _says_only(found, "rows")


def test_the_check_puts_torch_s_clip_functions_back() -> None:
    before = (torch.nn.utils.clip_grad_norm_, torch.nn.utils.clip_grad.clip_grad_value_)
    equiv.check(bugs.clip_per_micro_batch, STANDARD_CASES["SGD, active clipping 3+5"])
    assert (torch.nn.utils.clip_grad_norm_, torch.nn.utils.clip_grad.clip_grad_value_) == before

"""A residual past naming says which explanation the recorded calls support (issue 44).

Hand-written audited loops, one per explanation: clipping per micro-batch (the clip calls the audit records between
micro-batches), the running gradient clipped after each micro-batch (transformers #986: a re-weighting, named from
the same clip calls), a loss other than the declared one (no clip call, and no re-weighting of the rows' gradients
explains it), and a weighting of rows inside micro-batches (a re-weighting of the rows' gradients does).  Each
asserts the clause names its explanation and none of the others.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import equiv
from equiv.auditing import audit
from equiv.auditing.runs import tiny_lm_and_optimizer, token_loader, windows
from equiv.judging.witness import Evidence, explained
from equiv.losses import NextTokenCrossEntropy
from equiv.results.witness import CLIPPED_EACH, NOT_A_REWEIGHTING, UNEXPLAINED, Witness

TOKENS = NextTokenCrossEntropy()
#: micro-batches of 2 sequences whose real-token counts differ within each micro-batch, in windows of 3
LENGTHS = [8, 2, 3, 8, 7, 1, 2, 6, 8, 3, 1, 5]

#: what each explanation's clause says, by explanation
SAYS = {
    "clipped per micro-batch": "clipped per micro-batch: ",
    "clipped after each micro-batch": "the running gradient clipped after each micro-batch",
    "another loss": "a loss other than the declared one",
    "rows": "a weighting of rows inside micro-batches",
}

Backward = Callable[[nn.Module, Tensor, Tensor, float], None]  # model, ids, labels, the window's items


def _run(backward: Backward) -> equiv.auditing.Audit:
    """A tiny LM trained in windows of 3 micro-batches, ``backward`` called on each; no clip told to the audit."""
    model, optimizer = tiny_lm_and_optimizer("SGD")
    with audit(model, optimizer, loss=TOKENS) as watched:
        for window in windows(token_loader(LENGTHS), 3):
            items = sum(float(TOKENS.count(labels)) for _, labels in window)
            for ids, labels in window:
                backward(model, ids, labels, items)
            optimizer.step()
            optimizer.zero_grad()
    return watched


def _witnesses(watched: equiv.auditing.Audit) -> list[Witness]:
    assert watched.failures, watched.summary()
    found = [window.witness for window in watched.failures]
    assert all(each is not None for each in found), watched.summary()
    return [each for each in found if each is not None]


def _says_only(found: Witness, explanation: str) -> None:
    clause = found.clause()
    assert SAYS[explanation] in clause, clause
    for other, words in SAYS.items():
        if other != explanation:
            assert words not in clause, clause


def _shifted(logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    return logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1)


def test_each_tensor_clipped_per_micro_batch_is_said_from_the_clip_calls_recorded_between_micro_batches() -> None:
    def backward(model: nn.Module, ids: Tensor, labels: Tensor, items: float) -> None:
        (TOKENS.sum(model(ids, labels), labels) / items).backward()
        for parameter in model.parameters():  # a per-tensor clip of the partial gradient: no re-weighting
            torch.nn.utils.clip_grad_norm_([parameter], 0.01)

    for found in _witnesses(_run(backward)):
        assert found.normaliser == NOT_A_REWEIGHTING
        _says_only(found, "clipped per micro-batch")


def test_the_running_gradient_clipped_after_each_micro_batch_is_named_from_the_clip_calls() -> None:
    # transformers #986: a re-weighting (earlier micro-batches clipped more often) that no normaliser explains;
    # the clip calls recorded between micro-batches name it
    def backward(model: nn.Module, ids: Tensor, labels: Tensor, items: float) -> None:
        (TOKENS.sum(model(ids, labels), labels) / items).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)

    for found in _witnesses(_run(backward)):
        assert found.normaliser == CLIPPED_EACH and found.residual < 0.05
        _says_only(found, "clipped after each micro-batch")


def test_a_loss_other_than_the_declared_one_is_said_with_no_clip_call_recorded() -> None:
    def backward(model: nn.Module, ids: Tensor, labels: Tensor, items: float) -> None:
        # a Brier score written by hand (a loss the audit cannot see called, so cannot refuse)
        logits, targets = _shifted(model(ids, labels), labels)
        kept = targets != -100
        wanted = F.one_hot(targets[kept], logits.shape[-1]).to(logits.dtype)
        ((logits[kept].softmax(-1) - wanted).square().sum() / items).backward()

    for found in _witnesses(_run(backward)):
        assert found.normaliser == NOT_A_REWEIGHTING
        _says_only(found, "another loss")
        assert "no clip call was recorded" in found.clause()


def test_a_weighting_of_rows_inside_micro_batches_is_said_from_the_rows_refit() -> None:
    # each sequence's token mean, the window's sequences averaged: every token weighted by its row's length
    def backward(model: nn.Module, ids: Tensor, labels: Tensor, items: float) -> None:
        logits = model(ids, labels)
        rows = [
            TOKENS.sum(logits[row : row + 1], labels[row : row + 1]) / TOKENS.count(labels[row : row + 1])
            for row in range(labels.shape[0])
        ]
        (torch.stack(rows).sum() / 6).backward()  # 6 sequences in a window

    for found in _witnesses(_run(backward)):
        assert found.normaliser == NOT_A_REWEIGHTING
        _says_only(found, "rows")


@pytest.mark.parametrize("clips", [None, ()])
def test_weights_no_normaliser_explains_stay_unexplained_without_a_clip_between_micro_batches(
    clips: tuple[tuple[str, int], ...] | None,
) -> None:
    found = Witness((0.5, 0.2), (0.25, 0.25), 1e-9, UNEXPLAINED, UNEXPLAINED, "", (2.0, 2.0))
    assert explained(found, Evidence(2, clips)) == found
    once = explained(found, Evidence(2, (("clip_grad_norm_", 2),)))  # clipped once, after the last: no evidence
    assert once == found

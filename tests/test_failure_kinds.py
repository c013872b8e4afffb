"""Every mathematical mismatch ``equiv.check`` finds names its kind: the known
wrong step it amounts to (the classifier the peers survey uses), or
"unclassified" when none fits, never the nearest guess; a step that passes
carries no kind."""

from __future__ import annotations

from typing import Any

import jsonschema
import pytest
import torch

import equiv
from equiv.cases.standard import STANDARD_CASES
from equiv.checking.failure_kinds import classify
from equiv.peers.catalogue import CONFIGURATIONS
from equiv.results.protocol import schema
from equiv.zoo.bugs import BUGS
from equiv.zoo.correct import CORRECT_STEPS
from equiv.zoo.kinds import KINDS

EVEN = CONFIGURATIONS["equal splits, SGD"]
UNEVEN = CONFIGURATIONS["uneven splits 1+4+7"]
CLIPPED = CONFIGURATIONS["clipping (active), equal splits"]


def never_steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, micro_batches: Any, loss_fn: Any) -> None:
    """Accumulates correctly and never calls optimizer.step(): a window with no optimizer step."""
    optimizer.zero_grad()
    total = sum(len(targets) for _, targets in micro_batches)
    for inputs, targets in micro_batches:
        (loss_fn(model(inputs), targets) * len(targets) / total).backward()


@pytest.mark.parametrize(
    ("step", "case", "kind"),
    [
        (BUGS["mean_of_means"], UNEVEN, "mean of means"),
        (BUGS["unscaled_sum"], EVEN, "sum without division"),
        (BUGS["clip_per_micro_batch"], CLIPPED, "per-micro-batch clipping"),
        (never_steps, EVEN, "window boundary"),
    ],
    ids=["mean_of_means", "unscaled_sum", "clip_per_micro_batch", "never_steps"],
)
def test_each_known_kind_is_named_in_the_verdict(step: Any, case: equiv.Case, kind: str) -> None:
    verdict = equiv.check(step, case)
    assert verdict.status is equiv.Outcome.NOT_EQUIVALENT
    assert verdict.failure_kind is not None and verdict.failure_kind.name == kind, verdict.message()
    assert verdict.failure_kind.also == ()
    assert f"Kind of failure: {kind}: " in verdict.message()
    written = verdict.to_dict()
    jsonschema.validate(written, schema())
    assert written["failure_kind"]["name"] == kind and written["failure_kind"]["means"]


def test_kinds_a_case_cannot_tell_apart_are_all_named() -> None:
    # Under active clipping a sum of means and a mean of means clip to the same update: both named.
    verdict = equiv.check(BUGS["unscaled_sum"], STANDARD_CASES["SGD, active clipping 3+5"])
    kind = verdict.failure_kind
    assert kind is not None and {kind.name, *kind.also} == {"mean of means", "sum without division"}
    assert "the same updates on this case" in verdict.message()


def test_a_mismatch_no_known_kind_reproduces_is_unclassified() -> None:
    verdict = equiv.check(BUGS["divides_twice"], UNEVEN)  # each micro-batch weighted right, then divided by N again
    assert verdict.status is equiv.Outcome.NOT_EQUIVALENT
    assert verdict.failure_kind is not None and not verdict.failure_kind.classified
    assert verdict.failure_kind.name == "unclassified"
    assert (
        "Kind of failure: unclassified (none of the known kinds (mean of means, sum without division"
        in verdict.message()
    )
    assert verdict.to_dict()["failure_kind"]["name"] == "unclassified"


def test_tail_divided_by_n_needs_a_configured_n() -> None:
    # One window per call has no N of its own but the window's count: a mean of means.
    verdict = equiv.check(BUGS["mean_of_means"], UNEVEN)
    tail = next(kind for kind in KINDS if kind.name == "tail divided by N")
    assert tail.needs_configured_n
    alone = classify(BUGS["mean_of_means"], UNEVEN, verdict)
    assert alone.failure is not None and alone.failure.name == "mean of means" and alone.also == ()
    # With N configured as the window's own count (3) the two are one step: both named.
    assert classify(BUGS["mean_of_means"], UNEVEN, verdict, configured_n=3).also == (tail,)


@pytest.mark.parametrize("name", sorted(CORRECT_STEPS))
def test_correct_steps_carry_no_kind(name: str) -> None:
    verdicts = equiv.check(CORRECT_STEPS[name])
    assert verdicts, verdicts.message()
    assert all(v.failure_kind is None for v in verdicts.verdicts.values())
    assert "Kind of failure" not in verdicts.message()


def test_a_verdict_made_without_details_or_a_passing_one_has_no_kind() -> None:
    assert equiv.check(equiv.accumulator_step, UNEVEN).failure_kind is None
    assert equiv.check(BUGS["mean_of_means"], UNEVEN, details=False).failure_kind is None  # a search's verdict


def clips_by_its_own_default(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: Any,
    loss_fn: Any,
    max_grad_norm: float | None = 1.0,
) -> None:
    """Correctly weighted and clipped once after accumulation, to its own default where none is passed."""
    optimizer.zero_grad()
    total = sum(loss_fn.count(targets) for _, targets in micro_batches)
    for inputs, targets in micro_batches:
        (loss_fn.sum(model(inputs), targets) / total).backward()
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()


def test_a_step_clipping_by_its_own_default_is_named_so() -> None:
    # The contract passes max_grad_norm only to a case that clips: this step then clips to its default 1.0,
    # which the full-batch step without clipping does not, on a case whose gradient norm is above 1.
    case = STANDARD_CASES["Adam, uneven 1+2"]
    assert case.max_grad_norm is None
    verdict = equiv.check(clips_by_its_own_default, case)
    assert verdict.status is equiv.Outcome.NOT_EQUIVALENT
    kind = verdict.failure_kind
    assert kind is not None and kind.name == "clipping by the step's default", verdict.message()
    assert "its own default max_grad_norm=1.0 where the case does not clip" in kind.means
    jsonschema.validate(verdict.to_dict(), schema())
    # Where the case clips, the step is given the case's norm and is the full-batch step clipped.
    assert equiv.check(clips_by_its_own_default, STANDARD_CASES["SGD, active clipping 3+5"])


def test_a_step_that_never_clips_is_never_called_a_clipping_kind() -> None:
    # Sample-weighted micro-batch means under a token loss: no clipping anywhere (the case clips nothing),
    # yet equiv's per-micro-batch clipping step, sample-weighted itself, made the same updates.
    case = STANDARD_CASES["Adam, token loss with padding 2+3"]
    assert case.max_grad_norm is None
    for name in ("sample_weighted_token_loss", "clip_per_micro_batch"):
        verdict = equiv.check(BUGS[name], case)
        assert verdict.status is equiv.Outcome.NOT_EQUIVALENT
        kind = verdict.failure_kind
        assert kind is not None
        assert "clipping" not in " ".join((kind.name, *kind.also)), (name, kind)

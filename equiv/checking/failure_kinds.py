"""The kind of a failing step's failure: which known wrong step it amounts to.

One classifier, for ``equiv check``'s verdicts (:func:`equiv.check` names the
kind of every mathematical mismatch it finds) and for the peers survey
(:func:`equiv.peers.runs.classify_step`).  A step is of a kind
(:data:`~equiv.zoo.kinds.KINDS`: mean of means, tail divided by N, sum without
division; per-micro-batch clipping) when the checker that failed it against
the full batch finds it equivalent to that kind's own step instead
(:mod:`equiv.judging.trajectories`: both tiers, the kind's step rounded in
three micro-batch orders as its floors); a step that never updates where the
full batch does is a window boundary (a step missing).  When none fits the
answer is "unclassified", never the nearest guess.

A kind is tried only where the step can have it: per-micro-batch clipping only
on a case that clips, for a step that takes ``max_grad_norm`` (is given the
norm).  A step whose signature defaults ``max_grad_norm`` to a number, on a case
that does not clip (the contract passes ``max_grad_norm`` only to a case that
clips), is tried against the full-batch step clipped to that default:
"clipping by the step's default".
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from equiv.cases.case import Case
from equiv.judging.contract import BoundCandidate, bind
from equiv.judging.judge import case_key
from equiv.judging.runs import Snapshot, run_candidate, run_reference
from equiv.judging.trajectories import (
    References,
    StepMagnitude,
    Trajectories,
    flat_params,
    magnitude,
    trajectory_verdict,
)
from equiv.results.verdict import FailureKind, TensorDiff, Verdict
from equiv.results.witness import Witness
from equiv.zoo.bugs import clip_per_micro_batch
from equiv.zoo.kinds import (
    FULL_BATCH,
    KINDS,
    NORMALISERS,
    ORDERS,
    PER_MICRO_BATCH_CLIPPING,
    WINDOW_BOUNDARY,
    Kind,
    exact_weights,
    weighted_step,
)

__all__ = ["Classification", "agreeing", "classify", "named_by"]


@dataclass(frozen=True)
class Classification:
    """A failing step's kind of failure, measured: the kind (None: unclassified), the first
    failing step's magnitude in float64 (None: the float64 run matches the full
    batch) and the checker's first row past its allowance there."""

    #: the kind of failure whose steps the run is equivalent to (None: unclassified)
    failure: Kind | None
    gap: StepMagnitude | None
    first: TensorDiff | None
    #: other kinds whose steps make the same updates on this case (e.g. under active
    #: clipping a sum of means and a mean of means clip to one update): named too, never dropped
    also: tuple[Kind, ...] = ()
    #: the kinds whose steps were run against this one (what "unclassified" rules out)
    tried: tuple[Kind, ...] = ()
    #: an unclassified step seen clipping by its own default where the case does not clip, in words
    own_clipping: str | None = None

    @property
    def kind(self) -> Kind | None:
        """The same as :attr:`failure`; kept for code written before it."""
        return self.failure

    def failure_kind(self) -> FailureKind:
        """The kind as a verdict carries it (name and meaning), "unclassified" saying why none fits."""
        if self.failure is not None:
            return FailureKind(self.failure.name, self.failure.means, also=tuple(other.name for other in self.also))
        if self.gap is None:
            return FailureKind.unclassified(
                "the float64 run matches the full batch: the difference is the working dtype's rounding past its "
                "floor (e.g. gradients accumulated in a lower precision), not a known kind of failure"
            )
        tried = ", ".join(suspect.name for suspect in (*self.tried, WINDOW_BOUNDARY))
        own = f"; {self.own_clipping}" if self.own_clipping is not None else ""
        return FailureKind.unclassified(f"none of the known kinds ({tried}) reproduces this step's updates{own}")


def _trajectories(case: Case, candidate: Callable[..., Any]) -> Trajectories:
    return Trajectories(
        run_candidate(case, candidate, torch.float64),
        run_candidate(case, candidate, case.working_dtype),
        case.working_dtype,
    )


def _own_clip_default(candidate: Callable[..., Any]) -> float | None:
    """The ``max_grad_norm`` a step's signature defaults to when it is a number (None: none, or no default)."""
    step = candidate.step if isinstance(candidate, BoundCandidate) else candidate
    try:
        parameter = inspect.signature(step).parameters.get("max_grad_norm")
    except (TypeError, ValueError):  # no signature to read (a builtin)
        return None
    default = None if parameter is None else parameter.default
    if isinstance(default, bool) or not isinstance(default, (int, float)) or not default > 0:
        return None
    return float(default)


def _default_clipping(limit: float) -> Kind:
    """The step's own default clip norm at work where the case asks for no clipping (the contract
    passes ``max_grad_norm`` only for a case that clips): correctly weighted otherwise."""
    return Kind(
        "clipping by the step's default",
        exact_weights,
        f"the step clips to its own default max_grad_norm={limit!r} where the case does not clip (equiv passes max_grad_norm only to a case that clips, as a loop without clipping passes none): the "
        "full-batch step without clipping differs; give max_grad_norm a default of None, or check with "
        f"a case that clips (Case(max_grad_norm={limit!r}))",
    )


def _own_clipping(limit: float) -> str:
    return f"the step's signature defaults max_grad_norm={limit!r}, which a case that does not clip never overrides"


def _clipped_at(limit: float, order: str) -> Callable[..., None]:
    """The full batch's weights, clipped once at ``limit`` whatever the case passes: a step clipping by its own default."""
    weighted = weighted_step(exact_weights, None, order)

    def step(
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        micro_batches: Any,
        loss_fn: Any,
        *,
        grad_scaler: torch.amp.GradScaler | None = None,
    ) -> None:
        weighted(model, optimizer, micro_batches, loss_fn, max_grad_norm=limit, grad_scaler=grad_scaler)

    return step


#: Suspects' references by (case, kind, N, own clip limit): a search meets a case again (its shrinking).
_SUSPECTS: dict[tuple[str, str, int | None, float | None], References] = {}
_SUSPECTS_KEPT = 64


def _suspect_references(
    case: Case, failure_kind: Kind, configured_n: int | None, own_limit: float | None = None
) -> References | None:
    """The references of one kind of failure on ``case`` (None when the suspect
    cannot take the case: per-micro-batch clipping under loss scaling).  ``own_limit``:
    the kind is a step clipping by its own default, to that norm.  Kept
    only for a case of names and numbers (:func:`~equiv.judging.judge.case_key`)."""
    key = case_key(case)
    cache_key = None if key is None else (key, failure_kind.name, configured_n, own_limit)
    if cache_key is not None and cache_key in _SUSPECTS:
        return _SUSPECTS[cache_key]
    if failure_kind is PER_MICRO_BATCH_CLIPPING:
        # Clipping after each micro-batch depends on their order: only the in-order rounding is this kind's.
        steps: dict[str, Callable[..., Any]] = {"in order": clip_per_micro_batch}
    elif own_limit is not None:
        steps = {order: _clipped_at(own_limit, order) for order in ORDERS}
    else:
        steps = {order: weighted_step(failure_kind.weights, configured_n, order) for order in ORDERS}
    if bind(steps["in order"]).not_applicable_reasons(case):
        return None

    def run(dtype: torch.dtype, order: str, on_snapshot: Callable[[int, Snapshot], None]) -> None:
        run_candidate(case, steps[order], dtype, on_snapshot=on_snapshot)

    references = References(run, case.working_dtype, orders=tuple(steps))
    if cache_key is not None:
        if len(_SUSPECTS) >= _SUSPECTS_KEPT:
            _SUSPECTS.clear()
        _SUSPECTS[cache_key] = references
    return references


def classify(
    candidate: Callable[..., Any], case: Case, verdict: Verdict, *, configured_n: int | None = None
) -> Classification:
    """The kind of failure of ``candidate`` on ``case``, whose verdict is ``verdict``.

    Args:
        candidate: the step (the candidate contract), already checked on ``case``.
        case: the case it failed.
        verdict: its :func:`equiv.check` verdict on ``case``.
        configured_n: the N a "tail divided by N" step divides by (None: each window's own count).

    Returns:
        A :class:`Classification`: no kind, no gap for a verdict without mismatches or
        with none in the exact tier (the float64 run matches); else the first failing
        step's magnitude and the kind (None: unclassified), with every other kind whose
        step makes the same updates on this case (``also``).
    """
    if verdict or not verdict.mismatches:
        return Classification(None, None, None)
    exact = [d for d in verdict.mismatches if d.tier == "exact"]
    if not exact:
        return Classification(None, None, verdict.first_mismatch)
    first = min(exact, key=lambda d: (d.step, d.quantity != "update"))
    trajectories = _trajectories(case, candidate)
    full = [flat_params(s.params) for s in run_reference(case, torch.float64)]
    gap = magnitude(first.step, trajectories.exact, full)
    if gap.scale == 0.0:
        return Classification(WINDOW_BOUNDARY, gap, first)
    # A kind is tried only where the step can have it.  Clipping: where the step is given a clip norm
    # (the case clips, the step takes max_grad_norm), or where its signature defaults one that the
    # case, clipping nothing, never overrides: the step then clips by its own default.
    bound = bind(candidate)
    own_limit = _own_clip_default(bound) if case.max_grad_norm is None else None
    suspects: list[tuple[Kind, float | None]] = []
    if own_limit is not None:
        suspects.append((_default_clipping(own_limit), own_limit))
    suspects += [(failure_kind, None) for failure_kind in KINDS]
    if case.max_grad_norm is not None and bound.takes("max_grad_norm"):
        suspects.append((PER_MICRO_BATCH_CLIPPING, None))
    matching, tried = [], []
    for failure_kind, limit in suspects:
        if failure_kind.needs_configured_n and configured_n is None:
            continue  # each window's own count as N: the mean of means, tried already
        references = _suspect_references(case, failure_kind, configured_n, limit)
        if references is None:
            continue  # the suspect cannot take the case
        tried.append(failure_kind)
        if trajectory_verdict(trajectories, references).equivalent:
            matching.append(failure_kind)
    if not matching:
        own = _own_clipping(own_limit) if own_limit is not None else None
        return Classification(None, gap, first, tried=tuple(tried), own_clipping=own)
    return Classification(matching[0], gap, first, also=tuple(matching[1:]), tried=tuple(tried))


def agreeing(failure: FailureKind, witness: Witness | None) -> tuple[FailureKind, Witness | None]:
    """The failure kind and the witness, made to say the same name (one classifier, never two answers).

    The witness names the weights of the first failing step from the table that holds :data:`KINDS` under
    their own names (:data:`~equiv.zoo.kinds.NORMALISERS`); the classifier runs each kind's whole trajectory,
    so where both name several kinds (under active clipping a sum of means and a mean of means clip to one
    update) the classifier's lead is the better-informed one and the witness names it first.  Where the
    witness names a kind the classifier found only as ``also``, that kind leads the failure kind.  Where the
    witness names a kind that no kind's trajectory reproduces (later steps differ), the kind stays unclassified
    and says so.  A witness that names no kind of :data:`KINDS` (the full batch up to a scale, not a
    re-weighting) leaves both as they were found.
    """
    if witness is None:
        return failure, None
    named = [name for name in witness.normaliser.split(" or ") if name in _KIND_NAMES]
    if not named:
        return failure, witness
    if failure.name in named:
        return failure, witness if named[0] == failure.name else _led_by(witness, failure.name)
    if failure.classified:
        matched = (failure.name, *failure.also)
        lead = next((name for name in named if name in matched), None)
        if lead is None:
            # the trajectories decide; the witness's clause still shows the first step's weights
            return failure, witness
        others = tuple(name for name in matched if name != lead)
        return FailureKind(lead, _KIND_NAMES[lead].means, also=others), _led_by(witness, lead)
    return (
        FailureKind.unclassified(
            f"{failure.means}; the first failing step's weights are the {named[0]}'s (the witness), but that kind's "
            "step does not reproduce every step"
        ),
        witness,
    )


def _led_by(witness: Witness, name: str) -> Witness:
    """``witness`` naming ``name`` first among the normalisers that fit its weights (its clause that one's)."""
    others = [other for other in witness.normaliser.split(" or ") if other != name]
    normaliser = next(n for n in NORMALISERS if n.name == name)
    clip = " (up to the clip's scale)" if "(up to the clip's scale)" in witness.means else ""
    same = f"; on this window the same weights as {', '.join(others)}" if others else ""
    return dataclasses.replace(
        witness,
        normaliser=" or ".join([name, *others]),
        means=normaliser.means + clip + same,
        formula=normaliser.formula,
    )


_KIND_NAMES = {kind.name: kind for kind in KINDS}


#: What each name means: equiv check's kinds with their upstream reports (as its verdicts say), the others the table's.
_MEANS = {n.name: n.means for n in NORMALISERS} | {kind.name: kind.means for kind in KINDS}


def named_by(witness: Witness) -> FailureKind:
    """The failure kind where no kind's trajectory is run (``check_distributed``, the pipeline check), named by
    the witness: the same names as ``equiv check``'s (its kinds under their own names and meanings, then the
    witness's other normalisers: a per-rank mean, a uniform scale), or unclassified saying what the weights are."""
    names = [name for name in witness.normaliser.split(" or ") if name.split(" x")[0] in _MEANS]
    if names and names[0] == FULL_BATCH.name:
        return FailureKind.unclassified(
            "the weights are the full batch's: the difference is not in how the micro-batches are weighted"
        )
    if not names:
        return FailureKind.unclassified(f"the weights are {witness.normaliser}")
    first = names[0]
    return FailureKind(first, _MEANS[first.split(" x")[0]], also=tuple(names[1:]))

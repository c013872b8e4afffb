"""The smallest counterexample of a peer, found and shrunk by Hypothesis.

A derandomized search over sample-mean MLP cases the peer can take, each judged
by :func:`equiv.check`, a failure of a given kind named by
:func:`equiv.peers.runs.classify_step` (the same checker).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hypothesis import Phase

from equiv.adapters.state import UnsupportedWindow
from equiv.cases import strategies
from equiv.cases.case import Case
from equiv.checking.check import check
from equiv.checking.search import Failure, SearchRun, run_search
from equiv.judging.contract import CandidateError, bind
from equiv.peers.runs import classify_step
from equiv.results.verdict import Verdict

__all__ = ["SEARCHABLE", "smallest_counterexample"]

#: The search's seed: the one Hypothesis 6.170's ``find`` derived for it when it
#: ran derandomized (a hash of ``find``'s own source), fixed here so that the
#: peers' report draws the same cases whatever Hypothesis's source is.
SEED = (
    30940899839763879844291713287377381294645450075011071936516685147311081814870735945650790444890835100610668459694799
)
#: Kinds a sample-mean MLP search can reach (tails and token counts are not in its space).
SEARCHABLE = ("mean of means", "sum without division", "per-micro-batch clipping", "window boundary")


def _search_space(candidate: Callable[..., Any]) -> Any:
    # Only cases the candidate can take: no clipping case for a step that cannot clip.
    clipping = strategies.CLIPPING if bind(candidate).takes("max_grad_norm") else ("none",)
    return strategies.cases(
        max_batch_size=8,
        families=["mlp"],
        optimizer_names=["SGD", "Adam"],
        loss_names=["mse"],
        dtypes=["float32"],
        max_steps=2,
        clipping=clipping,
    )


def smallest_counterexample(
    candidate: Callable[..., Any], *, failure: str | None = None, max_examples: int = 40
) -> tuple[Case | None, int]:
    """(the shrunk failing case or None, cases tried) over sample-mean MLP cases
    the candidate can take; with ``failure`` (a kind of failure's name), only failures of that kind.  Cases
    the ported framework refuses (:class:`UnsupportedWindow`) are not counted."""
    tried = 0

    def decide(case: Case) -> Failure[Verdict] | None:
        nonlocal tried
        try:
            verdict = check(candidate, case)
        except CandidateError as exc:
            if isinstance(exc.__cause__, UnsupportedWindow):
                return None  # the framework refuses this window (not counted): no counterexample
            raise
        tried += 1
        if verdict:
            return None
        if failure is None:
            return Failure(verdict=verdict)
        measured = classify_step(candidate, case, verdict=verdict)
        return Failure(verdict=verdict) if measured.gap is not None and measured.failure_name() == failure else None

    run = SearchRun(max_examples=max_examples, seed=SEED, phases=(Phase.generate, Phase.shrink))
    found = run_search(_search_space(candidate), decide, run)
    return found.example, tried

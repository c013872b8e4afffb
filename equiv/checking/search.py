"""The one search runner: Hypothesis over a strategy, one decision per example.

:func:`equiv.verify`, :func:`equiv.verify_distributed` and the peers' search
(:mod:`equiv.peers.search`) each build a strategy and a ``decide`` callable and call
:func:`run_search`; what a search meets is handled here, once:

- a failure (``decide`` returns a :class:`Failure`): Hypothesis shrinks it to
  the smallest example that still fails, which the outcome carries with the
  failure seen on it;
- a step that gave no verdict: the :class:`Failure` carries a
  :class:`~equiv.outcomes.Fault`.  ``Fault.HUNG`` ends the search at once with
  that example, not shrunk (each shrink step would wait out the time limit
  again); any other fault is shrunk like a failure.  Decided from the enum,
  never from an error's text;
- a flaky failure (it failed once, passed when Hypothesis replayed it): still
  a finding, the example that failed, flagged ``flaky``;
- an example that says nothing (``decide`` returns :data:`DISCARD`): rejected,
  never a finding; a search that could draw nothing else finds nothing;
- the settings (phases, example budget, seed, a reproduction blob to replay),
  progress after every example, the time spent judging, and Hypothesis's own
  report kept quiet (the caller says what was found, in its own terms).

Which examples are drawn depends only on the seed and on what ``decide``
returned for each, so a seeded search meets the same examples on every machine.
"""

from __future__ import annotations

import binascii
import contextlib
import re
import time
import warnings
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import hypothesis
from hypothesis import HealthCheck, Phase, given, reject, settings
from hypothesis.errors import DidNotReproduce, Flaky, InvalidArgument, Unsatisfiable
from hypothesis.reporting import with_reporter
from hypothesis.strategies import SearchStrategy

from equiv.outcomes import Fault

__all__ = ["DISCARD", "Decision", "Discard", "Failure", "Progress", "SearchOutcome", "SearchRun", "run_search"]

T = TypeVar("T")
V = TypeVar("V")

#: progress(examples judged so far, seconds elapsed)
Progress = Callable[[int, float], None]

_BLOB = re.compile(r"@reproduce_failure\('([^']+)', b'([^']+)'\)")


class Discard:
    """What ``decide`` returns for an example that says nothing (it cannot apply, or
    diverges on its own): rejected, never a finding."""

    def __repr__(self) -> str:
        return "DISCARD"


DISCARD = Discard()


@dataclass(frozen=True, slots=True)
class Failure(Generic[V]):
    """What ``decide`` returns for a failing example: the ``verdict`` that found it
    wanting, or the ``error`` of a step that gave none, with its ``fault``
    (:class:`~equiv.outcomes.Fault`) and ``traceback``."""

    verdict: V | None = None
    error: str | None = None
    traceback: str | None = None
    #: None: a verdict that is not equivalent; else how the step failed to give one.
    fault: Fault | None = None
    #: The exception that said so: Hypothesis tells failures apart by where they
    #: were raised (their context included), and shrinks each kind on its own.
    cause: BaseException | None = field(default=None, compare=False, repr=False)


#: What ``decide`` answers for one example: None (passed), DISCARD, or a Failure.
Decision = Failure[V] | Discard | None


@dataclass(frozen=True, kw_only=True)
class SearchRun:
    """How :func:`run_search` runs: the Hypothesis settings of one search."""

    max_examples: int
    #: Fixes the draws; None: Hypothesis's own (derandomized when ``derandomize``, else random).
    seed: int | None = None
    derandomize: bool = False
    phases: Sequence[Phase] = (Phase.explicit, Phase.generate, Phase.shrink)
    #: The settings the rest inherit (None: the loaded profile).
    base: settings | None = None
    #: A blob printed by an earlier search: replay that draw (a ValueError when it does not reproduce).
    reproduce: str | None = None
    #: Ask Hypothesis for the blob that replays the shrunk draw (``SearchOutcome.blob``).
    print_blob: bool = False
    progress: Progress | None = None
    #: False: draw with no "local constants" (literals Hypothesis scrapes from the
    #: source of every module imported so far), so the draws depend only on the seed.
    local_constants: bool = True
    #: Collect the warnings ``decide`` raises and show each distinct one once.
    warn_once: bool = False

    def hypothesis_settings(self) -> settings:
        """The Hypothesis settings of this run: no deadline, no database, one bug, every health check off."""
        base = self.base if self.base is not None else settings()  # settings(): the loaded profile
        return settings(
            base,
            max_examples=self.max_examples,
            deadline=None,
            database=None,
            derandomize=self.derandomize,
            print_blob=self.print_blob,
            report_multiple_bugs=False,
            phases=list(self.phases),
            suppress_health_check=list(HealthCheck),
        )


@dataclass(frozen=True)
class SearchOutcome(Generic[T, V]):
    """What :func:`run_search` met."""

    #: Examples judged, shrinking included.
    examples: int
    #: Which example (counted from 1) was the first to fail (None: none failed).
    first_failure_at: int | None
    #: The shrunk failing example and its failure (None: none found).
    example: T | None
    failure: Failure[V] | None
    #: It failed once but passed when replayed.
    flaky: bool
    #: Hypothesis's reproduction blob (when asked for and given).
    blob: str | None
    #: ``time.perf_counter()`` when the search started, and the seconds spent inside ``decide``.
    started: float
    judging_s: float

    @property
    def found(self) -> bool:
        return self.failure is not None

    @property
    def hung(self) -> bool:
        """The search ended at once, with the example the step hung on (not shrunk)."""
        return self.failure is not None and self.failure.fault is Fault.HUNG


class _Found(Exception):
    """Raised inside the search to make Hypothesis shrink; carries the finding."""

    def __init__(self, example: Any, failure: Failure[Any]) -> None:
        super().__init__(failure.error or repr(example))
        self.example, self.failure = example, failure


class _Stop(BaseException):
    """Raised inside the search for a step that hung: a BaseException, so
    Hypothesis stops at once instead of shrinking; carries the finding."""

    def __init__(self, found: _Found) -> None:
        super().__init__(str(found))
        self.found = found


def run_search(
    strategy: SearchStrategy[T], decide: Callable[[T], Decision[V]], run: SearchRun, *, name: str = "the step"
) -> SearchOutcome[T, V]:
    """Search ``strategy`` for an example ``decide`` fails, as ``run`` says, and
    shrink it (see the module's docstring).  ``name`` names what was searched
    in the error of a ``reproduce`` blob that does not replay.  An exception
    ``decide`` raises is Hypothesis's: shrunk, then raised."""
    started = time.perf_counter()
    counts = {"examples": 0}
    judging = [0.0]
    first_failure_at: list[int] = []

    def search_once(example: T) -> None:
        counts["examples"] += 1
        try:
            judged_at = time.perf_counter()
            try:
                decision = decide(example)
            finally:
                judging[0] += time.perf_counter() - judged_at
            if isinstance(decision, Discard):
                reject()
            if isinstance(decision, Failure):
                first_failure_at.append(counts["examples"])
                found = _Found(example, decision)
                if decision.fault is Fault.HUNG:
                    raise _Stop(found)
                if decision.fault is None:
                    raise found  # a verdict: one kind of failure
                # A step error: its own kind, told apart by where it was raised.
                found.__context__, found.__suppress_context__ = decision.cause, True
                raise found
        finally:
            if run.progress is not None:
                run.progress(counts["examples"], time.perf_counter() - started)

    found, flaky, blob = _run(search_once, strategy, run, name)
    return SearchOutcome(
        examples=counts["examples"],
        first_failure_at=first_failure_at[0] if first_failure_at else None,
        example=None if found is None else found.example,
        failure=None if found is None else found.failure,
        flaky=flaky,
        blob=blob,
        started=started,
        judging_s=judging[0],
    )


def _run(
    search_once: Callable[[Any], None], strategy: SearchStrategy[Any], run: SearchRun, name: str
) -> tuple[_Found | None, bool, str | None]:
    """Run the search: (the finding or None, flaky?, the reproduction blob)."""
    test = given(strategy)(search_once)
    if run.reproduce is not None:
        test = hypothesis.reproduce_failure(hypothesis.__version__, run.reproduce.encode())(test)
    test = run.hypothesis_settings()(test)
    if run.seed is not None:
        test = hypothesis.seed(run.seed)(test)
    caught: list[warnings.WarningMessage] = []
    try:
        with _quietly(run) as caught:
            test()
    except _Found as exc:
        match = _BLOB.search("\n".join(getattr(exc, "__notes__", [])))
        return exc, False, match.group(2) if match else None
    except _Stop as exc:
        return exc.found, False, None  # not shrunk: the example it hung on
    except Flaky as exc:
        # It failed once and passed on replay of the same example: still a finding, the one that failed.
        inner = [e for e in getattr(exc, "exceptions", ()) if isinstance(e, _Found)]
        if not inner:
            raise
        return inner[0], True, None
    except Unsatisfiable:
        return None, False, None  # every drawn example was discarded: nothing judged, nothing found
    except (DidNotReproduce, InvalidArgument, binascii.Error, zlib.error, UnicodeError) as exc:
        if run.reproduce is None:
            raise
        raise ValueError(
            f"the blob {run.reproduce[:24]}... does not reproduce a failure of {name} "
            f"({type(exc).__name__}: {exc}); it only replays with the search flags and equiv version that "
            "printed it"
        ) from None
    finally:
        _warn_once(caught)
    return None, False, None


@contextlib.contextmanager
def _quietly(run: SearchRun) -> Iterator[list[warnings.WarningMessage]]:
    """Hypothesis's own report ("Falsifying example: search_once(...)") not
    printed, the local constants left out unless ``run`` keeps them, and the
    warnings recorded (yielded) when ``run.warn_once``."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(with_reporter(lambda value: None))
        if not run.local_constants:
            stack.enter_context(_no_local_constants())
        if not run.warn_once:
            yield []
            return
        caught = stack.enter_context(warnings.catch_warnings(record=True))
        warnings.simplefilter("always")
        yield caught


@contextlib.contextmanager
def _no_local_constants() -> Iterator[None]:
    """Hypothesis's draws with no "local constants" for the block.

    Hypothesis (6.1xx) now and then draws a literal scraped from the source of
    every module imported so far that is not in site-packages (its "local
    constants").  So a seeded search drew other cases depending on what the
    process had imported and on whether equiv was installed editable (measured:
    the zoo's decay_per_micro_batch was first found at case 10, 12 or 28 in one
    environment depending on the imports, and differently in a tox env), and a
    printed ``--seed`` would not replay on another machine.  The pool is emptied
    while the search runs; Hypothesis's global constants stay.  This
    reaches into ``hypothesis.internal`` (there is no setting for it); if that
    moves, nothing is patched and tests/test_portability.py says so."""
    try:
        from hypothesis.internal.conjecture import providers
        from hypothesis.internal.constants_ast import Constants
    except ImportError:  # pragma: no cover - another Hypothesis layout
        yield
        return
    original = getattr(providers, "_get_local_constants", None)
    cache = getattr(providers, "CONSTANTS_CACHE", None)
    if original is None or cache is None:  # pragma: no cover
        yield
        return
    empty = Constants()
    providers._get_local_constants = lambda: empty
    cache.cache.clear()  # pools computed with the local constants
    try:
        yield
    finally:
        providers._get_local_constants = original
        cache.cache.clear()


def _warn_once(caught: list[warnings.WarningMessage]) -> None:
    """Each distinct warning ``decide`` raised, once per search (torch warns per call)."""
    seen: dict[tuple[type[Warning], str], int] = {}
    for record in caught:
        key = (record.category, str(record.message))
        seen[key] = seen.get(key, 0) + 1
    for (category, message), times in seen.items():
        # stacklevel: _warn_once, _run, run_search, the front door, its caller.
        warnings.warn(f"{message} [seen {times} time(s) in this search, shown once]", category, stacklevel=5)

"""``check(candidate, case)``: is this accumulation step the full-batch step?

A front door: the run source is the case run in this process
(:class:`~equiv.judging.judge.ReferenceRuns`), and the engine judges it:

    truth      full-batch reference in float64
    floors     the floor plan (:mod:`equiv.judging.floors`) over the case's
               roundings: batch in order, normalised after backward, shuffled twice
    exact tier candidate in float64, against the truth
    noise tier candidate in the working dtype, against the truth

The noise-floor tier is skipped when the working dtype is float64 (it would
repeat the exact tier).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TypedDict, overload

import torch
from typing_extensions import Unpack  # typing's from Python 3.11; equiv supports 3.10

from equiv.cases.case import Case
from equiv.cases.standard import STANDARD_CASES
from equiv.checking.failure_kinds import agreeing, classify
from equiv.checking.threads import chosen_threads, running_threads
from equiv.checking.witnessing import step_witness
from equiv.judging.autocast import autocast_of
from equiv.judging.contract import BoundCandidate, Candidate, CandidateError, CandidateTimeout, bind
from equiv.judging.deadline import DEFAULT_TIMEOUT_S, CheckTimeout, deadline
from equiv.judging.floors import TIERS
from equiv.judging.judge import (
    CandidateRun,
    FailsBecause,
    OnSnapshot,
    ReferenceRuns,
    precision_fails_because,
    precision_finding,
    reference_runs,
)
from equiv.outcomes import Fault, Outcome
from equiv.results.verdict import CaseVerdicts, FailureKind, PrecisionFinding, TensorDiff, Tier, Verdict
from equiv.results.witness import Witness

__all__ = ["check", "check_cases"]


class CheckOptions(TypedDict, total=False):
    """:func:`check`'s keywords, as :func:`check_cases` passes them on to each case's check."""

    tiers: Sequence[Tier]
    timeout: float | None
    train_dtype: torch.dtype | str | None
    strict: bool
    details: bool
    threads: int | None


@overload
def check(
    candidate: Candidate,
    case: Case,
    *,
    tiers: Sequence[Tier] = TIERS,
    timeout: float | None = DEFAULT_TIMEOUT_S,
    train_dtype: torch.dtype | str | None = None,
    strict: bool = False,
    details: bool = True,
    threads: int | None = None,
) -> Verdict: ...
@overload
def check(
    candidate: Candidate,
    case: None = None,
    *,
    tiers: Sequence[Tier] = TIERS,
    timeout: float | None = DEFAULT_TIMEOUT_S,
    train_dtype: torch.dtype | str | None = None,
    strict: bool = False,
    details: bool = True,
    threads: int | None = None,
) -> CaseVerdicts: ...


def check(
    candidate: Candidate,
    case: Case | None = None,
    *,
    tiers: Sequence[Tier] = TIERS,
    timeout: float | None = DEFAULT_TIMEOUT_S,
    train_dtype: torch.dtype | str | None = None,
    strict: bool = False,
    details: bool = True,
    threads: int | None = None,
) -> Verdict | CaseVerdicts:
    """Compare ``candidate`` with one full-batch step per optimizer step of ``case``.

    Precision: differences that are float32-sized, only inside the float64 run,
    with every lower-precision run matching (a tensor made in torch's default
    dtype, float32 arithmetic written into the step) cannot cost a user who
    trains in float32, bfloat16 or float16 anything: the verdict passes with a
    precision note (:attr:`Verdict.precision_note`: what, where, how large, why).
    It fails, as class PRECISION, when the user trains in float64 or asks for
    ``strict=True``.

    Args:
        candidate: the step, ``step(model, optimizer, micro_batches, loss_fn) -> None``
            (optionally also taking ``max_grad_norm``, ``scheduler``, ``grad_scaler``).
        case: what to run it on; None checks the standard cases (as ``equiv check`` does).
        tiers: which tiers to judge: ``"exact"`` (float64), ``"noise"`` (the working dtype).
        timeout: seconds the check of one case may take (None: no limit).
        train_dtype: the dtype you train in (float64 makes a precision finding fail).
        strict: fail precision findings whatever you train in.
        details: False leaves out where in each tensor a failing verdict's differences
            are (index, relative difference, mismatched count, values), which costs
            running the candidate again; status, first divergence, differences and
            allowances are the same.  For a search.
        threads: torch's CPU thread count during the check (None: equiv chooses, by
            :mod:`equiv.checking.threads`: one thread on small cases unless ``OMP_NUM_THREADS``
            is set; the count before is restored afterwards).

    Returns:
        The :class:`~equiv.results.verdict.Verdict` of ``case``, or, without a case, the
        standard cases' :class:`~equiv.results.verdict.CaseVerdicts` (one ``assert_ok()``
        for all, a step that raises recorded per case).  Never raises for a mismatch:
        call ``assert_ok()`` for that.

    Raises:
        CandidateError: the candidate raised (naming the case and step);
            :class:`~equiv.judging.contract.CandidateTimeout` when it ran past ``timeout``.
        CheckTimeout: equiv's own runs (the reference and its floors) took past ``timeout``.
        TypeError, ValueError: ``case``, ``tiers``, ``train_dtype``, ``strict`` or ``threads`` is not valid.
    """
    __tracebackhide__ = True
    precision_fails_because(train_dtype, strict)  # a bad value is refused before anything runs
    if case is None:
        options = CheckOptions(
            tiers=tiers, timeout=timeout, train_dtype=train_dtype, strict=strict, details=details, threads=threads
        )
        return check_cases(candidate, STANDARD_CASES, **options)

    fails_because = functools.partial(precision_fails_because, train_dtype, strict)
    with running_threads(chosen_threads(threads, [case] if isinstance(case, Case) else [])), _in_time(timeout, case):
        return _check(bind(candidate), case, tiers, fails_because, details)


@contextlib.contextmanager
def _in_time(timeout: float | None, case: Case) -> Iterator[None]:
    """The block under a ``timeout`` deadline, which equiv's own runs (not the candidate:
    that is a :class:`~equiv.judging.contract.CandidateTimeout`) ran past when it raises
    :class:`~equiv.judging.deadline.CheckTimeout`: said so, naming the case."""
    __tracebackhide__ = True
    try:
        with deadline(timeout):
            yield
    except CheckTimeout as exc:
        raise CheckTimeout(
            exc.seconds,
            f"the check of {case!r} took over its limit of {exc.seconds:g} s in "
            "equiv's own runs (the full-batch reference and its floors): give a "
            "longer timeout for a case this large",
        ) from None


def _check(
    candidate: BoundCandidate,
    case: Case,
    tiers: Sequence[Tier],
    fails_because: FailsBecause,
    details: bool = True,
) -> Verdict:
    if not isinstance(case, Case):
        raise TypeError(f"case must be an equiv.Case, got {type(case).__name__}: {case!r}")
    unknown = [t for t in tiers if t not in TIERS]
    if unknown or not tiers:
        raise ValueError(f"tiers must be a non-empty subset of {TIERS}, got {tuple(tiers)!r}")
    name = candidate.name
    reasons = candidate.not_applicable_reasons(case)
    if reasons:
        return Verdict(case=case, candidate=name, mismatches=(), not_applicable=reasons)
    try:
        return _judged(candidate, case, tiers, fails_because, details, watch_autocast=True)
    except _StepAutocast as seen:
        if case.autocast is not None:  # the case's autocast is not the one the step enters itself
            return Verdict(
                case=case,
                candidate=name,
                mismatches=(),
                not_applicable=(
                    f"{name} runs its forward under torch.autocast({seen.dtype}) itself, the case under "
                    f"autocast={case.autocast!r}: give the case autocast={seen.dtype!r}, or None to judge the step in "
                    "its own precision",
                ),
            )
        # Judged as Case(autocast=...) is: the full-batch reference and its floors under the same
        # autocast, so the allowance is that precision's (float64 runs are never lowered: the truth stays exact).
        in_its_precision = dataclasses.replace(case, autocast=seen.dtype)
        verdict = _judged(candidate, in_its_precision, tiers, fails_because, details, watch_autocast=False)
        note = (
            f"the step ran its forward under torch.autocast({seen.dtype}): judged in that precision, as "
            f"Case(autocast={seen.dtype!r}) is"
        )
        return dataclasses.replace(verdict, notes=(note, *verdict.notes))


class _StepAutocast(Exception):
    """The candidate's first run saw its model's forward called under ``torch.autocast`` to
    ``dtype`` ("bfloat16" or "float16") other than the case's: the case is judged again in it."""

    def __init__(self, dtype: str) -> None:
        super().__init__(dtype)
        self.dtype = dtype


def _autocast_watched(
    candidate: BoundCandidate, run_of: Callable[[BoundCandidate], CandidateRun], case: Case
) -> CandidateRun:
    """The candidate's run, reading (as the audit does per forward, :func:`~equiv.judging.autocast.autocast_of`) the
    ``torch.autocast`` in force where the step calls its model: after a run that entered one
    other than the case's, :class:`_StepAutocast` (raised once the run has ended, so no step of
    it is cut short).  Reading it changes nothing the step computes."""
    seen: list[str] = []

    def probe(module: torch.nn.Module, args: object) -> None:
        mixed = autocast_of(module)
        # float16 and bfloat16 are the dtypes autocast lowers to that a case can name.
        if mixed is not None and mixed[1] in (torch.float16, torch.bfloat16) and not seen:
            seen.append(str(mixed[1]).removeprefix("torch."))

    def step(model: torch.nn.Module, *args: object, **kwargs: object) -> object:
        # At the model the step is given (under a case's autocast, the wrapper that enters it): the
        # step's own autocast, before any of the case's.  Then, as the audit does, at the first call of
        # one of its submodules: an autocast the model's forward enters itself (one the step set on the
        # instance, as accelerate's prepare() does for mixed precision).
        inside = {id(module) for module in model.modules()} - {id(model)}

        def probe_inside(module: torch.nn.Module, args: object) -> None:
            if id(module) in inside:
                inner.remove()
                probe(module, args)

        outer = model.register_forward_pre_hook(probe)
        inner = torch.nn.modules.module.register_module_forward_pre_hook(probe_inside)
        try:
            return candidate.step(model, *args, **kwargs)
        finally:
            outer.remove()
            inner.remove()

    run = run_of(dataclasses.replace(candidate, step=step))

    def watched(on_snapshot: OnSnapshot) -> None:
        run(on_snapshot)
        if seen and seen[0] != case.autocast:
            raise _StepAutocast(seen[0])

    return watched


def _judged(
    candidate: BoundCandidate,
    case: Case,
    tiers: Sequence[Tier],
    fails_because: FailsBecause,
    details: bool,
    *,
    watch_autocast: bool,
) -> Verdict:
    """The verdict of an applicable case; ``watch_autocast``: its first candidate run raises
    :class:`_StepAutocast` if the step runs its forward under an autocast the case does not."""
    name = candidate.name
    references = reference_runs(case, tiers)
    if _natural_overflow_possible(case):
        # Under loss scaling in float16 arithmetic a floor run may overflow where the
        # float64 truth does not (a natural overflow, see ReferenceRuns.verdict_from_diffs): its
        # skip decisions are part of every verdict, so every floor runs first.
        references.with_floors()
    # Each candidate run is compared step by step as it runs; nothing of it is kept.
    notes: dict[Tier, list[str]] = {tier: [] for tier in references.tiers}
    by_tier: dict[Tier, list[TensorDiff]] = {}
    # The noise tier first: its candidate run is the cheaper one, and a mathematical
    # bug fails it as it fails the exact tier.  Then the exact tier's floors all run
    # before its candidate does (once, detailed), instead of after a first run that
    # fails and must run again to show where: the same rows either way
    # (tests/test_lazy_floors.py), fewer runs for a failing step.
    for tier in sorted(references.tiers, key=lambda name: name != "noise"):
        if tier == "exact" and any(not row.ok for row in by_tier.get("noise", ())):
            references.with_floors([tier])

        def run_of(step: BoundCandidate, tier: Tier = tier) -> CandidateRun:
            return references.candidate_run(tier, case, step, notes=notes[tier])

        run = _autocast_watched(candidate, run_of, case) if watch_autocast and not by_tier else run_of(candidate)
        by_tier[tier] = references.judge_tier(tier, run, details=details)
    diffs = [diff for tier in references.tiers for diff in by_tier[tier]]
    every_note = [note for tier in references.tiers for note in notes[tier]]
    verdict = dataclasses.replace(references.verdict_from_diffs(name, diffs), notes=tuple(dict.fromkeys(every_note)))
    finding = _precision_finding(references, case, candidate, verdict, fails_because)
    if finding is not None:
        return dataclasses.replace(verdict, precision=finding)
    if details and verdict.status is Outcome.NOT_EQUIVALENT:
        # Only now, after the verdict: a passing check runs nothing more.
        witness, configured_n = _witness(candidate, case, verdict)
        failure, witness = agreeing(_failure_kind(candidate, case, verdict, configured_n), witness)
        return dataclasses.replace(verdict, failure_kind=failure, witness=witness)
    return verdict


def _witness(candidate: BoundCandidate, case: Case, verdict: Verdict) -> tuple[Witness | None, int | None]:
    """The witness of the first step failing in the exact tier (None: none fails there, or the time limit ended
    the run that reads it), and the N the step divided by where its weights imply one."""
    exact = [d.step for d in verdict.mismatches if d.tier == "exact"]
    if not exact:
        return None, None  # only the working dtype's run differs: no weighting to read
    try:
        return step_witness(candidate, case, min(exact) - 1)  # a row's step is 1-based: after that step
    except CheckTimeout:
        return None, None


def _failure_kind(
    candidate: BoundCandidate, case: Case, verdict: Verdict, configured_n: int | None = None
) -> FailureKind:
    """The kind of a mathematical mismatch (:mod:`equiv.checking.failure_kinds`),
    or unclassified, saying why, when the time limit or the step ended the runs
    that tell (the verdict stands either way).  ``configured_n``: the N the step's
    weights say it divides by (a "tail divided by N" is tried only with one)."""
    try:
        return classify(candidate, case, verdict, configured_n=configured_n).failure_kind()
    except CheckTimeout as exc:
        return FailureKind.unclassified(f"not classified: {exc}")
    except CandidateError as exc:
        return FailureKind.unclassified(f"not classified: the step raised when run again ({exc})")


def _own_autocast(cases: Mapping[str, Case], verdicts: Mapping[str, Verdict]) -> str:
    """Said after the count when the step ran under its own ``torch.autocast`` (each such
    case judged in that precision, with a note): "" when none did."""
    dtypes = sorted(
        {
            v.case.autocast
            for name, v in verdicts.items()
            if v.case.autocast is not None and v.case.autocast != cases[name].autocast
        }
    )
    if not dtypes:
        return ""
    return f"(judged under the step's own torch.autocast({', '.join(dtypes)}))"


def _natural_overflow_possible(case: Case) -> bool:
    """Whether a floor run may overflow where the float64 truth does not: under loss
    scaling in float16 arithmetic (65504 at most), or with a scale so large that a
    float32 or bfloat16 run (3.4e38 = 2**128 at most) could reach it: beyond
    2**40 however it grows (doubling at most once per step), where a gradient of
    2**88 would do.  A forced overflow (``overflow_at``) overflows every run alike."""
    if case.loss_scale is None:
        return False
    return "float16" in (case.dtype, case.autocast) or case.loss_scale * 2.0**case.steps > _LARGEST_SAFE_SCALE


#: The loss scale below which no float32 or bfloat16 run of a sane case overflows on its own.
_LARGEST_SAFE_SCALE = 2.0**40


def _precision_finding(
    references: ReferenceRuns,
    case: Case,
    candidate: BoundCandidate,
    verdict: Verdict,
    fails_because: FailsBecause,
) -> PrecisionFinding | None:
    """:func:`precision_finding` for one process: the re-run is the candidate's
    own, in this process, with torch's default dtype set to float64 or its
    bfloat16 and float16 lifted to the run's dtype."""

    def rerun(tiers: Sequence[Tier], how: str) -> list[TensorDiff]:
        options = {"default_dtype": torch.float64} if how == "default_dtype" else {"promote_low_precision": True}
        return [d for tier in tiers for d in references.run_and_compare(tier, case, candidate, **options)]

    return precision_finding([verdict], references, rerun, fails_because)


def check_cases(
    candidate: Candidate,
    cases: Mapping[str, Case],
    *,
    on_case: Callable[[str, CaseVerdicts], None] | None = None,
    **options: Unpack[CheckOptions],
) -> CaseVerdicts:
    """:func:`check` on each named case, with :func:`check`'s keywords (``options``:
    :class:`CheckOptions`, the same defaults); a case where the step raises is recorded,
    not raised.  After a case where the step hangs past ``timeout`` the rest are
    not run (each would wait as long): recorded as not run, and counted so (never as
    not equivalent).  ``on_case(name, so_far)`` hears each case as it ends (progress).
    ``threads``: as :func:`check`'s, chosen once for all the cases."""
    candidate = bind(candidate)
    verdicts: dict[str, Verdict] = {}
    errors: dict[str, str] = {}
    faults: dict[str, Fault] = {}
    not_run: dict[str, str] = {}
    tracebacks: dict[str, str] = {}
    order: list[str] = []

    def so_far() -> CaseVerdicts:
        return CaseVerdicts(
            candidate.name,
            dict(verdicts),
            dict(errors),
            tuple(order),
            dict(tracebacks),
            faults=dict(faults),
            not_run=dict(not_run),
            setting=_own_autocast(cases, verdicts),
        )

    count = chosen_threads(options.get("threads"), cases.values())
    # The count chosen for all, passed on: each case's check need not choose again.
    each: CheckOptions = {**options, "threads": count}
    hung: str | None = None
    with running_threads(count):
        for name, case in cases.items():
            if hung is not None:
                not_run[name] = f"the step hung on {hung!r}"
            else:
                try:
                    verdicts[name] = check(candidate, case, **each)
                except CandidateError as exc:
                    errors[name] = str(exc)
                    faults[name] = Fault.HUNG if isinstance(exc, CandidateTimeout) else Fault.RAISED
                    if exc.step_traceback is not None:
                        tracebacks[name] = exc.step_traceback
                    if isinstance(exc, CandidateTimeout):
                        hung = name
            order.append(name)
            if on_case is not None:
                on_case(name, so_far())
    return so_far()

"""``check(candidate, case)``: is this accumulation step the full-batch step?

Runs, all from the same initial weights and batches:

    truth      full-batch reference in float64
    floors     full-batch references in float32 (and the working dtype): batch
               in order, shuffled twice, and normalised after backward; float64
               on a shuffled batch and normalised after backward
    exact tier candidate in float64, against the truth; floor: the float32
               floors scaled by u64/u32, and the float64 floors
    noise tier candidate in the working dtype, against the truth; floor: the
               working dtype's floors

The noise-floor tier is skipped when the working dtype is float64 (it would
repeat the exact tier).
"""

from __future__ import annotations

import dataclasses
import json
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import overload

import torch

from equiv.cases.case import Case
from equiv.cases.models import ModelBundle
from equiv.cases.standard import STANDARD_CASES
from equiv.judging.compare import (
    FloorErrors,
    FloorRun,
    StepComparer,
    TruthTrajectory,
    compare_trajectories,
    starts_exactly,
)
from equiv.judging.contract import BoundCandidate, Candidate, CandidateError, CandidateTimeout, bind
from equiv.judging.deadline import DEFAULT_TIMEOUT_S, CheckTimeout, deadline
from equiv.judging.inherent import inherent_non_equivalences
from equiv.judging.runs import Snapshot, run_candidate, run_reference
from equiv.judging.tolerances import ROUNDOFF_UNITS_PER_STEP, unit_roundoff
from equiv.results.verdict import CaseVerdicts, PrecisionFinding, TensorDiff, Tier, Verdict

__all__ = [
    "FloorSample", "ReferenceRuns", "check", "check_cases", "float32_sized", "floor_samples", "precision_finding",
    "reference_runs",
]

TIERS: tuple[Tier, ...] = ("exact", "noise")
#: Offsets of the shuffling seeds from the case seed (any fixed values; fixed so reruns agree).
_SHUFFLE_SEED_OFFSETS = (7919, 104729)


@overload
def check(
    candidate: Candidate, case: Case, *, tiers: Sequence[Tier] = TIERS, timeout: float | None = DEFAULT_TIMEOUT_S,
    train_dtype: torch.dtype | str | None = None, strict: bool = False, details: bool = True,
) -> Verdict: ...
@overload
def check(
    candidate: Candidate, case: None = None, *, tiers: Sequence[Tier] = TIERS,
    timeout: float | None = DEFAULT_TIMEOUT_S, train_dtype: torch.dtype | str | None = None, strict: bool = False,
    details: bool = True,
) -> CaseVerdicts: ...


def check(
    candidate: Candidate, case: Case | None = None, *, tiers: Sequence[Tier] = TIERS,
    timeout: float | None = DEFAULT_TIMEOUT_S, train_dtype: torch.dtype | str | None = None, strict: bool = False,
    details: bool = True,
) -> Verdict | CaseVerdicts:
    """Compare ``candidate`` with one full-batch step per optimizer step of ``case``.

    ``candidate`` follows the contract ``step(model, optimizer, micro_batches,
    loss_fn) -> None`` (optionally also taking ``max_grad_norm`` and
    ``scheduler`` keywords).  Raises :class:`~equiv.judging.contract.CandidateError`
    if the candidate raises, naming the case; never raises for a mismatch:
    call ``verdict.assert_ok()`` for that.

    Without a case, checks the standard cases (``equiv check`` does the same)
    and returns their :class:`~equiv.results.verdict.CaseVerdicts`: one
    ``assert_ok()`` for all, a step that raises recorded per case.

    ``timeout``: seconds the check of one case may take (None: no limit).  A
    step still running then raises :class:`~equiv.judging.contract.CandidateTimeout`
    (which case, which step, how long); time spent in equiv's own reference runs
    raises :class:`~equiv.judging.deadline.CheckTimeout`.

    Precision: differences that are float32-sized, only inside the float64 run,
    with every lower-precision run matching (a tensor made in torch's default
    dtype, float32 arithmetic written into the step) cannot cost a user who
    trains in float32, bfloat16 or float16 anything: the verdict passes with a
    precision note (:attr:`Verdict.precision_note`: what, where, how large, why).
    It fails, as class PRECISION, when the user trains in float64
    (``train_dtype=torch.float64``) or asks for ``strict=True``.

    ``details=False``: a failing verdict without where in each tensor the
    differences are (index, relative difference, mismatched count, expected
    and actual values), which costs running the candidate again; its status,
    first divergence, differences and allowances are the same.  For a search,
    which needs pass or fail for every case and the details of one.
    """
    __tracebackhide__ = True
    fails_because = precision_fails_because(train_dtype, strict)
    if case is None:
        return check_cases(candidate, STANDARD_CASES, tiers=tiers, timeout=timeout, train_dtype=train_dtype,
                           strict=strict, details=details)
    try:
        with deadline(timeout):
            return _check(bind(candidate), case, tiers, fails_because, details)
    except CheckTimeout as exc:  # not inside the candidate (that is a CandidateTimeout): in equiv's own runs
        raise CheckTimeout(exc.seconds, f"the check of {case!r} took over its limit of {exc.seconds:g} s in "
                                         "equiv's own runs (the full-batch reference and its floors): give a "
                                         "longer timeout for a case this large") from None


def _check(
    candidate: BoundCandidate, case: Case, tiers: Sequence[Tier], fails_because: str, details: bool = True,
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

    references = reference_runs(case, tiers)
    if _natural_overflow_possible(case):
        # Under loss scaling in float16 arithmetic a floor run may overflow where the
        # float64 truth does not (a natural overflow, see ReferenceRuns.judge): its
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
        by_tier[tier] = _judge_tier(references, tier, case, candidate, notes[tier], details)
    diffs = [diff for tier in references.tiers for diff in by_tier[tier]]
    every_note = [note for tier in references.tiers for note in notes[tier]]
    verdict = dataclasses.replace(references.judge(name, diffs), notes=tuple(dict.fromkeys(every_note)))
    finding = _precision_finding(references, case, candidate, verdict, fails_because)
    return verdict if finding is None else dataclasses.replace(verdict, precision=finding)


def _judge_tier(
    references: ReferenceRuns, tier: Tier, case: Case, candidate: BoundCandidate, notes: list[str],
    details: bool = True,
) -> list[TensorDiff]:
    """Every tensor's row of ``candidate`` in ``tier``, running floor samples only
    while the verdict depends on them.

    The allowance is FLOOR_FACTOR x floor + a roundoff term, and the floor is
    the greatest distance from the truth of any floor sample: more samples can
    only raise it.  So a tier that passes against the samples run so far (none
    at first: the roundoff term alone) passes against all of them, and is done;
    its worst ratio is then an upper bound of the one every sample would give.
    The candidate runs once, its greatest differences kept (a float per tensor
    and step); each further sample re-judges them without running it again.
    Only a tier still past its allowance with every sample in is run once more,
    to detail the rows a failing verdict shows (unless ``details`` is False):
    the same verdict as with every floor run first, number for number
    (tests/test_lazy_floors.py).
    """
    if references.floors_complete(tier):
        return references.run_and_compare(tier, case, candidate, notes=notes, final=details)
    comparer = references.compare_run(tier, case, candidate, notes=notes, final=False)
    rows = comparer.diffs
    while not all(row.ok for row in rows):
        if not references.run_floor_sample(tier):  # every sample in, still past
            return references.run_and_compare(tier, case, candidate, notes=notes) if details else rows
        rows = comparer.rejudged(references.floors[tier])
    return rows


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


#: Bytes of truth trajectories kept for reuse (the most recently used first out of it
#: is the least recently used): the truths of many small cases, never a large model's.
REFERENCE_CACHE_BYTES = 256 * 2**20
_reference_cache: OrderedDict[tuple[str, tuple[Tier, ...]], tuple[ReferenceRuns, int]] = OrderedDict()


def reference_runs(case: Case, tiers: Sequence[Tier] = TIERS) -> ReferenceRuns:
    """The references of ``case`` (its truth, floors as they get run), shared by every
    candidate checked on it: the zoo, the reports, ``equiv check`` on several steps
    and a search that meets a case again (its replay of the case it found) run the
    truth and each floor sample of a case once.

    Kept while they fit in :data:`REFERENCE_CACHE_BYTES`, least recently used out
    first, and only for a case made of names and numbers: one that holds your own
    model factory, data or loss (objects that may change between two checks)
    gets fresh references every time.  Verdicts are the same either way: a
    case's runs are deterministic, and floors only grow as samples are added.
    """
    key = _cache_key(case, tiers)
    if key is None:
        return ReferenceRuns.truth_of(case, tiers)
    hit = _reference_cache.get(key)
    if hit is not None:
        _reference_cache.move_to_end(key)
        return hit[0]
    references = ReferenceRuns.truth_of(case, tiers)
    size = references.truth.nbytes()
    if size <= REFERENCE_CACHE_BYTES:
        _reference_cache[key] = (references, size)
        while sum(size for _, size in _reference_cache.values()) > REFERENCE_CACHE_BYTES:
            _reference_cache.popitem(last=False)
    return references


def clear_reference_cache() -> None:
    """Forget every kept reference (e.g. to time or test a check from scratch)."""
    _reference_cache.clear()


def _cache_key(case: Case, tiers: Sequence[Tier]) -> tuple[str, tuple[Tier, ...]] | None:
    """The case as JSON text when it is names and numbers only (None otherwise)."""
    objects = [case.model, case.data, case.loss]
    if not all(isinstance(value, str) and ":" not in value for value in objects):
        return None  # a user's object, or an import path to one: it may change between checks
    try:
        text = json.dumps(case.to_dict(), sort_keys=True, allow_nan=True)
    except (TypeError, ValueError):
        return None  # keyword values that are not plain data
    return text, tuple(tiers)


#: Training dtypes a user may declare, by name.
_TRAIN_DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16,
                 "float16": torch.float16}


def precision_fails_because(train_dtype: torch.dtype | str | None, strict: bool) -> str:
    """Why a precision finding fails for this user ("" when it passes): they train in
    float64, or asked for strict precision.  Raises ``ValueError`` for a dtype that is
    not one of float64, float32, bfloat16, float16 (or None: float32 or lower)."""
    if not isinstance(strict, bool):
        raise ValueError(f"strict must be True or False, got {strict!r}")
    if isinstance(train_dtype, str):
        name = train_dtype.removeprefix("torch.").lower()
        if name not in _TRAIN_DTYPES:
            raise ValueError(f"train_dtype must be one of {sorted(_TRAIN_DTYPES)} (or a torch dtype), "
                             f"got {train_dtype!r}")
        train_dtype = _TRAIN_DTYPES[name]
    if train_dtype is not None and train_dtype not in _TRAIN_DTYPES.values():
        raise ValueError(f"train_dtype must be one of {sorted(_TRAIN_DTYPES)} (or a torch dtype), got {train_dtype!r}")
    if strict:
        return "strict precision was asked for"
    if train_dtype == torch.float64:
        return "you train in float64"
    return ""


def _precision_finding(
    references: ReferenceRuns, case: Case, candidate: BoundCandidate, verdict: Verdict, fails_because: str,
) -> PrecisionFinding | None:
    """:func:`precision_finding` for one process: the re-run is the candidate's
    own, in this process, with torch's default dtype set to float64."""

    def rerun(tiers: Sequence[Tier]) -> list[TensorDiff]:
        return [d for tier in tiers for d in references.run_and_compare(tier, case, candidate,
                                                                        default_dtype=torch.float64)]

    return precision_finding([verdict], references, rerun, fails_because)


def precision_finding(
    verdicts: Sequence[Verdict], references: ReferenceRuns,
    rerun_with_float64_default: Callable[[Sequence[Tier]], Sequence[TensorDiff]], fails_because: str,
) -> PrecisionFinding | None:
    """Whether the mismatches of ``verdicts`` (one process's, or every rank's
    of one distributed check) are a precision finding, and why.

    Only when every mismatch is in a float64 run and every run in a lower
    precision matched (a user training in float32 or below cannot see it), and
    either torch's default dtype explains it (``rerun_with_float64_default``
    runs the failing tiers again with the default set to float64 and returns
    their rows: all within their allowances means a tensor made without a
    dtype), or every mismatch is float32-sized: within the roundoff term of the
    float32 tier's allowance (ROUNDOFF_UNITS_PER_STEP x steps x u(float32) x
    scale), a difference a float32 check passes whatever its floor (explicit
    float32 arithmetic in the step).  A mathematical mismatch larger than
    float32 rounding is never one."""
    mismatches = [d for verdict in verdicts for d in verdict.mismatches]
    if not mismatches or any(verdict.inherent for verdict in verdicts):
        return None
    float64_tiers = {tier for tier in references.tiers if references.dtype(tier) == torch.float64}
    if any(d.tier not in float64_tiers for d in mismatches):
        return None
    failing = sorted({d.tier for d in mismatches})
    if all(d.ok for d in rerun_with_float64_default(failing)):
        return PrecisionFinding("default_dtype", fails_because)
    return PrecisionFinding("float32_sized", fails_because) if float32_sized(mismatches) else None


def float32_sized(diffs: Sequence[TensorDiff]) -> bool:
    """Whether every difference is within the roundoff term of the float32 tier's
    allowance (ROUNDOFF_UNITS_PER_STEP x steps x u(float32) x scale): a difference
    float32 arithmetic inside a float64 run makes, which a float32 check passes
    whatever its floor.  The one rule for precision findings (also for whole runs,
    :mod:`equiv.peers.judge`)."""
    return all(
        d.max_abs_diff <= ROUNDOFF_UNITS_PER_STEP * d.step * unit_roundoff(torch.float32) * d.scale for d in diffs
    )


def check_cases(
    candidate: Candidate,
    cases: Mapping[str, Case],
    *,
    tiers: Sequence[Tier] = TIERS,
    timeout: float | None = DEFAULT_TIMEOUT_S,
    on_case: Callable[[str, CaseVerdicts], None] | None = None,
    train_dtype: torch.dtype | str | None = None,
    strict: bool = False,
    details: bool = True,
) -> CaseVerdicts:
    """:func:`check` on each named case; a case where the step raises is recorded,
    not raised.  After a case where the step hangs past ``timeout`` the rest are
    not run (each would wait as long): recorded as not checked.  ``on_case(name,
    so_far)`` hears each case as it ends (progress)."""
    candidate = bind(candidate)
    verdicts: dict[str, Verdict] = {}
    errors: dict[str, str] = {}
    tracebacks: dict[str, str] = {}
    order: list[str] = []
    hung: str | None = None
    for name, case in cases.items():
        if hung is not None:
            errors[name] = f"not checked: the step hung on {hung!r}"
        else:
            try:
                verdicts[name] = check(candidate, case, tiers=tiers, timeout=timeout, train_dtype=train_dtype,
                                       strict=strict, details=details)
            except CandidateError as exc:
                errors[name] = str(exc)
                if exc.step_traceback is not None:
                    tracebacks[name] = exc.step_traceback
                if isinstance(exc, CandidateTimeout):
                    hung = name
        order.append(name)
        if on_case is not None:
            on_case(name, CaseVerdicts(candidate.name, dict(verdicts), dict(errors), tuple(order),
                                       dict(tracebacks)))
    return CaseVerdicts(candidate.name, verdicts, errors, tuple(order), tracebacks)


@dataclass(frozen=True)
class FloorSample:
    """One full-batch run of the case rounded another way (the same mathematics):
    in ``dtype``, on a batch shuffled with ``permutation_seed`` (None: in order),
    or normalised after backward; and, per tier whose floor it measures, the
    factor its distance from the truth is scaled by."""

    dtype: torch.dtype
    permutation_seed: int | None = None
    normalise_after_backward: bool = False
    feeds: Mapping[str, float] = dataclasses.field(default_factory=dict)


def floor_samples(case: Case, tiers: Sequence[Tier]) -> tuple[FloorSample, ...]:
    """The floor samples of ``case`` for ``tiers``, in the order they run.

    Several samples, because the ratio of two roundoff errors is heavy-tailed
    (see :mod:`equiv.judging.tolerances`): each precision runs the batch in
    order, normalised after backward (the accumulator's own rounding pattern),
    and shuffled twice.  Rounding error grows linearly with the unit roundoff,
    so float32 runs' errors scaled by u(float64)/u(float32) estimate the float64
    floor, besides two direct float64 samples (normalised after backward, and
    shuffled; none in order: that is the truth).  Cheapest first (a float32
    sample feeds both tiers when the case trains in float32), as a passing
    tier stops at the first sample that settles it.
    """
    exact, working, float32 = torch.float64, case.working_dtype, torch.float32
    shuffles = [case.seed + offset for offset in _SHUFFLE_SEED_OFFSETS]
    ways = [(None, False), (None, True), (shuffles[0], False), (shuffles[1], False)]
    float32_feeds = {"exact": unit_roundoff(exact) / unit_roundoff(float32)} if "exact" in tiers else {}
    noise = "noise" in tiers and working != exact
    if noise and working == float32:
        float32_feeds["noise"] = 1.0
    first: list[FloorSample] = []
    rest: list[FloorSample] = []
    for position, (seed, after) in enumerate(ways):
        into = first if position < 2 else rest
        if float32_feeds:
            into.append(FloorSample(float32, seed, after, float32_feeds))
        if noise and working != float32:
            into.append(FloorSample(working, seed, after, {"noise": 1.0}))
    if "exact" in tiers:
        first.append(FloorSample(exact, None, True, {"exact": 1.0}))
        rest.append(FloorSample(exact, shuffles[0], False, {"exact": 1.0}))
    return (*first, *rest)


@dataclass(eq=False)
class ReferenceRuns:
    """The float64 truth of a case and, per tier, how far its floor samples land from it.

    Computed streaming: the truth's trajectory is kept (every candidate is
    compared with it), each floor sample only leaves its per-step, per-tensor
    distance from the truth (:class:`~equiv.judging.compare.FloorErrors`).
    Floor samples run on demand and stay: :meth:`run_floor_sample` one more
    for a tier, :meth:`with_floors` every one (:meth:`of`: the truth and every
    floor at once; :meth:`truth_of`: the truth alone).  A tier with no sample
    run yet is judged with the roundoff term alone.

    A candidate is judged step by step as it runs (:meth:`run_and_compare`),
    or from a whole trajectory run elsewhere, e.g. one per rank of a
    distributed run (:meth:`compare`, :meth:`verdict`).  The same references
    serve every candidate checked on the case (:func:`reference_runs` keeps
    recent ones).
    """

    case: Case
    #: the float64 full-batch run, in compared form (updates since step 0, state)
    truth: TruthTrajectory
    #: tier -> the distances from the truth of the floor samples run so far
    floors: dict[str, FloorErrors]
    #: the case's model before any step, built once; every run trains a copy
    initial: ModelBundle | None = None
    #: The tiers this case is judged in (a float64 case has no noise tier: its
    #: working dtype is the exact tier's).
    tier_names: tuple[Tier, ...] = ()
    #: the case's floor samples, and the positions of those already run
    samples: tuple[FloorSample, ...] = ()
    samples_run: set[int] = dataclasses.field(default_factory=set)

    @property
    def tiers(self) -> list[Tier]:
        return list(self.tier_names)

    def dtype(self, tier: str) -> torch.dtype:
        return torch.float64 if tier == "exact" else self.case.working_dtype

    @classmethod
    def of(cls, case: Case, tiers: Sequence[Tier] = TIERS) -> ReferenceRuns:
        """The truth and every tier's floors, run now."""
        return cls.truth_of(case, tiers).with_floors()

    @classmethod
    def truth_of(cls, case: Case, tiers: Sequence[Tier] = TIERS) -> ReferenceRuns:
        """The float64 truth only; floor samples run when asked for."""
        initial = case.build_model()
        # Every run trains a copy of it: on a GPU, copying it there once (in its own
        # dtype; each run casts its copy) saves a host-to-device copy of the model per run.
        initial.module.to(torch.device(case.device))
        truth = TruthTrajectory(start=initial.module, steps=case.steps)
        run_reference(case, torch.float64, on_snapshot=truth.add, initial=initial)
        names = tuple(t for t in TIERS if t in tiers and (t == "exact" or case.working_dtype != torch.float64))
        return cls(case=case, truth=truth, floors={tier: FloorErrors(truth) for tier in names}, initial=initial,
                   tier_names=names, samples=floor_samples(case, names))

    def _pending(self, tier: str) -> list[int]:
        return [i for i, sample in enumerate(self.samples) if tier in sample.feeds and i not in self.samples_run]

    def floors_complete(self, tier: str) -> bool:
        """Whether every floor sample of ``tier`` has run."""
        return not self._pending(tier)

    def run_floor_sample(self, tier: str) -> bool:
        """Run ``tier``'s next floor sample (feeding every tier it measures);
        False when every one has run."""
        pending = self._pending(tier)
        if not pending:
            return False
        position = pending[0]
        sample = self.samples[position]
        # One distance pass per step for every tier the sample measures.
        run = FloorRun([(self.floors[t], factor) for t, factor in sample.feeds.items() if t in self.floors],
                       at_truth_start=self._starts_at_truth(sample.dtype))
        run_reference(self.case, sample.dtype, permutation_seed=sample.permutation_seed,
                      normalise_after_backward=sample.normalise_after_backward, on_snapshot=run.add,
                      initial=self.initial)
        run.end_run()
        self.samples_run.add(position)
        return True

    def _starts_at_truth(self, dtype: torch.dtype) -> bool | None:
        """Whether a run in ``dtype`` from :attr:`initial` (a copy of the model the
        truth started from, cast) starts at the truth's weights: known, not compared,
        when the cast is exact; None (compare) otherwise."""
        return True if self.initial is not None and starts_exactly(self.initial.module, dtype) else None

    def with_floors(self, tiers: Sequence[Tier] | None = None) -> ReferenceRuns:
        """These references with every floor sample of ``tiers`` (None: every tier) run."""
        for tier in self.tier_names if tiers is None else tiers:
            while tier in self.tier_names and self.run_floor_sample(tier):
                pass
        return self

    def run_and_compare(
        self, tier: Tier, case: Case, candidate: Candidate | BoundCandidate, *, default_dtype: torch.dtype | None = None,
        notes: list[str] | None = None, final: bool = True,
    ) -> list[TensorDiff]:
        """Run ``candidate`` in ``tier``'s dtype, comparing each step as it is produced
        against the floors run so far; what the step did to the model besides
        training it goes to ``notes``.  ``final=False``: no row detailed."""
        return self.compare_run(tier, case, candidate, default_dtype=default_dtype, notes=notes, final=final).diffs

    def compare_run(
        self, tier: Tier, case: Case, candidate: Candidate | BoundCandidate, *, default_dtype: torch.dtype | None = None,
        notes: list[str] | None = None, final: bool = True,
    ) -> StepComparer:
        """:meth:`run_and_compare`, returning the comparer: with ``final=False`` its
        rows stay undetailed and can be re-judged as more floor samples run
        (:meth:`~equiv.judging.compare.StepComparer.rejudged`)."""
        comparer = StepComparer(tier=tier, dtype=self.dtype(tier), floors=self.floors[tier], details=final,
                                at_truth_start=self._starts_at_truth(self.dtype(tier)))
        run_candidate(
            case, candidate, self.dtype(tier), on_snapshot=comparer.add, default_dtype=default_dtype, initial=self.initial,
            on_note=None if notes is None else notes.append,
        )
        comparer.end_run()
        return comparer

    def compare(self, tier: Tier, candidate: list[Snapshot]) -> list[TensorDiff]:
        """Judge a whole candidate trajectory (e.g. one rank's)."""
        return compare_trajectories(tier=tier, dtype=self.dtype(tier), floors=self.floors[tier], candidate=candidate)

    def verdict(self, candidate: str, runs: Mapping[Tier, list[Snapshot]]) -> Verdict:
        """The verdict for one candidate trajectory per tier."""
        return self.judge(candidate, [diff for tier, run in runs.items() for diff in self.compare(tier, run)])

    def judge(self, candidate: str, diffs: list[TensorDiff]) -> Verdict:
        """The verdict from every tensor's comparison, all tiers."""
        worst: dict[str, TensorDiff] = {}
        for diff in diffs:
            if diff.tier not in worst or diff.ratio > worst[diff.tier].ratio:
                worst[diff.tier] = diff
        return Verdict(
            case=self.case,
            candidate=candidate,
            mismatches=tuple(d for d in diffs if not d.ok),
            worst=worst,
            inherent=tuple(inherent_non_equivalences((self.initial or self.case.build_model()).module))
            + self._scale_departures({d.tier for d in diffs}),
        )

    def _scale_departures(self, tiers: set[str]) -> tuple[str, ...]:
        """A full-batch run that overflows where the float64 truth does not
        (a natural float16 overflow: float64 is never autocast) has no truth to
        be compared with for its skip decisions."""
        truth_scales = self.truth.loss_scales
        if not truth_scales:
            return ()
        # Every floor run is a full-batch run in a lower precision than the truth.
        for scales in (scales for tier in self.tiers if tier in tiers for scales in self.floors[tier].scale_trajectories):
            if scales != truth_scales:
                precision = self.case.dtype + (f" with {self.case.autocast} autocast" if self.case.autocast else "")
                return (
                    f"the full-batch step itself overflows in {precision} at loss scale {self.case.loss_scale:g} "
                    f"where the float64 truth does not (scales {scales} vs {truth_scales}; a mean loss and a "
                    "summed loss normalised after backward overflow at different scales): skip decisions "
                    "under a natural overflow have no exact reference",
                )
        return ()

"""The Judge: a run source's truth, floors and candidate turned into rows.

Every front door builds a *run source* (one process running a case; W ranks;
pipeline stages; a recorded audit window; a peer's whole run) and asks a
:class:`Judge`; nothing else compares runs.  The source is one callable::

    source(dtype, rounding, on_snapshot) -> None

which runs the full-batch step in ``dtype``, rounded as ``rounding`` says
(:class:`~equiv.judging.floors.Rounding`), handing ``on_snapshot(step,
snapshot)`` the state before the first step (step 0) and after each optimizer
step.  The judge runs the float64 truth at once and the floor samples of
:func:`~equiv.judging.floors.floor_plan` as the verdict needs them; a candidate
is judged from its own snapshots (:meth:`Judge.comparer`, :meth:`Judge.compare`)
or run by the judge, floors added only while its rows are past their
allowance (:meth:`Judge.judge_tier`).

:class:`ReferenceRuns` is the judge of a :class:`~equiv.cases.case.Case` run in
this process (what :func:`equiv.check` asks); :func:`precision_finding` the one
rule telling a precision note from a mathematical mismatch.
"""

from __future__ import annotations

import json
import math
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import nn

from equiv.cases.case import Case
from equiv.cases.models import ModelBundle
from equiv.judging.compare import (
    FloorErrors,
    FloorRun,
    StepComparer,
    TruthTrajectory,
    compare_trajectories,
    starts_exactly,
)
from equiv.judging.contract import BoundCandidate, Candidate
from equiv.judging.floors import IN_ORDER, TIERS, FloorSample, Rounding, floor_plan
from equiv.judging.inherent import inherent_non_equivalences
from equiv.judging.runs import Snapshot, run_candidate, run_reference
from equiv.judging.tolerances import ROUNDOFF_UNITS_PER_STEP, unit_roundoff
from equiv.results.verdict import PrecisionFinding, TensorDiff, Tier, Verdict

__all__ = [
    "SETTLED",
    "CandidateRun",
    "FailsBecause",
    "Judge",
    "OnSnapshot",
    "ReferenceRuns",
    "RunSource",
    "case_key",
    "case_roundings",
    "clear_reference_cache",
    "float32_sized",
    "precision_fails_because",
    "precision_finding",
    "reference_runs",
    "resolution",
    "rounding_sized",
]

#: Hears one snapshot of a run: (step, snapshot), step 0 (the start) first.
OnSnapshot = Callable[[int, Snapshot], None]
#: Runs the full-batch step in a dtype, rounded one way, handing over each step's snapshot (step 0 first).
RunSource = Callable[[torch.dtype, Rounding, OnSnapshot], None]
#: Runs a candidate, handing over each step's snapshot (step 0 first).
CandidateRun = Callable[[OnSnapshot], None]

#: Offsets of the shuffling seeds from the case seed (any fixed values; fixed so reruns agree).
_SHUFFLE_SEED_OFFSETS = (7919, 104729)


def case_roundings(seed: int) -> tuple[Rounding, ...]:
    """The roundings a case run in this process can make: the batch in order,
    normalised after backward, and shuffled twice (seeds fixed by the case's)."""
    return (
        IN_ORDER,
        Rounding(after_backward=True),
        *(Rounding("shuffled", seed=seed + offset) for offset in _SHUFFLE_SEED_OFFSETS),
    )


#: A passing tier's rows must sit at most this share of their allowance before floor sampling
#: stops: its status is settled at any ratio <= 1 (more samples only raise the allowance), but a
#: window stopped just under 1 against the roundoff term alone would read as a near miss where
#: every sample puts it far lower (issue 42: 6,500 audited windows of correct runs reached 0.95
#: of the allowance, benchmarks/test_audit_false_alarms.py). Costs floor samples only where a
#: row lands in (SETTLED, 1]; the status is the one every sample gives either way.
SETTLED = 0.5


class Judge:
    """The float64 truth of a run source and, per tier, how far its floor samples land from it.

    Computed streaming: the truth's trajectory is kept (every candidate is
    compared with it), each floor sample leaves only its per-step, per-tensor
    distance from the truth (:class:`~equiv.judging.compare.FloorErrors`).
    Floor samples run on demand and stay: :meth:`run_floor_sample` one more
    for a tier, :meth:`with_floors` every one.  A tier with no sample run yet
    is judged with the roundoff term alone.

    ``working``: the dtype the run trains in (the noise tier's; none when it
    is float64); ``tiers``: the tiers to judge; ``roundings``: what the source
    can make (the first is the truth's own).  ``start``/``steps``: as for
    :class:`~equiv.judging.compare.TruthTrajectory`.  ``starts_at_truth(dtype)``:
    whether a run in ``dtype`` is known to start at the truth's weights (None:
    compare).  ``on_truth``: sees each of the truth's snapshots too.
    """

    def __init__(
        self,
        source: RunSource,
        *,
        working: torch.dtype,
        tiers: Sequence[Tier] = TIERS,
        roundings: Sequence[Rounding] = (IN_ORDER,),
        start: nn.Module | None = None,
        steps: int | None = None,
        starts_at_truth: Callable[[torch.dtype], bool | None] | None = None,
        on_truth: OnSnapshot | None = None,
    ) -> None:
        unknown = [t for t in tiers if t not in TIERS]
        if unknown or not tiers:
            raise ValueError(f"tiers must be a non-empty subset of {TIERS}, got {tuple(tiers)!r}")
        if not roundings or not roundings[0].is_truth:
            raise ValueError(f"the first rounding must be the truth's own ({IN_ORDER!r}), got {tuple(roundings)!r}")
        self.source = source
        self.working = working
        self._starts_at_truth = starts_at_truth
        self.truth = TruthTrajectory(start=start, steps=steps)

        def keep(step: int, snapshot: Snapshot) -> None:
            self.truth.add(step, snapshot)
            if on_truth is not None:
                on_truth(step, snapshot)

        source(torch.float64, roundings[0], keep)
        #: the tiers judged (a float64 run has no noise tier: its working dtype is the exact tier's)
        self.tier_names: tuple[Tier, ...] = tuple(
            t for t in TIERS if t in tiers and (t == "exact" or working != torch.float64)
        )
        #: tier -> the distances from the truth of the floor samples run so far
        self.floors: dict[str, FloorErrors] = {tier: FloorErrors(self.truth) for tier in self.tier_names}
        #: the floor plan, and the positions of the samples already run
        self.samples: tuple[FloorSample, ...] = floor_plan(working, self.tier_names, roundings)
        self.samples_run: set[int] = set()

    @property
    def tiers(self) -> list[Tier]:
        return list(self.tier_names)

    @property
    def steps(self) -> int:
        """The truth's last step."""
        return len(self.truth) - 1

    def dtype(self, tier: str) -> torch.dtype:
        return torch.float64 if tier == "exact" else self.working

    def starts_at_truth(self, dtype: torch.dtype) -> bool | None:
        return None if self._starts_at_truth is None else self._starts_at_truth(dtype)

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
        sample = self.samples[pending[0]]
        # One distance pass per step for every tier the sample measures.
        run = FloorRun(
            [(self.floors[t], factor) for t, factor in sample.feeds.items() if t in self.floors],
            at_truth_start=self.starts_at_truth(sample.dtype),
        )
        self.source(sample.dtype, sample.rounding, run.add)
        run.end_run()
        self.samples_run.add(pending[0])
        return True

    def with_floors(self, tiers: Sequence[Tier] | None = None) -> Judge:
        """This judge with every floor sample of ``tiers`` (None: every tier) run."""
        for tier in self.tier_names if tiers is None else tiers:
            while tier in self.tier_names and self.run_floor_sample(tier):
                pass
        return self

    def comparer(self, tier: Tier, *, details: bool = True) -> StepComparer:
        """A comparer of one candidate run in ``tier`` against the floors run so far
        (feed it the run's snapshots, step 0 first, then ``end_run()``)."""
        return StepComparer(
            tier=tier,
            dtype=self.dtype(tier),
            floors=self.floors[tier],
            details=details,
            at_truth_start=self.starts_at_truth(self.dtype(tier)),
        )

    def rows(self, tier: Tier, run: CandidateRun, *, details: bool = True) -> StepComparer:
        """Run a candidate (``run`` hands over its snapshots), comparing each step as it is produced."""
        comparer = self.comparer(tier, details=details)
        run(comparer.add)
        comparer.end_run()
        return comparer

    def judge_tier(
        self, tier: Tier, run: CandidateRun, *, details: bool = True, agree: Callable[[bool], bool] | None = None
    ) -> list[TensorDiff]:
        """Every tensor's row of a candidate in ``tier``, running floor samples only
        while the verdict depends on them.

        The allowance is FLOOR_FACTOR x floor + a roundoff term, and the floor is
        the greatest distance from the truth of any floor sample: more samples can
        only raise it.  So a tier that passes against the samples run so far (none
        at first: the roundoff term alone) passes against all of them: its status
        is settled.  It is done once every row is also at most :data:`SETTLED` of
        its allowance; a row nearer it than that runs the next sample too, so the
        worst ratio shown is not a stopping point just under 1 but, where samples
        remain, a margin (an upper bound of the one every sample would give).
        The candidate runs once, its greatest differences kept (a float per tensor
        and step); each further sample re-judges them without running it again.
        Only a tier still past its allowance with every sample in is run once more,
        to detail the rows a failing verdict shows (unless ``details`` is False):
        the same verdict as with every floor run first, number for number
        (tests/test_lazy_floors.py).

        ``agree``: for judges that must run the same floor samples together (the ranks
        of a multi-process audit, whose source runs collectives), told whether this
        one wants another sample (a row past, or nearer than SETTLED to, its allowance)
        and answering whether any of them does.
        """
        if self.floors_complete(tier):
            return self.rows(tier, run, details=details).diffs
        comparer = self.rows(tier, run, details=False)
        rows = comparer.diffs

        def unsettled(rows: list[TensorDiff]) -> bool:
            wanted = any(not row.ok or row.ratio > SETTLED for row in rows)
            return wanted if agree is None else agree(wanted)

        while unsettled(rows):
            if not self.run_floor_sample(tier):  # every sample in: detail a tier still past its allowance
                past = not all(row.ok for row in rows)
                return self.rows(tier, run).diffs if details and past else rows
            rows = comparer.rejudged(self.floors[tier])
        return rows

    def compare(self, tier: Tier, candidate: Sequence[Snapshot]) -> list[TensorDiff]:
        """Judge a whole candidate trajectory (e.g. one rank's, or a peer's) against the floors run so far."""
        return compare_trajectories(
            tier=tier, dtype=self.dtype(tier), floors=self.floors[tier], candidate=list(candidate)
        )


class ReferenceRuns(Judge):
    """The judge of a :class:`~equiv.cases.case.Case` run in this process: its float64
    truth, its floors (:func:`case_roundings` in float32, the working dtype and float64)
    and its candidates run here (:meth:`run_and_compare`) or elsewhere, e.g. one per rank
    of a distributed run (:meth:`compare`, :meth:`verdict`).  The same references serve
    every candidate checked on the case (:func:`reference_runs` keeps recent ones).
    """

    def __init__(self, case: Case, tiers: Sequence[Tier] = TIERS) -> None:
        self.case = case
        #: the case's model before any step, built once; every run trains a copy
        self.initial: ModelBundle = case.build_model()
        # Every run trains a copy of it: on a GPU, copying it there once (in its own
        # dtype; each run casts its copy) saves a host-to-device copy of the model per run.
        self.initial.module.to(torch.device(case.device))
        super().__init__(
            self._run_reference,
            working=case.working_dtype,
            tiers=tiers,
            roundings=case_roundings(case.seed),
            start=self.initial.module,
            steps=case.steps,
            starts_at_truth=self._copies_start,
        )

    def _run_reference(self, dtype: torch.dtype, rounding: Rounding, on_snapshot: OnSnapshot) -> None:
        run_reference(
            self.case,
            dtype,
            permutation_seed=rounding.seed,
            normalise_after_backward=rounding.after_backward,
            on_snapshot=on_snapshot,
            initial=self.initial,
        )

    def _copies_start(self, dtype: torch.dtype) -> bool | None:
        """Whether a run in ``dtype`` from :attr:`initial` (a copy of the model the
        truth started from, cast) starts at the truth's weights: known, not compared,
        when the cast is exact; None (compare) otherwise."""
        return True if starts_exactly(self.initial.module, dtype) else None

    @classmethod
    def of(cls, case: Case, tiers: Sequence[Tier] = TIERS) -> ReferenceRuns:
        """The truth and every tier's floors, run now."""
        references = cls(case, tiers)
        references.with_floors()
        return references

    @classmethod
    def truth_of(cls, case: Case, tiers: Sequence[Tier] = TIERS) -> ReferenceRuns:
        """The float64 truth only; floor samples run when asked for."""
        return cls(case, tiers)

    def candidate_run(
        self,
        tier: Tier,
        case: Case,
        candidate: Candidate | BoundCandidate,
        *,
        default_dtype: torch.dtype | None = None,
        notes: list[str] | None = None,
        promote_low_precision: bool = False,
    ) -> CandidateRun:
        """``candidate`` run on ``case`` in ``tier``'s dtype from :attr:`initial`; what the
        step did to the model besides training it goes to ``notes``."""

        def run(on_snapshot: OnSnapshot) -> None:
            run_candidate(
                case,
                candidate,
                self.dtype(tier),
                on_snapshot=on_snapshot,
                default_dtype=default_dtype,
                initial=self.initial,
                on_note=None if notes is None else notes.append,
                promote_low_precision=promote_low_precision,
            )

        return run

    def run_and_compare(
        self,
        tier: Tier,
        case: Case,
        candidate: Candidate | BoundCandidate,
        *,
        default_dtype: torch.dtype | None = None,
        notes: list[str] | None = None,
        final: bool = True,
        promote_low_precision: bool = False,
    ) -> list[TensorDiff]:
        """Run ``candidate`` in ``tier``'s dtype, comparing each step as it is produced
        against the floors run so far.  ``final=False``: no row detailed."""
        run = self.candidate_run(
            tier, case, candidate, default_dtype=default_dtype, notes=notes, promote_low_precision=promote_low_precision
        )
        return self.rows(tier, run, details=final).diffs

    def verdict(self, candidate: str, runs: Mapping[Tier, list[Snapshot]]) -> Verdict:
        """The verdict for one candidate trajectory per tier."""
        return self.verdict_from_diffs(
            candidate, [diff for tier, run in runs.items() for diff in self.compare(tier, run)]
        )

    def verdict_from_diffs(self, candidate: str, diffs: list[TensorDiff]) -> Verdict:
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
            inherent=tuple(inherent_non_equivalences(self.initial.module))
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
        for scales in (
            scales for tier in self.tiers if tier in tiers for scales in self.floors[tier].scale_trajectories
        ):
            if scales != truth_scales:
                precision = self.case.dtype + (f" with {self.case.autocast} autocast" if self.case.autocast else "")
                return (
                    f"the full-batch step itself overflows in {precision} at loss scale {self.case.loss_scale:g} "
                    f"where the float64 truth does not (scales {scales} vs {truth_scales}; a mean loss and a "
                    "summed loss normalised after backward overflow at different scales): skip decisions "
                    "under a natural overflow have no exact reference",
                )
        return ()


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
    key = case_key(case)
    return None if key is None else (key, tuple(tiers))


def case_key(case: Case) -> str | None:
    """The case as JSON text when it is names and numbers only, None otherwise:
    what runs of it may be kept under (a case holding a user's object may
    change between two checks, so its runs are never kept)."""
    objects = [case.model, case.data, case.loss]
    if not all(isinstance(value, str) and ":" not in value for value in objects):
        return None  # a user's object, or an import path to one: it may change between checks
    try:
        return json.dumps(case.to_dict(), sort_keys=True, allow_nan=True)
    except (TypeError, ValueError):
        return None  # keyword values that are not plain data


#: Training dtypes a user may declare, by name.
_TRAIN_DTYPES = {
    "float64": torch.float64,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def precision_fails_because(
    train_dtype: torch.dtype | str | None, strict: bool, sized: torch.dtype = torch.float32
) -> str:
    """Why a precision finding of differences ``sized`` like one rounding of that dtype
    fails for this user ("" when it passes): they train in a finer dtype (float64 for a
    float32-sized finding; float32 or float64, or no dtype named, for a bfloat16-sized
    one: float32 master weights and gradients), or asked for strict precision.

    Raises:
        ValueError: ``strict`` is not a bool, or ``train_dtype`` is not one of
            float64, float32, bfloat16, float16 (or None: float32 or lower).
    """
    if not isinstance(strict, bool):
        raise ValueError(f"strict must be True or False, got {strict!r}")
    if isinstance(train_dtype, str):
        name = train_dtype.removeprefix("torch.").lower()
        if name not in _TRAIN_DTYPES:
            raise ValueError(
                f"train_dtype must be one of {sorted(_TRAIN_DTYPES)} (or a torch dtype), got {train_dtype!r}"
            )
        train_dtype = _TRAIN_DTYPES[name]
    if train_dtype is not None and train_dtype not in _TRAIN_DTYPES.values():
        raise ValueError(f"train_dtype must be one of {sorted(_TRAIN_DTYPES)} (or a torch dtype), got {train_dtype!r}")
    if strict:
        return "strict precision was asked for"
    if sized == torch.bfloat16:
        if train_dtype in (torch.bfloat16, torch.float16):
            return ""
        trained = "float32" if train_dtype is None else str(train_dtype).removeprefix("torch.")
        return (
            f"you train with {trained} master weights and gradients (equiv check --train-dtype bfloat16 if "
            "yours are bfloat16), finer than the bfloat16 the step accumulates in"
        )
    if train_dtype == torch.float64:
        return "you train in float64"
    return ""


#: Why a finding sized like one rounding of a dtype fails (see :func:`precision_fails_because`).
FailsBecause = Callable[[torch.dtype], str]
#: Runs the candidate again in the failing tiers, torch's default dtype set to float64
#: ("default_dtype") or its bfloat16 / float16 lifted to the run's dtype ("low_precision"),
#: returning their rows; None when the front door cannot run it that way.
Rerun = Callable[[Sequence[Tier], str], "Sequence[TensorDiff] | None"]


def precision_finding(
    verdicts: Sequence[Verdict],
    references: Judge,
    rerun: Rerun,
    fails_because: FailsBecause,
) -> PrecisionFinding | None:
    """Whether the mismatches of ``verdicts`` (one process's, or every rank's
    of one distributed check) are a precision finding, and why.

    Float32-sized: every mismatch is in a float64 run and every run in a lower
    precision matched (a user training in float32 or below cannot see it), and
    either torch's default dtype explains it (the failing tiers run again with
    the default set to float64 are all within their allowances: a tensor made
    without a dtype), or every mismatch is float32-sized (:func:`float32_sized`).

    Bfloat16-sized: every mismatch is in a run finer than bfloat16 (float32 or
    float64), at most one bfloat16 rounding per step in size, and the failing
    tiers run again with the step's own bfloat16 and float16 lifted to the run's
    dtype are all within their allowances: the step computes in bfloat16 (an
    accumulation buffer, ISEEKYAN #149), which fails a user whose master weights
    and gradients are float32.  A mathematical mismatch is never one: it stays
    when the precision is lifted."""
    mismatches = [d for verdict in verdicts for d in verdict.mismatches]
    if not mismatches or any(verdict.inherent for verdict in verdicts):
        return None
    failing = sorted({d.tier for d in mismatches})
    float64_tiers = {tier for tier in references.tiers if references.dtype(tier) == torch.float64}
    if all(d.tier in float64_tiers for d in mismatches):
        if all(d.ok for d in rerun(failing, "default_dtype") or [_NOT_RUN]):
            return PrecisionFinding("default_dtype", fails_because(torch.float32))
        if float32_sized(mismatches):
            return PrecisionFinding("float32_sized", fails_because(torch.float32))
    finer = {tier for tier in references.tiers if references.dtype(tier) in (torch.float64, torch.float32)}
    if all(d.tier in finer for d in mismatches) and rounding_sized(mismatches, torch.bfloat16):
        lifted = rerun(failing, "low_precision")
        if lifted and all(d.ok for d in lifted):
            rows = [*mismatches, *(d for verdict in verdicts for d in verdict.worst.values())]
            return PrecisionFinding("bfloat16_arithmetic", fails_because(torch.bfloat16), resolves=resolution(rows))
    return None


#: A row that is never within its allowance: a rerun that could not run decides nothing.
_NOT_RUN = TensorDiff(
    step=1,
    name="(not run)",
    quantity="update",
    tier="exact",
    dtype="float64",
    max_abs_diff=math.inf,
    index=(),
    max_rel_diff=math.inf,
    rel_index=(),
    allowed=0.0,
    explanation="",
    mismatched=0,
    numel=0,
)


def resolution(rows: Sequence[TensorDiff]) -> tuple[tuple[str, float], ...]:
    """Per dtype judged, the smallest relative difference the check resolves: the
    smallest allowance relative to its tensor's scale among ``rows``."""
    smallest: dict[str, float] = {}
    for row in rows:
        if row.scale > 0 and row.allowed > 0:
            smallest[row.dtype] = min(smallest.get(row.dtype, math.inf), row.allowed / row.scale)
    return tuple(sorted(smallest.items(), key=lambda item: item[1]))


def rounding_sized(diffs: Sequence[TensorDiff], dtype: torch.dtype) -> bool:
    """Whether every difference is within the roundoff term of a ``dtype`` tier's
    allowance (ROUNDOFF_UNITS_PER_STEP x steps x u(dtype) x scale)."""
    return all(d.max_abs_diff <= ROUNDOFF_UNITS_PER_STEP * d.step * unit_roundoff(dtype) * d.scale for d in diffs)


def float32_sized(diffs: Sequence[TensorDiff]) -> bool:
    """Whether every difference is within the roundoff term of the float32 tier's
    allowance (ROUNDOFF_UNITS_PER_STEP x steps x u(float32) x scale): a difference
    float32 arithmetic inside a float64 run makes, which a float32 check passes
    whatever its floor.  The one rule for precision findings (also for whole runs,
    :mod:`equiv.judging.trajectories`)."""
    return rounding_sized(diffs, torch.float32)

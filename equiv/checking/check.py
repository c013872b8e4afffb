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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import overload

import torch

from equiv.cases.case import Case
from equiv.cases.models import ModelBundle
from equiv.cases.standard import STANDARD_CASES
from equiv.checking.compare import FloorErrors, StepComparer, TruthTrajectory, compare_trajectories
from equiv.checking.contract import BoundCandidate, Candidate, CandidateError, CandidateTimeout, bind
from equiv.checking.deadline import DEFAULT_TIMEOUT_S, CheckTimeout, deadline
from equiv.checking.inherent import inherent_non_equivalences
from equiv.checking.tolerances import ROUNDOFF_UNITS_PER_STEP, unit_roundoff
from equiv.checking.trajectory import Snapshot, run_candidate, run_reference
from equiv.checking.verdict import CaseVerdicts, PrecisionFinding, TensorDiff, Tier, Verdict

__all__ = ["ReferenceRuns", "check", "check_cases"]

TIERS: tuple[Tier, ...] = ("exact", "noise")
#: Offsets of the shuffling seeds from the case seed (any fixed values; fixed so reruns agree).
_SHUFFLE_SEED_OFFSETS = (7919, 104729)


@overload
def check(
    candidate: Candidate, case: Case, *, tiers: Sequence[Tier] = TIERS, timeout: float | None = DEFAULT_TIMEOUT_S,
    train_dtype: torch.dtype | str | None = None, strict: bool = False,
) -> Verdict: ...
@overload
def check(
    candidate: Candidate, case: None = None, *, tiers: Sequence[Tier] = TIERS,
    timeout: float | None = DEFAULT_TIMEOUT_S, train_dtype: torch.dtype | str | None = None, strict: bool = False,
) -> CaseVerdicts: ...


def check(
    candidate: Candidate, case: Case | None = None, *, tiers: Sequence[Tier] = TIERS,
    timeout: float | None = DEFAULT_TIMEOUT_S, train_dtype: torch.dtype | str | None = None, strict: bool = False,
) -> Verdict | CaseVerdicts:
    """Compare ``candidate`` with one full-batch step per optimizer step of ``case``.

    ``candidate`` follows the contract ``step(model, optimizer, micro_batches,
    loss_fn) -> None`` (optionally also taking ``max_grad_norm`` and
    ``scheduler`` keywords).  Raises :class:`~equiv.checking.contract.CandidateError`
    if the candidate raises, naming the case; never raises for a mismatch:
    call ``verdict.assert_ok()`` for that.

    Without a case, checks the standard cases (``equiv check`` does the same)
    and returns their :class:`~equiv.checking.verdict.CaseVerdicts`: one
    ``assert_ok()`` for all, a step that raises recorded per case.

    ``timeout``: seconds the check of one case may take (None: no limit).  A
    step still running then raises :class:`~equiv.checking.contract.CandidateTimeout`
    (which case, which step, how long); time spent in equiv's own reference runs
    raises :class:`~equiv.checking.deadline.CheckTimeout`.

    Precision: differences that are float32-sized, only inside the float64 run,
    with every lower-precision run matching (a tensor made in torch's default
    dtype, float32 arithmetic written into the step) cannot cost a user who
    trains in float32, bfloat16 or float16 anything: the verdict passes with a
    precision note (:attr:`Verdict.precision_note`: what, where, how large, why).
    It fails, as class PRECISION, when the user trains in float64
    (``train_dtype=torch.float64``) or asks for ``strict=True``.
    """
    __tracebackhide__ = True
    fails_because = precision_fails_because(train_dtype, strict)
    if case is None:
        return check_cases(candidate, STANDARD_CASES, tiers=tiers, timeout=timeout, train_dtype=train_dtype,
                           strict=strict)
    try:
        with deadline(timeout):
            return _check(bind(candidate), case, tiers, fails_because)
    except CheckTimeout as exc:  # not inside the candidate (that is a CandidateTimeout): in equiv's own runs
        raise CheckTimeout(exc.seconds, f"the check of {case!r} took over its limit of {exc.seconds:g} s in "
                                         "equiv's own runs (the full-batch reference and its floors): give a "
                                         "longer timeout for a case this large") from None


def _check(candidate: BoundCandidate, case: Case, tiers: Sequence[Tier], fails_because: str) -> Verdict:
    if not isinstance(case, Case):
        raise TypeError(f"case must be an equiv.Case, got {type(case).__name__}: {case!r}")
    unknown = [t for t in tiers if t not in TIERS]
    if unknown or not tiers:
        raise ValueError(f"tiers must be a non-empty subset of {TIERS}, got {tuple(tiers)!r}")
    name = candidate.name
    reasons = candidate.not_applicable_reasons(case)
    if reasons:
        return Verdict(case=case, candidate=name, mismatches=(), not_applicable=reasons)

    # Floors only where the verdict needs them.  The allowance is FLOOR_FACTOR x floor
    # + a roundoff term, so a difference within the roundoff term alone passes whatever
    # the floor: each tier is first compared with no floor, and only a tier with a
    # tensor past that term runs its floor samples and the candidate again (the same
    # verdict as with every floor run first; measured, 99 of 102 correct cases need no
    # floor).  Under loss scaling the floor runs' own skip decisions are part of the
    # verdict (a natural overflow), so they always run.
    lazy = case.loss_scale is None
    references = ReferenceRuns.truth_of(case, tiers) if lazy else ReferenceRuns.of(case, tiers)
    # Each candidate run is compared step by step as it runs; nothing of it is kept.
    notes: list[str] = []
    by_tier = {tier: references.run_and_compare(tier, case, candidate, notes=notes) for tier in references.tiers}
    undecided = [tier for tier, tier_diffs in by_tier.items() if not all(d.ok for d in tier_diffs)]
    if lazy and undecided:
        references = references.with_floors(undecided)
        by_tier |= {tier: references.run_and_compare(tier, case, candidate, notes=notes) for tier in undecided}
    diffs = [diff for tier in references.tiers for diff in by_tier[tier]]
    verdict = dataclasses.replace(references.judge(name, diffs), notes=tuple(dict.fromkeys(notes)))
    finding = _precision_finding(references, case, candidate, verdict, fails_because)
    return verdict if finding is None else dataclasses.replace(verdict, precision=finding)


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
    """Whether ``verdict``'s mismatches are a precision finding, and why.

    Only when every mismatch is in a float64 run and every run in a lower
    precision matched (a user training in float32 or below cannot see it), and
    either torch's default dtype explains it (re-run with the default set to
    float64, it matches: a tensor made without a dtype), or every mismatch is
    float32-sized: within the roundoff term of the float32 tier's allowance
    (ROUNDOFF_UNITS_PER_STEP x steps x u(float32) x scale), a difference a
    float32 check passes whatever its floor (explicit float32 arithmetic in the
    step).  A mathematical mismatch larger than float32 rounding is never one."""
    if not verdict.mismatches or verdict.inherent:
        return None
    float64_tiers = {tier for tier in references.tiers if references.dtype(tier) == torch.float64}
    if any(d.tier not in float64_tiers for d in verdict.mismatches):
        return None
    failing = sorted({d.tier for d in verdict.mismatches})
    rerun = [d for tier in failing for d in references.run_and_compare(tier, case, candidate,
                                                                      default_dtype=torch.float64)]
    if all(d.ok for d in rerun):
        return PrecisionFinding("default_dtype", fails_because)
    float32_sized = all(
        d.max_abs_diff <= ROUNDOFF_UNITS_PER_STEP * d.step * unit_roundoff(torch.float32) * d.scale
        for d in verdict.mismatches
    )
    return PrecisionFinding("float32_sized", fails_because) if float32_sized else None


def check_cases(
    candidate: Candidate,
    cases: Mapping[str, Case],
    *,
    tiers: Sequence[Tier] = TIERS,
    timeout: float | None = DEFAULT_TIMEOUT_S,
    on_case: Callable[[str, CaseVerdicts], None] | None = None,
    train_dtype: torch.dtype | str | None = None,
    strict: bool = False,
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
                                       strict=strict)
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
class ReferenceRuns:
    """The float64 truth and, per tier, how far the floor samples land from it.

    Computed once, streaming: the truth's trajectory is kept (every candidate
    is compared with it), each floor run only leaves its per-step, per-tensor
    distance from the truth (:class:`~equiv.checking.compare.FloorErrors`).
    A candidate is then judged step by step as it runs
    (:meth:`run_and_compare`), or from a whole trajectory run elsewhere, e.g.
    one per rank of a distributed run (:meth:`compare`, :meth:`verdict`).
    :meth:`of` runs every floor; :meth:`truth_of` runs the truth only, and
    :meth:`with_floors` the floors of the tiers a verdict turns out to need
    (a tier without floors is compared with the roundoff term alone).
    """

    case: Case
    #: the float64 full-batch run, in compared form (updates since step 0, state)
    truth: TruthTrajectory
    #: tier -> the floor samples' distances from the truth
    floors: dict[str, FloorErrors]
    #: the case's model before any step, built once; every run trains a copy
    initial: ModelBundle | None = None

    #: The tiers this case is judged in, whether or not their floors have run yet
    #: (a float64 case has no noise tier: its working dtype is the exact tier's).
    tier_names: tuple[Tier, ...] = ()

    @property
    def tiers(self) -> list[Tier]:
        return list(self.tier_names or self.floors)  # type: ignore[arg-type]

    def dtype(self, tier: str) -> torch.dtype:
        return torch.float64 if tier == "exact" else self.case.working_dtype

    @classmethod
    def of(cls, case: Case, tiers: Sequence[Tier] = TIERS) -> ReferenceRuns:
        """The truth and every tier's floors, run now."""
        return cls.truth_of(case, tiers).with_floors()

    @classmethod
    def truth_of(cls, case: Case, tiers: Sequence[Tier] = TIERS) -> ReferenceRuns:
        """The float64 truth only; floors run later, for the tiers that need them (:meth:`with_floors`)."""
        initial = case.build_model()
        # Every run trains a copy of it: on a GPU, copying it there once (in its own
        # dtype; each run casts its copy) saves a host-to-device copy of the model per run.
        initial.module.to(torch.device(case.device))
        truth = TruthTrajectory()
        run_reference(case, torch.float64, on_snapshot=truth.add, initial=initial)
        names = tuple(t for t in TIERS if t in tiers and (t == "exact" or case.working_dtype != torch.float64))
        return cls(case=case, truth=truth, floors={}, initial=initial, tier_names=names)

    def with_floors(self, tiers: Sequence[Tier] | None = None) -> ReferenceRuns:
        """These references with the floors of ``tiers`` (None: every tier) run too."""
        case, initial, exact, working = self.case, self.initial, torch.float64, self.case.working_dtype
        wanted = [t for t in (self.tier_names if tiers is None else tiers)
                  if t in self.tier_names and t not in self.floors]
        floors: dict[str, FloorErrors] = {tier: FloorErrors(self.truth) for tier in wanted}
        # Floor samples: the full-batch run in order, on shuffled batches, and
        # normalised after backward (the same mathematics rounded other ways).
        # Several samples, because the ratio of two roundoff errors is
        # heavy-tailed (see equiv.checking.tolerances).
        shuffles = [case.seed + offset for offset in _SHUFFLE_SEED_OFFSETS]

        def run_floor_samples(dtype: torch.dtype, feeds: list[tuple[FloorErrors, float]]) -> None:
            def feed(step: int, snapshot: Snapshot) -> None:
                for floor_errors, factor in feeds:
                    floor_errors.add(step, snapshot, factor)

            run_reference(case, dtype, on_snapshot=feed, initial=initial)
            for seed in shuffles:
                run_reference(case, dtype, permutation_seed=seed, on_snapshot=feed, initial=initial)
            run_reference(case, dtype, normalise_after_backward=True, on_snapshot=feed, initial=initial)

        # Rounding error grows linearly with the unit roundoff, so float32 runs'
        # errors scaled by u(float64)/u(float32) estimate the float64 floor.
        float32_to_64 = unit_roundoff(exact) / unit_roundoff(torch.float32)
        float32_feeds = [(floors["exact"], float32_to_64)] if "exact" in floors else []
        if "noise" in floors and working == torch.float32:
            float32_feeds.append((floors["noise"], 1.0))
        if float32_feeds:
            run_floor_samples(torch.float32, float32_feeds)
        if "exact" in floors:
            # Direct float64 samples: the run on a shuffled batch (none for
            # batches of one sample, whose shuffle is the identity), and the run
            # normalised after backward, the accumulator's own rounding pattern.
            def feed_exact(step: int, snapshot: Snapshot) -> None:
                floors["exact"].add(step, snapshot, 1.0)

            run_reference(case, exact, permutation_seed=shuffles[0], on_snapshot=feed_exact, initial=initial)
            run_reference(case, exact, normalise_after_backward=True, on_snapshot=feed_exact, initial=initial)
        if "noise" in floors and working != torch.float32:
            run_floor_samples(working, [(floors["noise"], 1.0)])
        return dataclasses.replace(self, floors={**self.floors, **floors})

    def run_and_compare(
        self, tier: Tier, case: Case, candidate: Candidate | BoundCandidate, *, default_dtype: torch.dtype | None = None,
        notes: list[str] | None = None,
    ) -> list[TensorDiff]:
        """Run ``candidate`` in ``tier``'s dtype, comparing each step as it is produced;
        what the step did to the model besides training it goes to ``notes``."""
        # A tier whose floors have not run is compared with no floor: only the roundoff term allowed.
        floors = self.floors.get(tier) or FloorErrors(self.truth)
        comparer = StepComparer(tier=tier, dtype=self.dtype(tier), floors=floors)
        run_candidate(
            case, candidate, self.dtype(tier), on_snapshot=comparer.add, default_dtype=default_dtype, initial=self.initial,
            on_note=None if notes is None else notes.append,
        )
        return comparer.diffs

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

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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from equiv.cases.case import Case
from equiv.checking.compare import compare_trajectories
from equiv.checking.contract import Candidate, candidate_name, check_signature, not_applicable_reasons
from equiv.checking.inherent import inherent_non_equivalences
from equiv.checking.tolerances import unit_roundoff
from equiv.checking.trajectory import Snapshot, run_candidate, run_reference
from equiv.checking.verdict import TensorDiff, Tier, Verdict

__all__ = ["ReferenceRuns", "check"]

TIERS: tuple[Tier, ...] = ("exact", "noise")
#: Offsets of the shuffling seeds from the case seed (any fixed values; fixed so reruns agree).
_SHUFFLE_SEED_OFFSETS = (7919, 104729)


def check(candidate: Candidate, case: Case, *, tiers: Sequence[Tier] = TIERS) -> Verdict:
    """Compare ``candidate`` with one full-batch step per optimizer step of ``case``.

    ``candidate`` follows the contract ``step(model, optimizer, micro_batches,
    loss_fn) -> None`` (optionally also taking ``max_grad_norm`` and
    ``scheduler`` keywords).  Raises :class:`~equiv.checking.contract.CandidateError`
    if the candidate raises, naming the case; never raises for a mismatch:
    call ``verdict.assert_ok()`` for that.
    """
    __tracebackhide__ = True
    if not isinstance(case, Case):
        raise TypeError(f"case must be an equiv.Case, got {type(case).__name__}: {case!r}")
    unknown = [t for t in tiers if t not in TIERS]
    if unknown or not tiers:
        raise ValueError(f"tiers must be a non-empty subset of {TIERS}, got {tuple(tiers)!r}")
    check_signature(candidate)
    name = candidate_name(candidate)
    reasons = not_applicable_reasons(candidate, case)
    if reasons:
        return Verdict(case=case, candidate=name, mismatches=(), not_applicable=reasons)

    references = ReferenceRuns.of(case, tiers)
    candidate_runs = {tier: run_candidate(case, candidate, references.dtype(tier)) for tier in references.tiers}
    verdict = references.verdict(name, candidate_runs)
    if verdict.mismatches and all(d.tier == "exact" for d in verdict.mismatches):
        # Exact tier only: a mathematical mismatch that hides under float32 noise
        # (an unscaled sum under Adam), or the full-batch step computed partly in
        # float32 inside the float64 run (a tensor made without a dtype).  Only
        # the second goes away when torch's default dtype is float64 too.
        rerun = run_candidate(case, candidate, torch.float64, default_dtype=torch.float64)
        if all(d.ok for d in references.compare("exact", rerun)):
            verdict = dataclasses.replace(verdict, precision_only=True)
    return verdict


@dataclass(frozen=True)
class ReferenceRuns:
    """The float64 truth and the floor samples of each tier, for one case.

    Computed once; any candidate trajectory run elsewhere (e.g. one per rank
    of a distributed run) is then judged by :meth:`compare` / :meth:`verdict`.
    """

    case: Case
    truth: list[Snapshot]
    #: tier -> (floor runs, the factor each floor run's error is scaled by)
    floors: dict[str, tuple[list[list[Snapshot]], list[float]]]

    @property
    def tiers(self) -> list[Tier]:
        return list(self.floors)  # type: ignore[arg-type]

    def dtype(self, tier: str) -> torch.dtype:
        return torch.float64 if tier == "exact" else self.case.working_dtype

    @classmethod
    def of(cls, case: Case, tiers: Sequence[Tier] = TIERS) -> ReferenceRuns:
        exact = torch.float64
        working = case.working_dtype
        truth = run_reference(case, exact)
        # Floor samples: the full-batch run in order, on shuffled batches, and
        # normalised after backward (the same mathematics rounded other ways).
        # Several samples, because the ratio of two roundoff errors is
        # heavy-tailed (see equiv.checking.tolerances).
        shuffles = [case.seed + offset for offset in _SHUFFLE_SEED_OFFSETS]

        def floor_samples(dtype: torch.dtype) -> list[list[Snapshot]]:
            return [
                run_reference(case, dtype),
                *(run_reference(case, dtype, permutation_seed=s) for s in shuffles),
                run_reference(case, dtype, normalise_after_backward=True),
            ]

        float32_floors = floor_samples(torch.float32)
        floors: dict[str, tuple[list[list[Snapshot]], list[float]]] = {}
        if "exact" in tiers:
            # Rounding error grows linearly with the unit roundoff, so float32 runs'
            # errors scaled by u(float64)/u(float32) estimate the float64 floor; the
            # float64 run on a shuffled batch is a direct sample (none for batches
            # of one sample, whose shuffle is the identity).
            float32_to_64 = unit_roundoff(exact) / unit_roundoff(torch.float32)
            float64_floors = [
                run_reference(case, exact, permutation_seed=shuffles[0]),
                # Normalising after backward is the accumulator's own rounding
                # pattern: a direct float64 sample of the error it may show.
                run_reference(case, exact, normalise_after_backward=True),
            ]
            floors["exact"] = (
                [*float32_floors, *float64_floors],
                [float32_to_64] * len(float32_floors) + [1.0] * len(float64_floors),
            )
        if "noise" in tiers and working != exact:
            noise_floors = float32_floors if working == torch.float32 else floor_samples(working)
            floors["noise"] = (noise_floors, [1.0] * len(noise_floors))
        return cls(case=case, truth=truth, floors=floors)

    def compare(self, tier: Tier, candidate: list[Snapshot]) -> list[TensorDiff]:
        floor_runs, floor_scales = self.floors[tier]
        return compare_trajectories(
            tier=tier, dtype=self.dtype(tier), truth=self.truth,
            floor_runs=floor_runs, floor_scales=floor_scales, candidate=candidate,
        )

    def verdict(self, candidate: str, runs: Mapping[Tier, list[Snapshot]]) -> Verdict:
        """The verdict for one candidate trajectory per tier."""
        diffs = [diff for tier, run in runs.items() for diff in self.compare(tier, run)]
        worst: dict[str, TensorDiff] = {}
        for diff in diffs:
            if diff.tier not in worst or diff.ratio > worst[diff.tier].ratio:
                worst[diff.tier] = diff
        return Verdict(
            case=self.case,
            candidate=candidate,
            mismatches=tuple(d for d in diffs if not d.ok),
            worst=worst,
            inherent=tuple(inherent_non_equivalences(self.case.build_model().module)) + self._scale_departures(runs),
        )

    def _scale_departures(self, runs: Mapping[Tier, list[Snapshot]]) -> tuple[str, ...]:
        """A full-batch run that overflows where the float64 truth does not
        (a natural float16 overflow: float64 is never autocast) has no truth to
        be compared with for its skip decisions."""
        key = "grad_scaler:scale"
        if key not in self.truth[0].optimizer_state:
            return ()
        truth_scales = [float(s.optimizer_state[key]) for s in self.truth]
        # Every floor run is a full-batch run in a lower precision than the truth.
        for run in (run for tier in runs for run in self.floors[tier][0]):
            scales = [float(s.optimizer_state[key]) for s in run]
            if scales != truth_scales:
                precision = self.case.dtype + (f" with {self.case.autocast} autocast" if self.case.autocast else "")
                return (
                    f"the full-batch step itself overflows in {precision} at loss scale {self.case.loss_scale:g} "
                    f"where the float64 truth does not (scales {scales} vs {truth_scales}; a mean loss and a "
                    "summed loss normalised after backward overflow at different scales): skip decisions "
                    "under a natural overflow have no exact reference",
                )
        return ()

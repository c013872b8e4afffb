"""``check(candidate, case)``: is this accumulation step the full-batch step?

Runs, all from the same initial weights and batches:

    truth      full-batch reference in float64
    floors     full-batch references in float32 (and the working dtype): batch
               in order and shuffled twice; float64 on a shuffled batch
    exact tier candidate in float64, against the truth; floor: the float32
               floors scaled by u64/u32, and the shuffled float64 run
    noise tier candidate in the working dtype, against the truth; floor: the
               working dtype's floors

The noise-floor tier is skipped when the working dtype is float64 (it would
repeat the exact tier).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from equiv.cases import Case
from equiv.compare import compare_trajectories
from equiv.inherent import inherent_non_equivalences
from equiv.tolerances import unit_roundoff
from equiv.trajectory import Snapshot, candidate_name, run_candidate, run_reference
from equiv.verdict import TensorDiff, Tier, Verdict

__all__ = ["check"]

TIERS: tuple[Tier, ...] = ("exact", "noise")
#: Offsets of the shuffling seeds from the case seed (any fixed values; fixed so reruns agree).
_SHUFFLE_SEED_OFFSETS = (7919, 104729)


def check(candidate: Callable[..., Any], case: Case, *, tiers: Sequence[Tier] = TIERS) -> Verdict:
    """Compare ``candidate`` with one full-batch step per optimizer step of ``case``.

    ``candidate`` follows the contract ``step(model, optimizer, micro_batches,
    loss_fn) -> None`` (optionally also taking ``max_grad_norm`` and
    ``scheduler`` keywords).  Raises :class:`~equiv.trajectory.CandidateError`
    if the candidate raises, naming the case; never raises for a mismatch:
    call ``verdict.assert_ok()`` for that.
    """
    __tracebackhide__ = True
    if not isinstance(case, Case):
        raise TypeError(f"case must be an equiv.Case, got {type(case).__name__}: {case!r}")
    unknown = [t for t in tiers if t not in TIERS]
    if unknown or not tiers:
        raise ValueError(f"tiers must be a non-empty subset of {TIERS}, got {tuple(tiers)!r}")
    if not callable(candidate):
        raise TypeError(f"candidate must be callable as step(model, optimizer, micro_batches, loss_fn), got {candidate!r}")

    exact = torch.float64
    working = case.working_dtype
    truth = run_reference(case, exact)
    # Floor samples: the full-batch run in order and on shuffled batches (the
    # same mathematics rounded in other orders).  Three samples, because the
    # ratio of two roundoff errors is heavy-tailed (see equiv.tolerances).
    shuffles = [case.seed + offset for offset in _SHUFFLE_SEED_OFFSETS]

    def floor_samples(dtype: torch.dtype) -> list[list[Snapshot]]:
        return [run_reference(case, dtype)] + [run_reference(case, dtype, permutation_seed=s) for s in shuffles]

    float32_floors = floor_samples(torch.float32)
    diffs: list[TensorDiff] = []
    if "exact" in tiers:
        # Rounding error grows linearly with the unit roundoff, so float32 runs'
        # errors scaled by u(float64)/u(float32) estimate the float64 floor; the
        # float64 run on a shuffled batch is a direct sample (none for batches
        # of one sample, whose shuffle is the identity).
        float32_to_64 = unit_roundoff(exact) / unit_roundoff(torch.float32)
        diffs += compare_trajectories(
            tier="exact", dtype=exact, truth=truth,
            floor_runs=[*float32_floors, run_reference(case, exact, permutation_seed=shuffles[0])],
            floor_scales=[float32_to_64] * len(float32_floors) + [1.0],
            candidate=run_candidate(case, candidate, exact),
        )
    if "noise" in tiers and working != exact:
        floors = float32_floors if working == torch.float32 else floor_samples(working)
        diffs += compare_trajectories(
            tier="noise", dtype=working, truth=truth, floor_runs=floors, floor_scales=[1.0] * len(floors),
            candidate=run_candidate(case, candidate, working),
        )

    worst: dict[str, TensorDiff] = {}
    for diff in diffs:
        if diff.tier not in worst or diff.ratio > worst[diff.tier].ratio:
            worst[diff.tier] = diff
    return Verdict(
        case=case,
        candidate=candidate_name(candidate),
        mismatches=tuple(d for d in diffs if not d.ok),
        worst=worst,
        inherent=tuple(inherent_non_equivalences(case.build_model().module)),
    )

"""``check(candidate, case)``: is this accumulation step the full-batch step?

Runs, all from the same initial weights and batches:

    truth      full-batch reference in float64
    exact tier candidate in float64, against the truth; floor: the float64
               reference on shuffled batches (same maths, other rounding order)
    noise tier candidate in the working dtype, against the truth; floor: the
               full-batch reference in the working dtype

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
from equiv.trajectory import candidate_name, run_candidate, run_reference
from equiv.verdict import Tier, TensorDiff, Verdict

__all__ = ["check"]

TIERS: tuple[Tier, ...] = ("exact", "noise")
#: Offset of the shuffling seed from the case seed (any fixed value; fixed so reruns agree).
_PERMUTATION_SEED_OFFSET = 7919


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
    # Rounding error grows linearly with the unit roundoff, so the float32
    # full-batch run's distance from the truth, scaled by u(float64)/u(float32),
    # estimates the float64 floor.  (Shuffling the float64 batch instead gives
    # no floor at all for one- or two-sample batches.)
    float32_reference = run_reference(case, torch.float32)
    shuffle_seed = case.seed + _PERMUTATION_SEED_OFFSET
    diffs: list[TensorDiff] = []
    if "exact" in tiers:
        # Larger of two floor estimates: the scaled float32 run, and the float64
        # run on a shuffled batch (same maths, the candidate's kind of error:
        # another order of the same sums).
        diffs += compare_trajectories(
            tier="exact", dtype=exact, truth=truth,
            floor_runs=[float32_reference, run_reference(case, exact, permutation_seed=shuffle_seed)],
            floor_scales=[unit_roundoff(exact) / unit_roundoff(torch.float32), 1.0],
            candidate=run_candidate(case, candidate, exact),
        )
    if "noise" in tiers and working != exact:
        # Two samples of the working dtype's own error (batch in order, and
        # shuffled): one sample alone is sometimes luckily small.
        floor_runs = [
            float32_reference if working == torch.float32 else run_reference(case, working),
            run_reference(case, working, permutation_seed=shuffle_seed),
        ]
        diffs += compare_trajectories(
            tier="noise", dtype=working, truth=truth, floor_runs=floor_runs, floor_scales=[1.0, 1.0],
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

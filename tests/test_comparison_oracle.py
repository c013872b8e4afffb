"""The check's numbers, bit for bit, against a plain whole-trajectory oracle.

Pinned digits of a verdict are rounding noise that moves with the CPU's
kernels (equiv.checking.facts), so the regression value the old hashes had
("a refactor does not change the numbers") is kept here instead, where it is
sound: the streaming comparison of ``equiv.check`` and a deliberately naive
one (every run kept whole as float64 copies, every distance a plain
``p_k - t_k``: the difference of the two updates ``(p_k - p_0) - (t_k - t_0)``,
every run starting at the truth's weights, in one subtraction; floors the
running maximum over the floor runs)
are computed in the same process, on the same kernels, and must agree
exactly: every tensor's greatest difference, scale and allowance.  A change
to how a check measures (its runs, floors, scales or arithmetic) fails here on
any machine; a change of CPU does not.
"""

from __future__ import annotations

import math

import pytest
import torch

import equiv
from equiv.cases.case import Case
from equiv.cases.standard import STANDARD_CASES
from equiv.checking.check import _SHUFFLE_SEED_OFFSETS, ReferenceRuns
from equiv.checking.contract import Candidate
from equiv.checking.tolerances import allowance, unit_roundoff
from equiv.checking.trajectory import Snapshot, run_candidate, run_reference
from equiv.zoo.bugs import BUGS

Key = tuple[str, str]


def _values(snapshot: Snapshot) -> dict[Key, torch.Tensor]:
    """A snapshot keyed as compared, every tensor as its value (distances: p_k - t_k)."""
    out: dict[Key, torch.Tensor] = {("update", n): v for n, v in snapshot.params.items()}
    out |= {("buffer", n): v for n, v in snapshot.buffers.items()}
    out |= {("state", n): v for n, v in snapshot.optimizer_state.items()}
    return out


def _compared(snapshot: Snapshot, start: Snapshot) -> dict[Key, torch.Tensor]:
    out: dict[Key, torch.Tensor] = {("update", n): v - start.params[n] for n, v in snapshot.params.items()}
    out |= {("buffer", n): v - start.buffers[n] for n, v in snapshot.buffers.items()}
    out |= {("state", n): v for n, v in snapshot.optimizer_state.items()}
    return out


def _distance(run: dict[Key, torch.Tensor], truth: dict[Key, torch.Tensor], key: Key) -> float | None:
    """max |run - truth| at ``key`` (the truth's zeros where it lacks the key); None where the run lacks it."""
    value = run.get(key)
    if value is None or (key in truth and truth[key].shape != value.shape):
        return None
    difference = value - truth[key] if key in truth else value
    if difference.numel() == 0:
        return 0.0
    distance = float(difference.abs().max())
    return math.inf if math.isnan(distance) else distance


class Oracle:
    """The float64 truth, its scales and the floor runs, all kept whole."""

    def __init__(self, case: Case) -> None:
        self.case = case
        self.initial = case.build_model()
        truth = run_reference(case, torch.float64, initial=self.initial)
        self.truth = [_compared(s, truth[0]) for s in truth]
        self.truth_values = [_values(s) for s in truth]
        self.scales: list[dict[Key, float]] = [{}]
        self.global_update = [0.0]
        for snapshot, compared in zip(truth[1:], self.truth[1:], strict=True):
            own = {("update", n): v for n, v in snapshot.params.items()}
            own |= {("buffer", n): v for n, v in snapshot.buffers.items()}
            own |= {("state", n): v for n, v in snapshot.optimizer_state.items()}
            self.scales.append({key: float(v.abs().max()) if v.numel() else 0.0 for key, v in own.items()})
            updates = [float(v.abs().max()) for (kind, _), v in compared.items() if kind == "update" and v.numel()]
            self.global_update.append(max(updates, default=0.0))
        shuffles = [case.seed + offset for offset in _SHUFFLE_SEED_OFFSETS]
        to64 = unit_roundoff(torch.float64) / unit_roundoff(torch.float32)

        def samples(dtype: torch.dtype) -> list[list[Snapshot]]:
            return [
                run_reference(case, dtype, initial=self.initial),
                *(run_reference(case, dtype, permutation_seed=seed, initial=self.initial) for seed in shuffles),
                run_reference(case, dtype, normalise_after_backward=True, initial=self.initial),
            ]

        float32 = samples(torch.float32)
        exact = [(run, to64) for run in float32]
        exact += [(run_reference(case, torch.float64, permutation_seed=shuffles[0], initial=self.initial), 1.0),
                  (run_reference(case, torch.float64, normalise_after_backward=True, initial=self.initial), 1.0)]
        working = case.working_dtype
        noise = [(run, 1.0) for run in (float32 if working == torch.float32 else samples(working))]
        self.floors = {"exact": self._floors(exact), "noise": self._floors(noise)}

    def _floors(self, runs: list[tuple[list[Snapshot], float]]) -> dict[tuple[int, Key], float]:
        floors: dict[tuple[int, Key], float] = {}
        for run, factor in runs:
            for step in range(1, len(run)):
                values, truth = _values(run[step]), self.truth_values[step]
                for key in [*truth, *(k for k in values if k[0] == "state" and k not in truth)]:
                    distance = _distance(values, truth, key)
                    scaled = (0.0 if distance is None else distance) * factor
                    # A sample that left the finite numbers measures no rounding: passed over.
                    if math.isfinite(scaled) and scaled > floors.get((step, key), 0.0):
                        floors[(step, key)] = scaled
        return floors

    def judge(self, tier: str, candidate: Candidate) -> list[tuple[int, Key, float, float, float]]:
        """(step, key, greatest difference, scale, allowed) per tensor, in the check's order."""
        dtype = torch.float64 if tier == "exact" else self.case.working_dtype
        run = run_candidate(self.case, candidate, dtype, initial=self.initial)
        rows = []
        for step in range(1, len(run)):
            compared, truth = _compared(run[step], run[0]), self.truth[step]
            state = sorted({n for k, n in truth if k == "state"} | {n for k, n in compared if k == "state"})
            keys = [k for k in truth if k[0] == "update"] + [k for k in truth if k[0] == "buffer"]
            keys += [("state", n) for n in state]
            for key in keys:
                distance = _distance(_values(run[step]), self.truth_values[step], key)
                scale = self.scales[step].get(key, 0.0)
                if key[0] == "update":
                    scale = max(scale, self.global_update[step])
                floor = self.floors[tier].get((step, key), 0.0)
                budget = allowance(floor=floor, dtype=dtype, scale=scale, steps=step)
                rows.append((step, key, math.inf if distance is None else distance, scale, budget.allowed))
        return rows


CANDIDATES = {"accumulator_step": equiv.accumulator_step, "mean_of_means": BUGS["mean_of_means"],
              "low_precision_buffer": BUGS["low_precision_buffer"]}


@pytest.mark.parametrize("case_name", sorted(STANDARD_CASES))
def test_the_streaming_check_measures_exactly_what_the_whole_trajectory_oracle_measures(case_name: str) -> None:
    case = STANDARD_CASES[case_name]
    oracle = Oracle(case)
    references = ReferenceRuns.of(case)
    checked = 0
    for name, candidate in CANDIDATES.items():
        if equiv.check(candidate, case).status == "not_applicable":
            continue
        for tier in references.tiers:
            streamed = [(d.step, (d.kind, d.name), d.max_abs_diff, d.scale, d.allowed)
                        for d in references.run_and_compare(tier, case, candidate)]
            assert streamed == oracle.judge(tier, candidate), f"{name} on {case_name!r}, {tier} tier"
            checked += 1
    assert checked >= 2

"""The check's numbers, bit for bit, against a plain whole-trajectory oracle.

Pinned digits of a verdict are rounding noise that moves with the CPU's
kernels (equiv.results.facts), so the regression value the old hashes had
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
from hypothesis import given, settings
from hypothesis import strategies as st

import equiv
from equiv.cases.case import Case
from equiv.cases.standard import STANDARD_CASES
from equiv.judging.contract import Candidate
from equiv.judging.details import _first_argmax
from equiv.judging.judge import _SHUFFLE_SEED_OFFSETS, ReferenceRuns
from equiv.judging.runs import Snapshot, run_candidate, run_reference
from equiv.judging.tolerances import allowance, unit_roundoff
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
        exact += [
            (run_reference(case, torch.float64, permutation_seed=shuffles[0], initial=self.initial), 1.0),
            (run_reference(case, torch.float64, normalise_after_backward=True, initial=self.initial), 1.0),
        ]
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


CANDIDATES = {
    "accumulator_step": equiv.accumulator_step,
    "mean_of_means": BUGS["mean_of_means"],
    "low_precision_buffer": BUGS["low_precision_buffer"],
}


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
            streamed = [
                (d.step, (d.quantity, d.name), d.max_abs_diff, d.scale, d.allowed)
                for d in references.run_and_compare(tier, case, candidate)
            ]
            assert streamed == oracle.judge(tier, candidate), f"{name} on {case_name!r}, {tier} tier"
            checked += 1
    assert checked >= 2


def _unravel(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), shape)) if shape else ()


#: Standard cases, and one whose tensors span several rows of the check's two-pass
#: argmax with a tail (3500 and 4900 elements: rows of 1024 and a remainder).
DETAIL_CASES = {
    **{
        name: STANDARD_CASES[name]
        for name in ("Adam, uneven 1+2", "SGD momentum, uneven 1+5+10", "Adam, token loss with padding 2+3")
    },
    "AdamW, MLP 50-70-70-30, 3+5": Case(
        batch_size=8,
        micro_batch_sizes=(3, 5),
        optimizer="AdamW",
        model_kwargs={"in_features": 50, "hidden": (70, 70), "out_features": 30},
    ),
}


@pytest.mark.parametrize("case_name", sorted(DETAIL_CASES))
def test_a_failing_rows_details_are_what_plain_torch_computes_from_the_whole_trajectories(case_name: str) -> None:
    """Where, how far relatively and how many: every detailed row of a failing verdict
    against ``abs().argmax()``, a masked relative difference and ``(|d| > allowed).sum()``
    on whole float64 trajectories (the check computes them with faster passes)."""
    case = DETAIL_CASES[case_name]
    verdict = equiv.check(BUGS["mean_of_means"], case)
    assert not verdict and verdict.mismatches
    initial = case.build_model()
    truth = run_reference(case, torch.float64, initial=initial)
    runs = {
        tier: run_candidate(
            case, BUGS["mean_of_means"], torch.float64 if tier == "exact" else case.working_dtype, initial=initial
        )
        for tier in {d.tier for d in verdict.mismatches}
    }
    detailed = [row for row in verdict.mismatches if not (math.isinf(row.max_abs_diff) and not row.index)]
    assert detailed  # (a missing tensor has nothing to detail)
    for row in detailed:
        key = (row.quantity, row.name)
        run = runs[row.tier]
        difference = _values(run[row.step])[key] - _values(truth[row.step])[key]
        expected = _compared(truth[row.step], truth[0])[key]
        absolute = difference.abs().nan_to_num(nan=math.inf, posinf=math.inf)
        relative = (absolute / expected).abs().nan_to_num(nan=math.inf, posinf=math.inf).masked_fill(absolute == 0, 0.0)
        shape = tuple(difference.shape)
        assert row.index == _unravel(int(absolute.argmax()), shape), row
        assert row.rel_index == _unravel(int(relative.argmax()), shape), row
        assert row.max_rel_diff == float(relative.max()), row
        assert row.mismatched == int((absolute > row.allowed).sum()), row
        assert row.expected == float(expected.flatten()[absolute.argmax()]), row
    if case_name.startswith("AdamW, MLP"):
        assert max(row.numel for row in detailed) > 2 * 1024  # the two-pass argmax, not its short-cut


@settings(max_examples=60, deadline=None)
@given(size=st.integers(1, 5 * 1024 + 7), levels=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_the_two_pass_argmax_is_torchs_argmax_ties_and_tails_included(size: int, levels: int, seed: int) -> None:
    # Few distinct values: the greatest is tied across rows, inside a row and in the tail.
    values = torch.randint(0, levels, (size,), generator=torch.Generator().manual_seed(seed)).to(torch.float64)
    if seed % 2:  # an infinite greatest value (NaN made inf, as the check does first), once
        values[torch.randint(0, size, (1,), generator=torch.Generator().manual_seed(seed + 1))] = math.inf
    assert int(_first_argmax(values)) == int(values.argmax())
    assert int(_first_argmax(values.view(1, -1))) == int(values.argmax())

"""How much step time ``equiv plan``'s pick loses to the best N, measured.

For each workload, every candidate N (powers of two up to the global batch)
is measured exhaustively in the same run: its whole step's peak memory (the
storage counter: deterministic on the CPU) and step time.  Then, at three
memory budgets placed between the smallest and the largest measured peak, the
planner (:func:`equiv.cost.planner.search_plan` on real measurements, exactly
what ``equiv plan`` runs) picks an N, and the pick is scored against the
exhaustive table:

* **regret** = (step time of the pick - step time of the fastest N that fits)
  / the latter, both from the exhaustive measurements (so the planner's own
  timing noise does not flatter it); a pick that does not fit is reported as
  such, not as a regret;
* **probes**: micro-batch sizes the planner measured, and how many of them ran
  over the budget (each would be an out-of-memory error on a GPU).

Goal (reported, not asserted): regret at most 5% in every row.
"""

from __future__ import annotations

import statistics
from typing import Any

import pytest
import torch

from equiv.cost.planner import Measurements, Probe, default_candidates, measurements_of, search_plan
from equiv.cost.steps import StepMeasurement, StepOptions, measure_step
from equiv.cost.workloads import WORKLOADS, build_workload_model

SEED = 0
#: Where the budgets sit between the smallest and the largest measured peak.
BUDGET_FRACTIONS = (0.15, 0.5)
#: Above every peak: every N fits.
ABOVE_ALL = 1.1
#: A budget is at least this far above the smallest peak, beyond the planner's
#: 5% safety margin on predicted peaks (at exactly the smallest peak only
#: measured sizes can be known to fit).
ABOVE_SMALLEST = 1.06


def budgets_between(low: int, high: int) -> list[int]:
    """Three budgets from the smallest to above the largest peak (fewer when
    memory is flat across N: a step whose peak is the optimizer's, not the
    activations', costs the same memory at every N)."""
    inside = {max(int(low * ABOVE_SMALLEST), int(low + f * (high - low))) for f in BUDGET_FRACTIONS}
    return sorted(b for b in inside | {int(high * ABOVE_ALL)} if b <= int(high * ABOVE_ALL))


@pytest.mark.parametrize("workload_name", list(WORKLOADS))
def test_planner_regret(benchmark: Any, bench_settings: Any, workload_name: str) -> None:
    device = bench_settings.device
    workload = WORKLOADS[workload_name]
    batch = workload.make_batch(workload.global_batch_size, torch.Generator().manual_seed(SEED))
    model = build_workload_model(workload, seed=SEED)
    options = StepOptions(loss_sum=workload.loss_sum, count_items=workload.count_items, device=device)
    repeats = 3 if bench_settings.quick else 7
    candidates = default_candidates(workload.global_batch_size)

    exhaustive: dict[int, StepMeasurement] = {}
    rows: list[dict[str, Any]] = []

    def run() -> None:
        exhaustive.update({n: measure_step(model, batch, n, options, repeats=repeats) for n in candidates})
        peaks = {n: m.memory.peak_bytes for n, m in exhaustive.items()}
        seconds = {n: m.median_step_seconds for n, m in exhaustive.items()}
        for budget in budgets_between(min(peaks.values()), max(peaks.values())):
            real = measurements_of(model, batch, options, repeats=repeats)
            probe_peaks: list[int] = []

            def probe(
                micro_batch_size: int, window: int, real: Measurements = real, probe_peaks: list[int] = probe_peaks
            ) -> Probe:
                measured = real.probe(micro_batch_size, window)
                probe_peaks.append(measured.memory.peak_bytes)
                return measured

            whole_peaks: list[int] = []

            def whole_step(n: int, real: Measurements = real, whole_peaks: list[int] = whole_peaks) -> StepMeasurement:
                measured = real.whole_step(n)
                whole_peaks.append(measured.memory.peak_bytes)
                return measured

            plan = search_plan(
                Measurements(probe=probe, whole_step=whole_step),
                global_batch_size=workload.global_batch_size,
                memory_budget_bytes=budget,
                device=str(device),
            )
            fitting = [n for n in candidates if peaks[n] <= budget]
            best = min(fitting, key=lambda n: seconds[n]) if fitting else None
            picked = plan.recommended_n
            regret = (seconds[picked] - seconds[best]) / seconds[best] if picked in peaks and best else None
            rows.append(
                {
                    "budget_bytes": budget,
                    "picked_n": picked,
                    "picked_fits": picked is not None and peaks[picked] <= budget,
                    "best_n": best,
                    "regret": regret,
                    "probes": len(probe_peaks),
                    "probes_over_budget": sum(p > budget for p in probe_peaks),
                    "whole_steps": len(whole_peaks),
                    "whole_steps_over_budget": sum(p > budget for p in whole_peaks),
                }
            )

    benchmark.pedantic(run, rounds=1, iterations=1, warmup_rounds=0)
    benchmark.extra_info.update(
        bench_settings.extra_info(),
        planner_regret=True,
        workload_name=workload_name,
        candidates=candidates,
        exhaustive={
            str(n): {
                "peak_bytes": m.memory.peak_bytes,
                "median_step_s": m.median_step_seconds,
                "step_s_spread": statistics.pstdev(m.step_seconds) / m.median_step_seconds,
            }
            for n, m in exhaustive.items()
        },
        rows=rows,
    )
    assert 1 <= len(rows) <= len(BUDGET_FRACTIONS) + 1
    # The largest budget fits every N: the planner must find something there.
    assert rows[-1]["picked_n"] is not None, rows

"""The Ray fan-out's own speed-up (issue 45, ``--ray``): tasks per second of
``equiv.distributed.fanout.fan_out`` for a CPU-bound toy task of about a second (a sweep
subject's order of size), in this process and on a local Ray of 1, 2 and 4 workers, the
modes timed alternately in every round (side by side, the same load).

Each Ray call starts its own local Ray and shuts it down, as ``equiv sweep --ray`` does:
its wall time holds Ray's start-up.  Each task records when it started and ended, so the
tasks' span (first start to last end, in the same call) gives the rate while they run,
and the wall time less that span is Ray's own cost (start-up, a fresh worker, shutdown).
The real subjects' times are the sweep's benchmark; this is the engine's.  Reported, not
asserted (the results are: every mode must return the same values, in order).
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

import pytest
from fanout_toy import spin

from equiv.distributed.fanout import fan_out
from equiv.reporting.benchmarks_sweeps import FANOUT_WORKERS, IN_PROCESS

#: Pure-Python work (benchmarks/fanout_toy.py: no torch in the worker, the engine's cost, not an import's); ~1 s
#: on this machine's cores.
TASK_ITERATIONS = 7_000_000


def _timed(mode: str, arguments: list[tuple[str, int]]) -> tuple[float, float, list[Any]]:
    """The call's wall seconds, the tasks' span (first start to last end) and the results."""
    address: bool | None = False if mode == IN_PROCESS else None
    workers = None if mode == IN_PROCESS else int(mode)
    start = time.perf_counter()
    results = fan_out(spin, arguments, address=address, workers=workers)
    wall = time.perf_counter() - start
    span = max(ended for *_, ended in results) - min(started for *_, started, _ in results)
    return wall, span, results


def test_fanout_speed(benchmark: Any, bench_settings: Any) -> None:
    pytest.importorskip("ray")
    tasks = 4 if bench_settings.quick else 8
    rounds = 1 if bench_settings.quick else 3
    arguments = [(f"subject-{index}", TASK_ITERATIONS) for index in range(tasks)]
    modes = (IN_PROCESS, *(str(workers) for workers in FANOUT_WORKERS))
    seconds: dict[str, list[float]] = {mode: [] for mode in modes}
    spans: dict[str, list[float]] = {mode: [] for mode in modes}
    results: dict[str, list[Any]] = {}

    def every_mode() -> None:
        for mode in modes:
            wall, span, results[mode] = _timed(mode, arguments)
            seconds[mode].append(wall)
            spans[mode].append(span)

    benchmark.pedantic(every_mode, rounds=rounds, iterations=1, warmup_rounds=0)
    values = {mode: [(subject, total) for subject, total, *_ in rows] for mode, rows in results.items()}
    for mode in modes[1:]:  # same values, in the order of the arguments
        assert values[mode] == values[IN_PROCESS], mode
    median = {mode: statistics.median(values) for mode, values in seconds.items()}
    median_span = {mode: statistics.median(values) for mode, values in spans.items()}
    benchmark.extra_info.update(
        bench_settings.extra_info(),
        fanout=True,
        tasks=tasks,
        rounds=rounds,
        cpus=os.cpu_count(),
        task_seconds=median_span[IN_PROCESS] / tasks,
        seconds=median,
        span_seconds=median_span,
        tasks_per_second={mode: tasks / median[mode] for mode in modes},
        tasks_per_second_running={mode: tasks / median_span[mode] for mode in modes},
    )

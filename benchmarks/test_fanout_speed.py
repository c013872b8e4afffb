"""The Ray fan-out's own speed-up (issue 45, ``--ray``): tasks per second of
``equiv.distributed.fanout.fan_out`` for a CPU-bound toy task of about a second (a sweep
subject's order of size), in this process and on a local Ray of 1, 2 and 4 workers, the
modes timed alternately in every round (side by side, the same load).

Each Ray call starts its own local Ray and shuts it down, as ``equiv sweep --ray`` does:
its wall time holds Ray's start-up.  A one-task call per worker count (a no-op) measures
that start-up (ray.init, a fresh worker, shutdown), so the table shows the rate with it and
without it.  The real subjects' times are the sweep's benchmark; this is the engine's.
Reported, not asserted (the results are: every mode must return the same values, in order).
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

import pytest
from fanout_toy import noop, spin

from equiv.distributed.fanout import fan_out
from equiv.reporting.benchmarks_fanout import FANOUT_WORKERS, IN_PROCESS

#: Pure-Python work (benchmarks/fanout_toy.py: no torch in the worker, the engine's cost, not an import's); ~1 s
#: on this machine's cores.
TASK_ITERATIONS = 7_000_000


def _timed(mode: str, arguments: list[tuple[str, int]]) -> tuple[float, list[Any]]:
    address: bool | None = False if mode == IN_PROCESS else None
    workers = None if mode == IN_PROCESS else int(mode)
    start = time.perf_counter()
    results = fan_out(spin, arguments, address=address, workers=workers)
    return time.perf_counter() - start, results


def _start_up(workers: int) -> float:
    start = time.perf_counter()
    fan_out(noop, [("start-up",)], address=None, workers=workers)
    return time.perf_counter() - start


def test_fanout_speed(benchmark: Any, bench_settings: Any) -> None:
    pytest.importorskip("ray")
    tasks = 4 if bench_settings.quick else 8
    rounds = 1 if bench_settings.quick else 3
    arguments = [(f"subject-{index}", TASK_ITERATIONS) for index in range(tasks)]
    modes = (IN_PROCESS, *(str(workers) for workers in FANOUT_WORKERS))
    seconds: dict[str, list[float]] = {mode: [] for mode in modes}
    start_up: dict[str, list[float]] = {mode: [] for mode in modes[1:]}
    results: dict[str, list[Any]] = {}

    def every_mode() -> None:
        for mode in modes:
            seconds_taken, results[mode] = _timed(mode, arguments)
            seconds[mode].append(seconds_taken)
            if mode != IN_PROCESS:
                start_up[mode].append(_start_up(int(mode)))

    benchmark.pedantic(every_mode, rounds=rounds, iterations=1, warmup_rounds=0)
    for mode in modes[1:]:  # same values, in the order of the arguments
        assert results[mode] == results[IN_PROCESS], mode
    median = {mode: statistics.median(values) for mode, values in seconds.items()}
    median_start_up = {mode: statistics.median(values) for mode, values in start_up.items()}
    benchmark.extra_info.update(
        bench_settings.extra_info(),
        fanout=True,
        tasks=tasks,
        rounds=rounds,
        cpus=os.cpu_count(),
        task_seconds=median[IN_PROCESS] / tasks,
        seconds=median,
        start_up_seconds=median_start_up,
        tasks_per_second={mode: tasks / median[mode] for mode in modes},
        tasks_per_second_after_start_up={
            mode: tasks / max(median[mode] - median_start_up[mode], 1e-9) for mode in modes[1:]
        },
    )

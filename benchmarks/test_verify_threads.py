"""Per-case time of ``equiv verify`` on a busy machine: torch's default thread
count, equiv's own choice (no ``OMP_NUM_THREADS``, no ``threads=``), and one
thread, side by side in one run.

Issue 36: on a 2-core machine with other work running, ``equiv verify
equiv.accumulator:accumulator_step --max-examples 100 --seed 0`` took 7-10x
longer per case with torch's default threads than with ``OMP_NUM_THREADS=1``.
A busy loop holds one core for the whole benchmark (the "other work"); the
three modes are timed alternately in every round, so they share that load.
Target: equiv's choice within 1.5x of one thread (reported, not asserted; the
searches' verdicts are asserted equal: a faster search that finds something
else measures nothing).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

import equiv
from equiv.checking.threads import THREADS_ENV
from equiv.checking.verify import VerifyResult
from equiv.judging.judge import clear_reference_cache
from equiv.reporting.benchmarks import THREAD_MODES as MODES

SEED = 0


@contextmanager
def _one_core_held() -> Iterator[None]:
    """A busy loop in another process for the duration: the machine another job is using."""
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        busy.kill()
        busy.wait()


def _search(mode: str, max_examples: int, default_threads: int) -> VerifyResult:
    """One search, its threads as ``mode`` says (torch's default count set beforehand, as a
    user's process starts with it; equiv restores it after every search)."""
    clear_reference_cache()
    torch.set_num_threads(default_threads)
    threads = {MODES[0]: default_threads, MODES[1]: None, MODES[2]: 1}[mode]
    return equiv.verify(
        equiv.accumulator_step, max_examples=max_examples, seed=SEED, replay_in_fresh_process=False, threads=threads
    )


def test_verify_threads(benchmark: Any, bench_settings: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    if bench_settings.device.type != "cpu":
        pytest.skip("verify searches CPU cases by default; threads are a CPU matter")
    # A user's shell: no OMP_NUM_THREADS (tox sets it), torch's count one per core.
    monkeypatch.delenv(THREADS_ENV, raising=False)
    default_threads = os.cpu_count() or 1
    max_examples = 20 if bench_settings.quick else 100
    rounds = 1 if bench_settings.quick else 3
    seconds: dict[str, list[float]] = {mode: [] for mode in MODES}
    results: dict[str, VerifyResult] = {}

    def every_mode() -> None:
        for mode in MODES:  # alternately in every round: side by side, same load
            start = time.perf_counter()
            results[mode] = _search(mode, max_examples, default_threads)
            seconds[mode].append(time.perf_counter() - start)

    try:
        with _one_core_held():
            benchmark.pedantic(every_mode, rounds=rounds, iterations=1, warmup_rounds=0)
    finally:
        torch.set_num_threads(bench_settings.threads)
    first = results[MODES[0]]
    for mode in MODES[1:]:
        assert (results[mode].found, results[mode].examples) == (first.found, first.examples), results[mode]
    assert not first.found, first
    per_case_ms = {mode: 1000 * statistics.median(values) / first.examples for mode, values in seconds.items()}
    benchmark.extra_info.update(
        bench_settings.extra_info(),
        verify_threads=True,
        candidate="accumulator_step",
        seed=SEED,
        max_examples=max_examples,
        examples=first.examples,
        default_threads=default_threads,
        per_case_ms=per_case_ms,
        # The target's ratio: equiv's choice over one thread (<= 1.5); and what the choice saves.
        ratio_chosen=per_case_ms[MODES[1]] / per_case_ms[MODES[2]],
        ratio_default=per_case_ms[MODES[0]] / per_case_ms[MODES[2]],
    )

"""The toy task of benchmarks/test_fanout_speed.py, in a module that imports nothing of equiv: a Ray worker that
runs it imports this module alone (not equiv, torch or pandas), so what is timed is the engine, not an import."""

from __future__ import annotations

import time


def spin(subject: str, iterations: int) -> tuple[str, int, float, float]:
    """A CPU-bound toy subject: a fixed amount of arithmetic, the same answer wherever it runs; with the wall clock
    when it started and ended (one machine, one clock), so the benchmark can tell the tasks' span from Ray's own
    start-up and shutdown around it."""
    started = time.time()
    total = 0
    for value in range(iterations):
        total = (total + value * value) % 1_000_003
    return subject, total, started, time.time()

"""The toy tasks of benchmarks/test_fanout_speed.py, in a module that imports nothing: a Ray worker that runs one
imports this module alone (not equiv, torch or pandas), so what is timed is the engine, not an import."""

from __future__ import annotations


def spin(subject: str, iterations: int) -> tuple[str, int]:
    """A CPU-bound toy subject: a fixed amount of arithmetic, the same answer wherever it runs."""
    total = 0
    for value in range(iterations):
        total = (total + value * value) % 1_000_003
    return subject, total


def noop(subject: str) -> str:
    return subject

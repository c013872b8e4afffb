"""What the witness of a failing window costs (issue 44): an audited optimizer step whose window fails
(each micro-batch's mean summed, never divided), with the witness (each micro-batch replayed in float64 on
its own, the weights recovered from the Gram matrix) and without it, alternately in the same rounds; and
an audited step whose window passes, with and without (the witness is never computed there: ~1.0x).

The model and windows of benchmarks/test_audit_overhead.py (a 0.70M-parameter MLP, AdamW, N = 4
micro-batches of 16).  "Without" replaces the audit's witness by None, as before issue 44.  Reported,
never asserted as a time; the passing windows' witness calls are counted (none).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from test_audit_overhead import Classifier, _window
from torch import Tensor, nn

import equiv
import equiv.auditing.judging as judging


@contextmanager
def _witness(on: bool, calls: list[int]) -> Iterator[None]:
    """The audit's witness as it is (counted), or replaced by None (the audit before issue 44)."""
    original = judging.window_witness

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return original(*args, **kwargs)

    judging.window_witness = counted if on else (lambda *args, **kwargs: None)  # type: ignore[assignment]
    try:
        yield
    finally:
        judging.window_witness = original


def _audited_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, window: list[tuple[Tensor, Tensor]], divisor: float
) -> tuple[float, bool]:
    """One audited optimizer step (each micro-batch's mean divided by ``divisor``); its seconds and verdict."""
    with equiv.audit(model, optimizer, loss=equiv.CrossEntropy()) as watched:
        start = time.perf_counter()
        for inputs, targets in window:
            (nn.functional.cross_entropy(model(inputs, targets), targets) / divisor).backward()
        optimizer.step()
        elapsed = time.perf_counter() - start
        optimizer.zero_grad(set_to_none=True)
    return elapsed, bool(watched.windows[0])


def test_audit_witness_cost(benchmark, bench_settings) -> None:  # type: ignore[no-untyped-def]
    generator = torch.Generator().manual_seed(2)
    torch.manual_seed(2)
    model = Classifier()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times: dict[tuple[str, bool], list[float]] = {
        (kind, on): [] for kind in ("failing", "passing") for on in (True, False)
    }
    verdicts: dict[str, list[bool]] = {"failing": [], "passing": []}
    calls: dict[tuple[str, bool], list[int]] = {key: [] for key in times}
    divisors: dict[str, Callable[[int], float]] = {"failing": lambda n: 1.0, "passing": lambda n: float(n)}

    played: list[int] = []

    def one_round() -> None:
        played.append(1)
        order = (True, False) if len(played) % 2 else (False, True)  # neither always first after the other
        for kind in ("failing", "passing"):
            for on in order:
                window = _window(generator)
                with _witness(on, calls[(kind, on)]):
                    elapsed, equivalent = _audited_step(model, optimizer, window, divisors[kind](len(window)))
                times[(kind, on)].append(elapsed)
                verdicts[kind].append(equivalent)

    _audited_step(model, optimizer, _window(generator), 4.0)  # AdamW's state exists from here on
    rounds = 5 if bench_settings.quick else 15
    benchmark.pedantic(one_round, rounds=rounds, iterations=1, warmup_rounds=1)
    # what is measured: failing windows that fail, passing windows that pass and never call the witness
    assert not any(verdicts["failing"]) and all(verdicts["passing"])
    assert not calls[("passing", True)] and len(calls[("failing", True)]) == rounds + 1

    def ratio(kind: str) -> float:
        return statistics.median(a / b for a, b in zip(times[(kind, True)], times[(kind, False)], strict=True))

    benchmark.extra_info.update(
        bench_settings.extra_info(),
        audit_witness=True,
        parameters=sum(p.numel() for p in model.parameters()),
        rounds=rounds,
        failing_without_witness_median_s=statistics.median(times[("failing", False)]),
        failing_with_witness_median_s=statistics.median(times[("failing", True)]),
        failing_witness_ratio=ratio("failing"),
        passing_witness_ratio=ratio("passing"),
    )
    print(
        f"\nwitness: failing window {ratio('failing'):.3f}x (median "
        f"{statistics.median(times[('failing', True)]):.3f} s with, {statistics.median(times[('failing', False)]):.3f} s"
        f" without), passing window {ratio('passing'):.3f}x, {bench_settings.threads} thread(s)"
    )

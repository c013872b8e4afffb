"""What a check costs as the model grows: time and memory of ``equiv.check``
against the bare runs it is made of, measured side by side in one benchmark.

For a three-layer MLP of width w (about 3 w**2 parameters), AdamW, batch 8
split 3 + 5, two steps:

* **time**: ``equiv.check(accumulator_step, case)`` against the candidate's
  own two float32 steps (the same step function, model and batches, no
  check), both timed in the same benchmark; the ratio is what a user pays
  to check a step, in units of running it;
* **memory**: the peak of live tensor storages during the check (torch's
  dispatch-level storage counter, byte-identical on every run) against the
  peak of one bare float64 run of the candidate, as a number of *model
  states* (parameters + AdamW's two moments, in float64: 24 bytes per
  parameter) beyond that run.

Targets (issue "the checker at the size of a user's real model"): time at
most 15x the candidate's own float32 steps, memory growth at most 4 model
states.  They are reported, not asserted: timings belong in reports.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import pytest
import torch

import equiv
from equiv.batches import split_batch
from equiv.checking.trajectory import run_candidate
from equiv.cost.memory import StorageCounter

#: width -> about 3 * width**2 parameters: 0.1M, 1M, 4M, 16M.
WIDTHS = {"0.1M": 180, "1M": 580, "4M": 1180, "16M": 2360}
QUICK_WIDTHS = ("0.1M", "1M")
#: Float64 bytes per parameter of one AdamW model state: the parameter and two moments.
STATE_BYTES_PER_PARAMETER = 3 * 8


def _case(width: int) -> equiv.Case:
    return equiv.Case(
        batch_size=8, micro_batch_sizes=(3, 5), optimizer="AdamW", optimizer_kwargs={"lr": 1e-3}, steps=2,
        model_kwargs={"in_features": width, "hidden": (width, width), "out_features": width},
    )


def _own_steps_seconds(case: equiv.Case) -> float:
    """The candidate's own float32 steps of the case, nothing else."""
    bundle = case.build_model()
    model = bundle.module
    optimizer = case.build_optimizer(model)
    loss = case.build_loss()
    batches = [split_batch(batch, case.micro_batch_sizes) for batch in case.batches(bundle)]
    start = time.perf_counter()
    for micro_batches in batches:
        equiv.accumulator_step(model, optimizer, micro_batches, loss)
    return time.perf_counter() - start


@pytest.mark.parametrize("size", list(WIDTHS))
def test_check_scaling(benchmark: Any, bench_settings: Any, size: str) -> None:
    if bench_settings.quick and size not in QUICK_WIDTHS:
        pytest.skip(f"{size} parameters only in a full run (EQUIV_BENCH_QUICK=0)")
    if bench_settings.device.type != "cpu":
        pytest.skip("the storage counter measures CPU memory; CUDA checks are timed by the step benchmarks")
    case = _case(WIDTHS[size])
    parameters = sum(p.numel() for p in case.build_model().module.parameters())

    with StorageCounter() as bare:
        run_candidate(case, equiv.accumulator_step, torch.float64, on_snapshot=lambda step, snapshot: None)
    with StorageCounter() as checked:
        verdict = equiv.check(equiv.accumulator_step, case)
    assert verdict, verdict.message()  # the reference must pass: a failing check measures something else

    own_seconds: list[float] = []
    check_seconds: list[float] = []
    rounds = 1 if bench_settings.quick else 3

    def one_check() -> None:
        # The candidate's own steps, then the check, in every round: side by side, same load.
        own_seconds.append(_own_steps_seconds(case))
        start = time.perf_counter()
        equiv.check(equiv.accumulator_step, case)
        check_seconds.append(time.perf_counter() - start)

    _own_steps_seconds(case)  # warm-up: first-call costs are not the step's
    benchmark.pedantic(one_check, rounds=rounds, iterations=1, warmup_rounds=0)
    benchmark.extra_info.update(
        bench_settings.extra_info(),
        scaling=True,
        size=size,
        parameters=parameters,
        check_median_s=statistics.median(check_seconds),
        own_steps_median_s=statistics.median(own_seconds),
        time_ratio=statistics.median(c / o for c, o in zip(check_seconds, own_seconds, strict=True)),
        bare_run_peak_bytes=bare.peak_bytes,
        check_peak_bytes=checked.peak_bytes,
        growth_model_states=(checked.peak_bytes - bare.peak_bytes) / (STATE_BYTES_PER_PARAMETER * parameters),
        check_bytes_per_parameter=checked.peak_bytes / parameters,
    )

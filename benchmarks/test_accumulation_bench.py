"""What each N buys in memory and costs in throughput, for three workloads.

For every workload (global batch B fixed) and N in 1, 2, 3, 4, 8, 16, 32
(3 is an uneven split of every B here), side by side in one run:

* ``native``: the plain loop, ``(loss_sum / total).backward()`` per micro-batch;
* ``accumulator``: ``equiv.Accumulator``;
* ``checkpoint`` (N=1 only): activation checkpointing instead of accumulating.

Each benchmark records its peak memory (forward/backward and optimizer step,
deterministic on CPU) in ``extra_info`` and times one step per round; a round's
setup builds fresh weights and runs one untimed warm-up step (optimizer state
created, every micro-batch shape warmed).  ``test_accumulator_overhead``
times native and Accumulator steps alternately at every N, so the overhead
ratio does not depend on the machine's load drifting between two benchmarks
(the target: at most 3% at N=8 on the MLP).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import pytest
import torch

from equiv.cost.steps import PreparedStep, prepare_workload_step, synchronize
from equiv.cost.workloads import WORKLOADS

SPLITS = (1, 2, 3, 4, 8, 16, 32)
SEED = 0


def _cases() -> list[Any]:
    cases = []
    for workload in WORKLOADS:
        for n in SPLITS:
            for implementation in ("native", "accumulator") + (("checkpoint",) if n == 1 else ()):
                cases.append(pytest.param(workload, n, implementation, id=f"{workload}-N{n}-{implementation}"))
    return cases


def _prepare(workload_name: str, n: int, implementation: str, device: torch.device) -> PreparedStep:
    """Fresh weights from SEED, the fixed global batch cut into n, one warm-up step."""
    return prepare_workload_step(WORKLOADS[workload_name], n, implementation, device, seed=SEED)


@pytest.mark.parametrize(("workload_name", "n_micro_batches", "implementation"), _cases())
def test_step(
    benchmark: Any, bench_settings: Any, workload_name: str, n_micro_batches: int, implementation: str
) -> None:
    workload = WORKLOADS[workload_name]
    device = bench_settings.device
    prepared = _prepare(workload_name, n_micro_batches, implementation, device)
    memory = prepared.measure_memory()

    def setup() -> tuple[tuple[Any, ...], dict[str, Any]]:
        fresh = _prepare(workload_name, n_micro_batches, implementation, device)
        return (fresh,), {}

    def one_step(fresh: PreparedStep) -> None:
        fresh.step()
        synchronize(device)  # CUDA: the timer must include the queued kernels

    benchmark.extra_info.update(
        bench_settings.extra_info(),
        workload=workload_name,
        implementation=implementation,
        n_micro_batches=n_micro_batches,
        micro_batch_size=prepared.micro_batch_size,
        micro_batch_sizes=[int(x.shape[0]) for x, _ in prepared.micro_batches],
        global_batch_size=workload.global_batch_size,
        dtype=str(next(prepared.model.parameters()).dtype).removeprefix("torch."),
        parameters=sum(p.numel() for p in prepared.model.parameters()),
        description=workload.description,
        memory_method=memory.method,
        baseline_bytes=memory.baseline_bytes,
        forward_backward_peak_bytes=memory.forward_backward_peak_bytes,
        optimizer_step_peak_bytes=memory.optimizer_step_peak_bytes,
        peak_bytes=memory.peak_bytes,
    )
    del prepared
    benchmark.pedantic(
        one_step,
        setup=setup,
        rounds=bench_settings.rounds,
        iterations=1,
        warmup_rounds=0 if bench_settings.quick else 1,
    )


@pytest.mark.parametrize(
    ("workload_name", "n_micro_batches"),
    [pytest.param(w, n, id=f"{w}-N{n}") for w in WORKLOADS for n in SPLITS],
)
def test_accumulator_overhead(benchmark: Any, bench_settings: Any, workload_name: str, n_micro_batches: int) -> None:
    """Accumulator vs native at one N, stepped alternately (ABBA) on two models
    built from the same seed; the ratio is the median of per-pair ratios."""
    device = bench_settings.device
    native = _prepare(workload_name, n_micro_batches, "native", device)
    accumulator = _prepare(workload_name, n_micro_batches, "accumulator", device)
    seconds: dict[str, list[float]] = {"native": [], "accumulator": []}
    rounds = [0]

    def timed(name: str, prepared: PreparedStep) -> None:
        synchronize(device)
        start = time.perf_counter()
        prepared.step()
        synchronize(device)
        seconds[name].append(time.perf_counter() - start)

    def pair() -> None:
        # Alternate which goes first so neither always runs on a warmer cache.
        order = [("native", native), ("accumulator", accumulator)]
        for name, prepared in order if rounds[0] % 2 == 0 else order[::-1]:
            timed(name, prepared)
        rounds[0] += 1

    benchmark.pedantic(pair, rounds=bench_settings.overhead_pairs, iterations=1, warmup_rounds=0)
    ratios = [a / n for a, n in zip(seconds["accumulator"], seconds["native"], strict=True)]
    quartiles = statistics.quantiles(ratios, n=4)
    workload = WORKLOADS[workload_name]
    benchmark.extra_info.update(
        bench_settings.extra_info(),
        workload=workload_name,
        implementation="paired",
        n_micro_batches=n_micro_batches,
        micro_batch_size=native.micro_batch_size,
        global_batch_size=workload.global_batch_size,
        dtype="float32",
        overhead_ratio=statistics.median(ratios),
        overhead_ratio_q1=quartiles[0],
        overhead_ratio_q3=quartiles[2],
        native_median_s=statistics.median(seconds["native"]),
        accumulator_median_s=statistics.median(seconds["accumulator"]),
        pairs=len(ratios),
    )

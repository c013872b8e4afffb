"""What a check costs as the model grows: time and memory of ``equiv.check``
against the candidate's own steps and the bare runs the check made, measured
side by side in one benchmark.

For a three-layer MLP of width w (about 3 w**2 parameters: 0.1M to 16M) and,
in a full run, a GPT-2-small-shaped causal LM (124M parameters, sequences of
32 tokens, brought in with ``Case(model=..., data=..., loss=...)``); AdamW,
batch 8 split 3 + 5, two steps; for a passing candidate (``equiv.accumulator_step``)
and a failing one (the mean of per-micro-batch means, ``mean_of_means``):

* **time**: ``equiv.check(step, case)`` from scratch (no kept truth) against
  the candidate's own two float32 steps (the same step function, model and
  batches, no check) and against the bare runs that check made (recorded from
  one check: building the case's model, the float64 truth, the floor samples
  it ran, the candidate's runs; replayed with nothing compared), all timed in
  the same rounds.
  check / own steps is what a user pays to check a step, in units of running
  it; bare runs / own steps the part no comparison can remove;
* **memory**: the peak of live tensor storages during the check (torch's
  dispatch-level storage counter, byte-identical on every run; on the case's
  device, so GPU memory under ``EQUIV_BENCH_DEVICE=cuda``), per parameter.

``EQUIV_BENCH_KEEP_FREED_MEMORY=1`` measures the check as the ``equiv``
command runs it, with glibc keeping freed memory for reuse
(:mod:`equiv.host_memory`); off by default, since it holds for the rest of the
process and the other benchmarks measure training as users run it.

Targets (issue "a check that costs little more than the runs it needs"): a
passing check at most 8x the candidate's own float32 steps at 1M parameters
and more on the CPU, a failing one at most 15x; at most 100 bytes per
parameter at every size.  They are reported, not asserted: timings belong in
reports.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import equiv
import equiv.judging.judge as judge_module  # where the engine calls the runs
from equiv.batches import split_batch
from equiv.cost.memory import StorageCounter
from equiv.cost.steps import synchronize
from equiv.host_memory import keep_freed_host_memory
from equiv.judging.judge import clear_reference_cache
from equiv.judging.runs import run_candidate
from equiv.losses import TokenCrossEntropy
from equiv.results.verdict import Verdict
from equiv.zoo.bugs import BUGS

#: width -> about 3 * width**2 parameters: 0.1M, 1M, 4M, 16M; and GPT-2 small's shape (124M).
WIDTHS = {"0.1M": 180, "1M": 580, "4M": 1180, "16M": 2360}
GPT2_SMALL = "124M GPT-2"
SIZES = (*WIDTHS, GPT2_SMALL)
QUICK_SIZES = tuple(WIDTHS)
#: A passing and a failing candidate: their checks run different runs.
CANDIDATES: dict[str, Callable[..., Any]] = {"passing": equiv.accumulator_step, "failing": BUGS["mean_of_means"]}


class GPT2Shaped(nn.Module):
    """GPT-2 small's shape (12 pre-norm blocks of width 768, 12 heads, vocabulary
    50257, tied input and output embeddings: 124M parameters) in plain torch,
    dropout off; brought to the check through ``Case(model=..., data=..., loss=...)``."""

    def __init__(
        self, layers: int = 12, width: int = 768, heads: int = 12, vocab: int = 50257, positions: int = 1024
    ) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(positions, width)
        block = nn.TransformerEncoderLayer(
            width, heads, 4 * width, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.ln_f = nn.LayerNorm(width)

    def forward(self, input_ids: Tensor) -> Tensor:
        length = input_ids.shape[1]
        hidden = self.wte(input_ids) + self.wpe(torch.arange(length, device=input_ids.device))
        mask = torch.triu(torch.full((length, length), float("-inf"), device=input_ids.device), 1)
        hidden = self.blocks(hidden, mask=mask, is_causal=True)
        logits: Tensor = self.ln_f(hidden) @ self.wte.weight.T  # tied, as GPT-2
        return logits


GPT2_SEQUENCE = 32


def gpt2_tokens(step: int, batch_size: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    tokens = torch.randint(0, 50257, (batch_size, GPT2_SEQUENCE + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def _case(size: str, device: torch.device) -> equiv.Case:
    common: dict[str, Any] = dict(
        batch_size=8,
        micro_batch_sizes=(3, 5),
        optimizer="AdamW",
        optimizer_kwargs={"lr": 1e-3},
        steps=2,
        device=str(device),
    )
    if size == GPT2_SMALL:
        return equiv.Case(model=GPT2Shaped, data=gpt2_tokens, loss=TokenCrossEntropy(), **common)
    width = WIDTHS[size]
    return equiv.Case(model_kwargs={"in_features": width, "hidden": (width, width), "out_features": width}, **common)


def _own_steps_seconds(case: equiv.Case) -> float:
    """The candidate's own float32 steps of the case, nothing else."""
    device = torch.device(case.device)
    bundle = case.build_model()
    model = bundle.module.to(device)
    optimizer = case.build_optimizer(model)
    loss = case.build_loss()
    batches = [
        split_batch((inputs.to(device), targets.to(device)), case.micro_batch_sizes)
        for inputs, targets in case.batches(bundle)
    ]
    synchronize(device)
    start = time.perf_counter()
    for micro_batches in batches:
        equiv.accumulator_step(model, optimizer, micro_batches, loss)
    synchronize(device)  # CUDA: the timer must include the queued kernels
    return time.perf_counter() - start


Run = tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]


@contextmanager
def _recording_runs() -> Iterator[list[Run]]:
    """The runs equiv.check makes while inside (the truth, floor samples and
    candidate runs), recorded as calls that can be replayed."""
    runs: list[Run] = []
    originals = {"run_reference": judge_module.run_reference, "run_candidate": judge_module.run_candidate}

    def recorder(name: str) -> Callable[..., Any]:
        def record(*args: Any, **kwargs: Any) -> Any:
            # What the run is, not where its snapshots went (nor the check's own model copy).
            kept = {key: value for key, value in kwargs.items() if key not in ("on_snapshot", "on_note", "initial")}
            runs.append((originals[name], args, kept))
            return originals[name](*args, **kwargs)

        return record

    judge_module.run_reference = recorder("run_reference")  # type: ignore[assignment]
    judge_module.run_candidate = recorder("run_candidate")  # type: ignore[assignment]
    try:
        yield runs
    finally:
        judge_module.run_reference, judge_module.run_candidate = originals["run_reference"], originals["run_candidate"]  # type: ignore[assignment]


def _bare_runs_seconds(runs: list[Run], case: equiv.Case) -> tuple[float, float]:
    """The case's model built (on the host, with the case's seed: the same weights
    on every device), then the runs a check made, again, with nothing compared
    (each from that model, copied, as a check does): (seconds building, seconds
    in all, building included)."""
    start = time.perf_counter()
    initial = case.build_model()
    initial.module.to(torch.device(case.device))
    synchronize(case.device)
    built = time.perf_counter()
    for function, args, kwargs in runs:
        function(*args, **kwargs, on_snapshot=_ignore, initial=initial)
    synchronize(case.device)
    return built - start, time.perf_counter() - start


def _run_label(run: Run) -> str:
    function, args, _ = run
    dtype = str(args[2] if function is run_candidate else args[1]).removeprefix("torch.")
    return f"{'candidate' if function is run_candidate else 'full batch'} {dtype}"


def _ignore(step: int, snapshot: Any) -> None:
    """A run's snapshots, dropped: what is left is the run."""


@pytest.fixture(scope="module")
def host_allocator() -> str:
    """How the host allocator was set for this module's checks (recorded with each row)."""
    if os.environ.get("EQUIV_BENCH_KEEP_FREED_MEMORY", "0") == "1":
        return keep_freed_host_memory() or "glibc default (keeping freed memory does not apply here)"
    return "glibc default"


def _checked(step: Callable[..., Any], case: equiv.Case) -> Verdict:
    """A check from scratch: no truth kept from an earlier check of the case."""
    clear_reference_cache()
    verdict = equiv.check(step, case)
    clear_reference_cache()
    return verdict


@pytest.mark.parametrize("verdict_kind", list(CANDIDATES))
@pytest.mark.parametrize("size", SIZES)
def test_check_scaling(benchmark: Any, bench_settings: Any, host_allocator: str, size: str, verdict_kind: str) -> None:
    if bench_settings.quick and size not in QUICK_SIZES:
        pytest.skip(f"{size} parameters only in a full run (EQUIV_BENCH_QUICK=0)")
    case = _case(size, bench_settings.device)
    step = CANDIDATES[verdict_kind]
    parameters = sum(p.numel() for p in case.build_model().module.parameters())

    with StorageCounter() as checked:
        verdict = _checked(step, case)
    # A passing candidate must pass and a failing one fail: otherwise this measures something else.
    assert bool(verdict) == (verdict_kind == "passing"), verdict.message()
    with _recording_runs() as runs:
        _checked(step, case)

    own_seconds: list[float] = []
    build_seconds: list[float] = []
    bare_seconds: list[float] = []
    check_seconds: list[float] = []
    rounds = 1 if bench_settings.quick or size == GPT2_SMALL else 3

    def one_check() -> None:
        # The candidate's own steps, the bare runs, then the check, in every round: side by side, same load.
        own_seconds.append(_own_steps_seconds(case))
        build, bare = _bare_runs_seconds(runs, case)
        build_seconds.append(build)
        bare_seconds.append(bare)
        clear_reference_cache()
        start = time.perf_counter()
        equiv.check(step, case)  # its verdict is on the host: nothing left queued
        check_seconds.append(time.perf_counter() - start)
        clear_reference_cache()

    _own_steps_seconds(case)  # warm-up: first-call costs are not the step's
    benchmark.pedantic(one_check, rounds=rounds, iterations=1, warmup_rounds=0)
    benchmark.extra_info.update(
        bench_settings.extra_info(),
        scaling=True,
        host_allocator=host_allocator,
        size=size,
        verdict=verdict_kind,
        candidate=getattr(step, "__name__", "step"),
        parameters=parameters,
        check_median_s=statistics.median(check_seconds),
        own_steps_median_s=statistics.median(own_seconds),
        bare_runs_median_s=statistics.median(bare_seconds),
        time_ratio=statistics.median(c / o for c, o in zip(check_seconds, own_seconds, strict=True)),
        bare_runs_ratio=statistics.median(b / o for b, o in zip(bare_seconds, own_seconds, strict=True)),
        model_build_median_s=statistics.median(build_seconds),
        model_build_ratio=statistics.median(b / o for b, o in zip(build_seconds, own_seconds, strict=True)),
        check_over_bare_runs=statistics.median(c / b for c, b in zip(check_seconds, bare_seconds, strict=True)),
        check_peak_bytes=checked.peak_bytes,
        check_bytes_per_parameter=checked.peak_bytes / parameters,
        runs=[_run_label(run) for run in runs],
    )

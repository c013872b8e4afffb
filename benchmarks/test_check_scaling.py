"""What a check costs as the model grows: time and memory of ``equiv.check``
against the bare runs it is made of, measured side by side in one benchmark.

For a three-layer MLP of width w (about 3 w**2 parameters) and, in a full
run, a GPT-2-small-shaped causal LM (124M parameters, sequences of 32 tokens,
brought in with ``Case(model=..., data=..., loss=...)``); AdamW, batch 8 split
3 + 5, two steps:

* **time**: ``equiv.check(accumulator_step, case)`` against the candidate's
  own two float32 steps (the same step function, model and batches, no
  check) and against the bare runs a check is made of (nothing compared:
  the truth and the candidate's two runs, and the six floor samples only
  where the check needs them), all timed in the same rounds; check / own steps is what a user
  pays to check a step, in units of running it, and bare runs / own steps
  the part of it no comparison can remove;
* **memory**: the peak of live tensor storages during the check (torch's
  dispatch-level storage counter, byte-identical on every run; on the case's
  device, so GPU memory under ``EQUIV_BENCH_DEVICE=cuda``) against the
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
from torch import Tensor, nn

import equiv
from equiv.batches import split_batch
from equiv.checking.check import _SHUFFLE_SEED_OFFSETS, ReferenceRuns
from equiv.checking.trajectory import run_candidate, run_reference
from equiv.cost.memory import StorageCounter
from equiv.cost.steps import synchronize
from equiv.losses import TokenCrossEntropy

#: width -> about 3 * width**2 parameters: 0.1M, 1M, 4M, 16M; and GPT-2 small's shape (124M).
WIDTHS = {"0.1M": 180, "1M": 580, "4M": 1180, "16M": 2360}
GPT2_SMALL = "124M GPT-2"
SIZES = (*WIDTHS, GPT2_SMALL)
QUICK_SIZES = ("0.1M", "1M")
#: Float64 bytes per parameter of one AdamW model state: the parameter and two moments.
STATE_BYTES_PER_PARAMETER = 3 * 8


class GPT2Shaped(nn.Module):
    """GPT-2 small's shape (12 pre-norm blocks of width 768, 12 heads, vocabulary
    50257, tied input and output embeddings: 124M parameters) in plain torch,
    dropout off; brought to the check through ``Case(model=..., data=..., loss=...)``."""

    def __init__(self, layers: int = 12, width: int = 768, heads: int = 12, vocab: int = 50257, positions: int = 1024) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(positions, width)
        block = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, activation="gelu",
                                           batch_first=True, norm_first=True)
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
    common: dict[str, Any] = dict(batch_size=8, micro_batch_sizes=(3, 5), optimizer="AdamW",
                                  optimizer_kwargs={"lr": 1e-3}, steps=2, device=str(device))
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
    batches = [split_batch((inputs.to(device), targets.to(device)), case.micro_batch_sizes)
               for inputs, targets in case.batches(bundle)]
    synchronize(device)
    start = time.perf_counter()
    for micro_batches in batches:
        equiv.accumulator_step(model, optimizer, micro_batches, loss)
    synchronize(device)  # CUDA: the timer must include the queued kernels
    return time.perf_counter() - start


def _needs_floors(case: equiv.Case) -> bool:
    """Whether the check of the reference on ``case`` runs floor samples (a tensor past
    the floor-free roundoff term in some tier), as equiv.check decides it."""
    references = ReferenceRuns.truth_of(case)
    return not all(d.ok for tier in references.tiers
                   for d in references.run_and_compare(tier, case, equiv.accumulator_step))


def _bare_runs_seconds(case: equiv.Case, floors: bool) -> float:
    """The runs a check is made of, with nothing compared: the float64 truth and
    the candidate in float64 and float32, plus, when the check needs them
    (``floors``), the six floor samples (four float32, two float64), each from a
    model built once and copied (as a check does)."""
    initial = case.build_model()
    initial.module.to(torch.device(case.device))  # as a check does: once, not per run
    shuffles = [case.seed + offset for offset in _SHUFFLE_SEED_OFFSETS]
    start = time.perf_counter()
    for dtype in (torch.float64, torch.float32):
        if dtype == torch.float64 or floors:
            run_reference(case, dtype, on_snapshot=_ignore, initial=initial)
        if floors:
            run_reference(case, dtype, permutation_seed=shuffles[0], on_snapshot=_ignore, initial=initial)
            run_reference(case, dtype, normalise_after_backward=True, on_snapshot=_ignore, initial=initial)
        run_candidate(case, equiv.accumulator_step, dtype, on_snapshot=_ignore, initial=initial)
    if floors:
        run_reference(case, torch.float32, permutation_seed=shuffles[1], on_snapshot=_ignore, initial=initial)
    synchronize(case.device)
    return time.perf_counter() - start


def _ignore(step: int, snapshot: Any) -> None:
    """A run's snapshots, dropped: what is left is the run."""


@pytest.mark.parametrize("size", SIZES)
def test_check_scaling(benchmark: Any, bench_settings: Any, size: str) -> None:
    if bench_settings.quick and size not in QUICK_SIZES:
        pytest.skip(f"{size} parameters only in a full run (EQUIV_BENCH_QUICK=0)")
    case = _case(size, bench_settings.device)
    parameters = sum(p.numel() for p in case.build_model().module.parameters())

    with StorageCounter() as bare:
        run_candidate(case, equiv.accumulator_step, torch.float64, on_snapshot=_ignore)
    with StorageCounter() as checked:
        verdict = equiv.check(equiv.accumulator_step, case)
    assert verdict, verdict.message()  # the reference must pass: a failing check measures something else
    floors = _needs_floors(case)

    own_seconds: list[float] = []
    bare_seconds: list[float] = []
    check_seconds: list[float] = []
    rounds = 1 if bench_settings.quick or size == GPT2_SMALL else 3

    def one_check() -> None:
        # The candidate's own steps, the bare runs, then the check, in every round: side by side, same load.
        own_seconds.append(_own_steps_seconds(case))
        bare_seconds.append(_bare_runs_seconds(case, floors))
        start = time.perf_counter()
        equiv.check(equiv.accumulator_step, case)  # its verdict is on the host: nothing left queued
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
        bare_runs_median_s=statistics.median(bare_seconds),
        time_ratio=statistics.median(c / o for c, o in zip(check_seconds, own_seconds, strict=True)),
        bare_runs_ratio=statistics.median(b / o for b, o in zip(bare_seconds, own_seconds, strict=True)),
        check_over_bare_runs=statistics.median(c / b for c, b in zip(check_seconds, bare_seconds, strict=True)),
        bare_run_peak_bytes=bare.peak_bytes,
        check_peak_bytes=checked.peak_bytes,
        growth_model_states=(checked.peak_bytes - bare.peak_bytes) / (STATE_BYTES_PER_PARAMETER * parameters),
        check_bytes_per_parameter=checked.peak_bytes / parameters,
        floors_run=floors,
    )

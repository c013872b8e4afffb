"""The settings real runs carry (issue 42), on a CUDA device.

Skipped, with that reason, without a GPU (CI has none).  What they pin, each as on the CPU:

* a step that enters ``torch.autocast("cuda", dtype=torch.bfloat16)`` itself is judged in that
  precision: a correct one passes every applicable standard case, the textbook mean of means still fails;
* the audit sees the loop's own ``F.cross_entropy`` (no wrap) on the GPU: a global token mean is
  clean, a per-micro-batch mean is flagged on the windows whose token counts differ;
* an LR scheduler stepped per micro-batch is flagged, naming it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import equiv
from equiv.auditing import Audit
from equiv.auditing.runs import REAL_LENGTHS, TinyLM, padded_sequences
from equiv.cases.standard import STANDARD_CASES

if not torch.cuda.is_available():  # one skip for the module, not one per test (tests/conftest.py's reason)
    pytest.skip("needs a CUDA device; none is visible", allow_module_level=True)

pytestmark = pytest.mark.cuda

CUDA = torch.device("cuda")
IGNORE = -100


def cuda_bfloat16_step(model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: Any, loss_fn: Any) -> None:
    """Correct accumulation, forward and loss under CUDA bfloat16 autocast."""
    optimizer.zero_grad()
    total = sum(loss_fn.count(targets) for _, targets in micro_batches)
    for inputs, targets in micro_batches:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_fn.sum(model(inputs), targets) / total
        loss.backward()
    optimizer.step()


def cuda_bfloat16_mean_of_means(
    model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: Any, loss_fn: Any
) -> None:
    optimizer.zero_grad()
    for inputs, targets in micro_batches:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_fn(model(inputs), targets) / len(micro_batches)
        loss.backward()
    optimizer.step()


def test_a_cuda_autocast_step_is_judged_in_its_precision() -> None:
    cases = [dataclasses.replace(case, device="cuda") for case in STANDARD_CASES.values()]
    verdicts = [equiv.check(cuda_bfloat16_step, case) for case in cases]
    applicable = [v for v in verdicts if v.status is not equiv.Outcome.NOT_APPLICABLE]
    assert applicable and all(v for v in applicable), "\n".join(v.message() for v in applicable if not v)
    assert all(v.case.autocast == "bfloat16" for v in applicable)
    buggy = equiv.check(
        cuda_bfloat16_mean_of_means, dataclasses.replace(STANDARD_CASES["Adam, uneven 1+2"], device="cuda")
    )
    assert buggy.status is equiv.Outcome.NOT_EQUIVALENT, buggy.message()


def _windows(n: int) -> list[list[tuple[Tensor, Tensor]]]:
    sequences = padded_sequences(REAL_LENGTHS)
    micro = [
        (
            torch.stack([s[0] for s in sequences[i : i + 2]]).to(CUDA),
            torch.stack([s[1] for s in sequences[i : i + 2]]).to(CUDA),
        )
        for i in range(0, len(sequences), 2)
    ]
    return [micro[i : i + n] for i in range(0, len(micro), n)]


def _functional_run(global_mean: bool, scheduler_per_micro_batch: bool = False) -> Audit:
    torch.manual_seed(0)
    model = TinyLM().to(CUDA)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    with equiv.audit(model, optimizer, loss=equiv.NextTokenCrossEntropy(), every=1) as audited:
        for window in _windows(2):
            total = sum(int((labels[:, 1:] != IGNORE).sum()) for _, labels in window)
            for inputs, labels in window:
                logits = model(inputs)
                vocabulary = logits.shape[-1]
                flat = F.cross_entropy(
                    logits[:, :-1].reshape(-1, vocabulary),
                    labels[:, 1:].reshape(-1),
                    ignore_index=IGNORE,
                    reduction="sum" if global_mean else "mean",
                )
                (flat / total if global_mean else flat / len(window)).backward()
                if scheduler_per_micro_batch:
                    scheduler.step()
            optimizer.step()
            optimizer.zero_grad()
            if not scheduler_per_micro_batch:
                scheduler.step()
    return audited


def test_the_audit_sees_a_functional_loss_on_the_gpu() -> None:
    clean = _functional_run(global_mean=True)
    assert clean.windows and clean, clean.summary()
    flagged = _functional_run(global_mean=False)
    assert not flagged, flagged.summary()


def test_a_scheduler_stepped_per_micro_batch_is_flagged_on_the_gpu() -> None:
    audited = _functional_run(global_mean=True, scheduler_per_micro_batch=True)
    assert not audited, audited.summary()
    assert "LambdaLR" in audited.summary(), audited.summary()

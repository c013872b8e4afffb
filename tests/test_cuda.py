"""The checker and the Accumulator on a CUDA device.

Every test here needs a GPU and is skipped, with that reason, without one
(CI has none).  What they pin:

* a check run on the GPU gives the verdict the CPU gives, for the reference
  and every bug of the zoo on every standard case (the pinned verdicts'
  statuses: the float64 kernels differ, the judgement must not);
* comparing a step on the GPU reads the host once per step, plus once per
  row it details (a failing tensor, or a new worst): no per-tensor round trips;
* the Accumulator never waits for the host in a micro-step, and reads it
  once per window (its item count, to refuse a window of 0 items) when no
  GradScaler is involved.
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import equiv
from equiv.judging.compare import StepComparer
from equiv.judging.judge import ReferenceRuns
from equiv.judging.runs import Snapshot, run_candidate
from equiv.zoo.bugs import BUGS

if not torch.cuda.is_available():  # one skip for the module, not one per test (tests/conftest.py's reason)
    pytest.skip("needs a CUDA device; none is visible", allow_module_level=True)

pytestmark = pytest.mark.cuda

PINNED = Path(__file__).parent / "data" / "pinned_verdicts.json"
CANDIDATES = {"accumulator_step": equiv.accumulator_step, **BUGS}


def _pinned_rows() -> list[dict[str, Any]]:
    return list(json.loads(PINNED.read_text()))


@pytest.mark.parametrize("row", _pinned_rows(), ids=lambda row: f"{row['candidate']}-{row['case_name']}")
def test_the_gpu_verdict_is_the_cpu_one(row: dict[str, Any]) -> None:
    case = equiv.Case.from_dict({**row["case"], "device": "cuda"})
    verdict = equiv.check(CANDIDATES[row["candidate"]], case)
    assert verdict.status == row["facts"]["status"], verdict.message()
    # A precision finding (float64-only, float32-sized differences) passes past its exact-tier
    # allowance by definition: the GPU must find the same one, for the same cause.
    assert (None if verdict.precision is None else verdict.precision.cause) == row["facts"]["precision"], (
        verdict.message()
    )
    # Any other passing check on the GPU stays clear of its allowance as on the CPU (within the floor's noise).
    if row["facts"]["status"] == "equivalent" and row["facts"]["precision"] is None:
        assert all(diff.ratio < 1 for diff in verdict.worst.values()), verdict.message()


def _copy(snapshot: Snapshot) -> Snapshot:
    return Snapshot(
        params={name: value.detach().clone() for name, value in snapshot.params.items()},
        buffers={name: value.detach().clone() for name, value in snapshot.buffers.items()},
        optimizer_state={name: value.detach().clone() for name, value in snapshot.optimizer_state.items()},
    )


def _host_syncs(caught: list[warnings.WarningMessage]) -> int:
    """The synchronizing calls torch's sync debug mode reported (not its own notice, since torch 2.11,
    that the mode "is a prototype feature")."""
    return sum("called a synchronizing" in str(w.message) for w in caught)


@pytest.mark.parametrize("candidate", ["accumulator_step", "mean_of_means"])
def test_a_compared_step_reads_the_host_once_plus_once_per_detailed_row(candidate: str) -> None:
    case = equiv.Case(
        batch_size=12,
        micro_batch_sizes=(1, 4, 7),
        model_kwargs={"hidden": (8, 8)},
        optimizer="AdamW",
        optimizer_kwargs={"lr": 1e-2},
        steps=3,
        device="cuda",
    )
    references = ReferenceRuns.of(case, ("exact",))
    snapshots: list[Snapshot] = []
    run_candidate(
        case,
        CANDIDATES[candidate],
        torch.float64,
        initial=references.initial,
        on_snapshot=lambda step, snapshot: snapshots.append(_copy(snapshot)),
    )
    comparer = StepComparer(tier="exact", dtype=torch.float64, floors=references.floors["exact"])
    comparer.add(0, snapshots[0])  # the run's start: one read for the whole model
    for step, snapshot in enumerate(snapshots[1:], start=1):
        before = len(comparer.diffs)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                comparer.add(step, snapshot)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        rows = comparer.diffs[before:]
        detailed = sum(not math.isnan(row.max_rel_diff) for row in rows)
        if step == 1:
            assert detailed >= 1  # the first row compared is the worst so far
        if candidate == "accumulator_step":
            assert detailed < len(rows)  # a passing step details only its new worsts
        assert _host_syncs(caught) == 1 + detailed, [str(w.message) for w in caught]
    assert any(not row.ok for row in comparer.diffs) == (candidate == "mean_of_means")


def test_the_accumulator_reads_the_host_once_per_window_and_never_per_micro_step() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 16), nn.Tanh(), nn.Linear(16, 2)).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    accumulator = equiv.Accumulator(model, optimizer, max_grad_norm=1.0, scheduler=scheduler)
    generator = torch.Generator().manual_seed(1)
    x, y = torch.randn(12, 3, generator=generator).cuda(), torch.randn(12, 2, generator=generator).cuda()
    sizes = [1, 4, 7]
    # Item counts as device tensors made before the window (torch.tensor(n, device=...) is itself a host copy).
    items = [torch.tensor(2 * size).cuda() for size in sizes]
    torch.cuda.synchronize()
    for _ in range(2):  # two windows: the second starts from a stepped optimizer
        torch.cuda.set_sync_debug_mode("error")
        try:
            for xb, yb, count in zip(x.split(sizes), y.split(sizes), items, strict=True):
                loss = nn.functional.mse_loss(model(xb), yb, reduction="sum")
                accumulator.backward(loss, items=count)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                result = accumulator.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        # The one read: a window of 0 items is refused with a clear error, not divided by.
        assert _host_syncs(caught) == 1, [str(w.message) for w in caught]
    assert result.stepped and result.grad_norm is not None and result.grad_norm.device.type == "cuda"
    assert optimizer.param_groups[0]["lr"] == 2.5e-4

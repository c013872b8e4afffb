"""equiv.cost.memory: the CPU storage counter is exact and byte-identical on repeat."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from torch import nn

from equiv.cost.memory import StepMemory, StorageCounter, measure_step_memory, training_state_tensors

FLOAT32_BYTES = 4


def _tiny_step(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer, object, object]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(model.parameters())
    inputs, targets = torch.randn(12, 16), torch.randn(12, 4)

    def accumulate() -> None:
        for x, y in zip(inputs.tensor_split(3), targets.tensor_split(3), strict=True):
            (nn.functional.mse_loss(model(x), y, reduction="sum") / 12).backward()

    def update() -> None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    accumulate()
    update()  # warm-up: AdamW state exists from here on
    return model, optimizer, accumulate, update


def _measure(seed: int = 0) -> StepMemory:
    model, optimizer, accumulate, update = _tiny_step(seed)
    return measure_step_memory(accumulate, update, roots=training_state_tensors(model, optimizer))  # type: ignore[arg-type]


def test_counter_counts_an_allocation_exactly_and_views_once() -> None:
    with StorageCounter() as counter:
        start = counter.live_bytes
        x = torch.empty(1000, dtype=torch.float32)
        assert counter.live_bytes - start == 1000 * FLOAT32_BYTES
        view = x.view(10, 100)[2:]  # shares x's storage: no new bytes
        assert counter.live_bytes - start == 1000 * FLOAT32_BYTES
        del x, view
        assert counter.live_bytes == start
        assert counter.peak_bytes - start == 1000 * FLOAT32_BYTES


def test_phase_peak_starts_from_what_is_live() -> None:
    with StorageCounter() as counter:
        kept = torch.zeros(256)
        with counter.phase("a"):
            tmp = torch.ones(512)
            del tmp
        with counter.phase("b"):
            pass
    assert counter.phase_peak_bytes["a"] == (256 + 512) * FLOAT32_BYTES
    assert counter.phase_peak_bytes["b"] == 256 * FLOAT32_BYTES
    del kept


def test_phases_do_not_nest() -> None:
    with StorageCounter() as counter, counter.phase("outer"):
        with pytest.raises(RuntimeError, match="phases do not nest"):
            with counter.phase("inner"):
                pass


def test_step_memory_is_byte_identical_on_repeat() -> None:
    first, second = _measure(), _measure()
    assert first == second
    assert first.method == "storage-counter"


def test_step_memory_is_byte_identical_in_another_process() -> None:
    code = (
        "import json, sys; sys.path[:0] = " + json.dumps(sys.path) + "\n"
        "from tests.test_memory import _measure\n"
        "print(json.dumps(_measure().to_dict()))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == _measure().to_dict()


def test_baseline_is_parameters_plus_optimizer_state() -> None:
    model, optimizer, accumulate, update = _tiny_step()
    params = sum(p.numel() for p in model.parameters()) * FLOAT32_BYTES
    memory = measure_step_memory(accumulate, update, roots=training_state_tensors(model, optimizer))  # type: ignore[arg-type]
    # AdamW keeps exp_avg and exp_avg_sq per parameter, plus a 0-d float32 step count each.
    state = 2 * params + len(list(model.parameters())) * FLOAT32_BYTES
    assert memory.baseline_bytes == params + state
    assert memory.forward_backward_peak_bytes > memory.baseline_bytes
    # Gradients are alive when the optimizer steps: its peak holds at least them.
    assert memory.optimizer_step_peak_bytes >= memory.baseline_bytes + params
    assert memory.peak_bytes == max(memory.forward_backward_peak_bytes, memory.optimizer_step_peak_bytes)


def test_unknown_device_is_refused() -> None:
    with pytest.raises(ValueError, match="device must be 'cpu' or 'cuda"):
        measure_step_memory(lambda: None, lambda: None, roots=[], device="meta")


@pytest.mark.cuda
def test_cuda_allocator_peak_sees_a_temporary() -> None:
    def accumulate() -> None:
        torch.empty(2**20, device="cuda")  # 4 MiB, freed at once

    memory = measure_step_memory(accumulate, lambda: None, roots=[], device="cuda")
    assert memory.method == "cuda-allocator"
    assert memory.forward_backward_peak_bytes - memory.baseline_bytes >= 2**20 * FLOAT32_BYTES


def test_whole_step_peak_agrees_with_torch_mem_tracker() -> None:
    """An independent counter in torch itself gives the same peak, to the byte.
    (MemTracker refuses a module called twice per step, so: one micro-batch.)"""
    mem_tracker = pytest.importorskip("torch.distributed._tools.mem_tracker")

    def build() -> tuple[nn.Module, torch.optim.Optimizer, list[torch.Tensor], object, object]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 4))
        optimizer = torch.optim.AdamW(model.parameters())
        x, y = torch.randn(32, 64), torch.randn(32, 4)

        def accumulate() -> None:
            (nn.functional.mse_loss(model(x), y, reduction="sum") / 32).backward()

        def update() -> None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        accumulate()
        update()
        return model, optimizer, [x, y], accumulate, update

    model, optimizer, batch, accumulate, update = build()
    ours = measure_step_memory(accumulate, update, roots=[*training_state_tensors(model, optimizer), *batch])  # type: ignore[arg-type]

    model, optimizer, batch, accumulate, update = build()
    tracker = mem_tracker.MemTracker()
    tracker.track_external(model, optimizer, *batch)
    with tracker:
        accumulate()  # type: ignore[operator]
        update()  # type: ignore[operator]
    assert tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"] == ours.peak_bytes

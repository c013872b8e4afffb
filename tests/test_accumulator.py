"""equiv.Accumulator on its own: features and misuse."""

import copy

import pytest
import torch
from torch import nn

import equiv


def tiny(device: str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(device=device, dtype=dtype)


def data(n: int = 6, device: str = "cpu", dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    x, y = torch.randn(n, 3, generator=generator), torch.randn(n, 2, generator=generator)
    return x.to(device, dtype), y.to(device, dtype)


def sum_mse(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(model(x), y, reduction="sum")


def test_gradients_are_cleared_and_optimizer_stepped_once_per_window() -> None:
    model = tiny()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    accumulator = equiv.Accumulator(model, optimizer)
    x, y = data()
    for xb, yb in zip(x.split([1, 2, 3]), y.split([1, 2, 3]), strict=True):
        accumulator.backward(sum_mse(model, xb, yb), items=yb.numel())
    assert accumulator.micro_batches == 3
    result = accumulator.step()
    assert result.micro_batches == 3 and result.items == 12 and result.stepped
    assert all(p.grad is None for p in model.parameters())
    assert {int(s["step"]) for s in optimizer.state.values()} == {1}
    assert accumulator.micro_batches == 0


def test_scheduler_steps_once_per_window() -> None:
    model = tiny()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    accumulator = equiv.Accumulator(model, optimizer, scheduler=scheduler)
    x, y = data()
    for _ in range(2):
        for xb, yb in zip(x.split(2), y.split(2), strict=True):
            accumulator.backward(sum_mse(model, xb, yb), items=len(xb))
        accumulator.step()
    assert optimizer.param_groups[0]["lr"] == 0.25


def test_clipping_returns_the_pre_clip_norm_and_clips_the_accumulated_gradient() -> None:
    model, reference = tiny(), tiny()
    x, y = data()
    nn.functional.mse_loss(reference(x), y, reduction="sum").div(y.numel()).backward()
    expected_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e-3)
    accumulator = equiv.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.0), max_grad_norm=1e-3)
    for xb, yb in zip(x.split([5, 1]), y.split([5, 1]), strict=True):
        accumulator.backward(sum_mse(model, xb, yb), items=yb.numel())
    result = accumulator.step()
    assert result.grad_norm is not None
    torch.testing.assert_close(result.grad_norm, expected_norm)


def test_tensor_item_counts_stay_tensors_on_the_device(device: str) -> None:
    model = tiny(device)
    accumulator = equiv.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = data(device=device)
    for xb, yb in zip(x.split(3), y.split(3), strict=True):
        accumulator.backward(sum_mse(model, xb, yb), items=torch.tensor(yb.numel(), device=device))
    result = accumulator.step()
    assert isinstance(result.items, torch.Tensor) and result.items.device.type == torch.device(device).type
    assert int(result.items) == 12


@pytest.mark.cuda
def test_micro_steps_never_synchronise_with_the_host() -> None:
    model = tiny("cuda")
    accumulator = equiv.Accumulator(
        model, torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True), max_grad_norm=1.0
    )
    x, y = data(device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        for xb, yb in zip(x.split(2), y.split(2), strict=True):
            accumulator.backward(sum_mse(model, xb, yb), items=(yb != 0).sum())
    finally:
        torch.cuda.set_sync_debug_mode("default")
    accumulator.step()


def test_grad_scaler_skips_the_whole_window_when_one_micro_batch_overflows() -> None:
    model = tiny()
    before = copy.deepcopy(model.state_dict())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    accumulator = equiv.Accumulator(model, optimizer, grad_scaler=scaler, scheduler=scheduler)
    x, y = data()
    accumulator.backward(sum_mse(model, x[:3], y[:3]), items=6)
    accumulator.backward(sum_mse(model, x[3:], y[3:]) * float("inf"), items=6)  # overflows
    result = accumulator.step()
    assert not result.stepped
    assert scaler.get_scale() == 2.0**9  # backed off once for the window
    assert optimizer.param_groups[0]["lr"] == 0.1  # scheduler not stepped for a skipped window
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name
    assert all(p.grad is None for p in model.parameters())

    # The next window is clean and matches an unscaled full-batch step exactly
    # (a power-of-two scale unscales without rounding).
    reference = copy.deepcopy(model)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    nn.functional.mse_loss(reference(x), y).backward()
    reference_optimizer.step()
    accumulator.backward(sum_mse(model, x[:3], y[:3]), items=6)
    accumulator.backward(sum_mse(model, x[3:], y[3:]), items=6)
    assert accumulator.step().stepped
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q)


def test_bfloat16_parameters_accumulate_in_a_float32_buffer() -> None:
    model = tiny(dtype=torch.bfloat16)
    start = [p.detach().clone() for p in model.parameters()]
    accumulator = equiv.Accumulator(model, torch.optim.SGD(model.parameters(), lr=1.0), accumulate_dtype=torch.float32)
    assert accumulator.buffer_bytes == sum(p.numel() * 4 for p in model.parameters())
    x, y = data(dtype=torch.bfloat16)
    expected = [torch.zeros_like(p, dtype=torch.float32) for p in model.parameters()]
    for xb, yb in zip(x.split(2), y.split(2), strict=True):
        grads = torch.autograd.grad(sum_mse(model, xb, yb), list(model.parameters()))
        for total, grad in zip(expected, grads, strict=True):
            total += grad.float()
        accumulator.backward(sum_mse(model, xb, yb), items=yb.numel())
    accumulator.step()
    for p, p0, total in zip(model.parameters(), start, expected, strict=True):
        assert torch.equal(p, p0 - (total / 12).to(torch.bfloat16))


def test_no_second_copy_when_parameters_are_already_as_wide() -> None:
    model = tiny()
    accumulator = equiv.Accumulator(model, torch.optim.SGD(model.parameters(), lr=1.0), accumulate_dtype=torch.float32)
    assert accumulator.buffer_bytes == 0


def test_step_without_micro_batch_is_an_error() -> None:
    model = tiny()
    accumulator = equiv.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(RuntimeError, match="step\\(\\) called with no micro-batch"):
        accumulator.step()


@pytest.mark.parametrize("items", [0, torch.tensor(0)], ids=["int", "tensor"])
def test_zero_total_items_is_an_error(items: int | torch.Tensor) -> None:
    model = tiny()
    accumulator = equiv.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = data()
    accumulator.backward(sum_mse(model, x, y) * 0, items=items)
    with pytest.raises(ValueError, match="micro-batches hold 0 items in total"):
        accumulator.step()


def test_parameters_on_mixed_devices_are_refused() -> None:
    model = tiny()
    model[2].to("meta")
    with pytest.raises(ValueError, match=r"one device.*\['cpu', 'meta'\]"):
        equiv.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_gradients_left_from_before_the_window_are_refused() -> None:
    model = tiny()
    x, y = data()
    sum_mse(model, x, y).backward()
    accumulator = equiv.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(RuntimeError, match="already hold gradients at the start of a window"):
        accumulator.backward(sum_mse(model, x, y), items=12)


@pytest.mark.parametrize(
    ("kwargs", "items", "error", "message"),
    [
        ({"max_grad_norm": 0.0}, 1, ValueError, "max_grad_norm must be a positive number or None, got 0.0"),
        ({"accumulate_dtype": torch.int32}, 1, ValueError, "accumulate_dtype must be a floating dtype"),
        ({}, 1.5, TypeError, "items must be an int or a 0-d integer tensor, got 1.5"),
        ({}, -1, ValueError, "items must be >= 0, got -1"),
        ({}, torch.tensor(2.0), ValueError, "items must be a 0-d integer tensor, got dtype torch.float32"),
    ],
    ids=["zero_clip", "int_accumulate_dtype", "float_items", "negative_items", "float_tensor_items"],
)
def test_bad_arguments_name_the_value(kwargs: dict, items: object, error: type, message: str) -> None:
    model = tiny()
    x, y = data()
    with pytest.raises(error, match=message):
        accumulator = equiv.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)
        accumulator.backward(sum_mse(model, x, y), items=items)  # type: ignore[arg-type]


def test_non_scalar_loss_is_refused() -> None:
    model = tiny()
    accumulator = equiv.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = data()
    with pytest.raises(ValueError, match=r"loss_sum must be a scalar \(0-d\) tensor, got shape \(6, 2\)"):
        accumulator.backward(nn.functional.mse_loss(model(x), y, reduction="none"), items=12)


def test_grad_scaler_with_a_widening_buffer_is_refused() -> None:
    model = tiny(dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"grad_scaler with accumulate_dtype=torch\.float32"):
        equiv.Accumulator(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            grad_scaler=torch.amp.GradScaler("cpu"),
            accumulate_dtype=torch.float32,
        )

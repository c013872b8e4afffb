"""The state around the model (issue 34): an EMA / ``AveragedModel`` handed to the
audit is checked to move once per optimizer step by its rule (a run that moves it
once per micro-batch passes every window of the model and fails here), and the
windows reach TensorBoard beside the loss curve."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import equiv
from equiv.auditing import audit
from equiv.auditing.watch import Audit
from equiv.outcomes import Outcome

MICRO_BATCHES = 4


class Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, inputs: Tensor) -> Tensor:
        return self.net(inputs)  # type: ignore[no-any-return]


def _windows(count: int) -> list[list[tuple[Tensor, Tensor]]]:
    generator = torch.Generator().manual_seed(0)
    return [
        [(torch.randn(3, 3, generator=generator), torch.randn(3, 1, generator=generator)) for _ in range(MICRO_BATCHES)]
        for _ in range(count)
    ]


def _run(update: str, *, averaged_kind: str = "ema", windows: int = 4, decay: float = 0.9) -> Audit:
    """A correct accumulation loop whose averaged copy is updated ``update``: "per_step" (after
    each optimizer step), "per_micro_batch" (after each backward), "every_3_micro_batches" (a
    counter of micro-steps, as a loop counting its own iterations would) or "never"."""
    torch.manual_seed(0)
    model = Regressor()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    if averaged_kind == "ema":
        averaged: AveragedModel | equiv.ExponentialAverage = AveragedModel(
            model, multi_avg_fn=get_ema_multi_avg_fn(decay)
        )
        move = averaged.update_parameters
    elif averaged_kind == "swa":
        averaged = AveragedModel(model)
        move = averaged.update_parameters
    else:  # a hand-written EMA over a deepcopy of the model
        shadow = copy.deepcopy(model)
        averaged = equiv.ExponentialAverage(shadow, decay=decay)

        def move(source: nn.Module) -> None:
            with torch.no_grad():
                for kept, weight in zip(shadow.parameters(), source.parameters(), strict=True):
                    kept.mul_(decay).add_(weight, alpha=1 - decay)

    micro_step = 0
    criterion = nn.MSELoss(reduction="sum")
    with audit(model, optimizer, loss=equiv.MSE(), criterion=criterion, averaged=averaged) as watched:
        for window in _windows(windows):
            samples = sum(targets.numel() for _, targets in window)
            for inputs, targets in window:
                (criterion(model(inputs), targets) / samples).backward()
                micro_step += 1
                if update == "per_micro_batch" or (update == "every_3_micro_batches" and micro_step % 3 == 0):
                    move(model)
            optimizer.step()
            optimizer.zero_grad()
            if update == "per_step":
                move(model)
    return watched


@pytest.mark.parametrize("kind", ["ema", "swa", "hand_written"])
def test_an_average_moved_once_per_optimizer_step_passes(kind: str) -> None:
    watched = _run("per_step", averaged_kind=kind)
    assert watched.status is Outcome.EQUIVALENT, watched.summary()
    assert watched.judged == 4
    # the average was judged (its rows are among the window's), from the second window on
    assert watched.windows[1].worst is not None


@pytest.mark.parametrize("kind", ["ema", "swa", "hand_written"])
def test_an_average_moved_per_micro_batch_is_flagged_while_the_model_is_right(kind: str) -> None:
    watched = _run("per_micro_batch", averaged_kind=kind)
    # the model's own update is the full-batch one in every window: only the average is off
    first, *later = watched.windows
    assert first.status is Outcome.EQUIVALENT  # the first window's average is not checked
    assert later and all(window.status is Outcome.NOT_EQUIVALENT for window in later), watched.summary()
    for window in later:
        assert all(row.name.startswith("averaged:") for row in window.mismatches), window.line()
        assert "once per optimizer step (not per micro-batch)" in window.line()
    text = later[0].line()
    if kind == "hand_written":
        # the pull of 4 moves towards unchanged weights, read back as a count of moves
        moves = float(text.split("moved as ")[1].split(" updates")[0])
        assert moves == pytest.approx(MICRO_BATCHES, rel=0.05), text
    else:
        assert f"updated {MICRO_BATCHES} times in this window" in text, text


def test_an_average_counted_by_micro_steps_is_flagged_on_the_steps_it_misses_or_doubles() -> None:
    watched = _run("every_3_micro_batches", windows=5)
    # micro-steps 3, 6, 9, 12, 15, 18: windows of 4 hold 1, 1, 1, 0, 2 ... updates, never one per step
    assert watched.failures, watched.summary()
    assert any("updated 0 times" in window.line() for window in watched.failures) or any(
        "updated 2 times" in window.line() for window in watched.failures
    )


def test_an_average_never_updated_is_flagged() -> None:
    watched = _run("never", averaged_kind="ema")
    assert [window.status for window in watched.windows[1:]] == [Outcome.NOT_EQUIVALENT] * 3
    assert "updated 0 times" in watched.windows[1].line()


def test_what_the_audit_takes_as_an_average_is_checked_on_entry() -> None:
    model = Regressor()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match=r"averaged must be a torch\.optim\.swa_utils\.AveragedModel"):
        audit(model, optimizer, loss=equiv.MSE(), averaged=copy.deepcopy(model))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"decay must be a number in \[0, 1\)"):
        equiv.ExponentialAverage(copy.deepcopy(model), decay=1.5)
    with pytest.raises(ValueError, match="the ExponentialAverage's module must have the model's parameters"):
        audit(model, optimizer, loss=equiv.MSE(), averaged=equiv.ExponentialAverage(nn.Linear(3, 1), decay=0.9))
    with pytest.raises(ValueError, match="use_buffers=False"):
        audit(model, optimizer, loss=equiv.MSE(), averaged=AveragedModel(model, use_buffers=True))


def test_windows_reach_tensorboard_beside_the_loss_curve(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(tmp_path))
    seen: list[int] = []
    torch.manual_seed(0)
    model = Regressor()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    on_window = equiv.auditing.tensorboard_writer(
        writer, global_step=lambda window: 100 + window.step, then=lambda window: seen.append(window.step)
    )
    with audit(model, optimizer, loss=equiv.MSE(), on_window=on_window) as watched:
        mse = watched.wrap(nn.functional.mse_loss)
        for index, window in enumerate(_windows(3)):
            for inputs, targets in window:
                # the last window divides by the micro-batch's own count: a mean of means, flagged
                count = targets.numel() if index == 2 else sum(t.numel() for _, t in window)
                (mse(model(inputs), targets, reduction="sum") / count).backward()
            optimizer.step()
            optimizer.zero_grad()
    writer.close()
    assert seen == [0, 1, 2]
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    ratios = events.Scalars("equiv/audit/worst_ratio")
    assert [event.step for event in ratios] == [100, 101, 102]
    assert [event.value for event in ratios] == pytest.approx([w.worst.ratio for w in watched.windows], rel=1e-6)
    assert [event.value for event in events.Scalars("equiv/audit/equivalent")] == [1.0, 1.0, 0.0]
    texts = events.Tensors("equiv/audit/verdict/text_summary")
    assert [event.step for event in texts] == [102]  # only the window that is not equivalent writes its line
    assert "NOT equivalent" in texts[0].tensor_proto.string_val[0].decode()
    assert math.isfinite(ratios[0].value) and ratios[0].value <= 1 < ratios[2].value


def test_a_writer_without_add_scalar_is_refused() -> None:
    with pytest.raises(TypeError, match="writer must have add_scalar and add_text"):
        equiv.auditing.tensorboard_writer(object())  # type: ignore[arg-type]

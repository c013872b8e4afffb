"""Honest outcomes of equiv.audit (issue 34): a non-finite run is named and never
equivalent, every window is counted (and an audit that judged nothing fails
unless allowed), dropout says what to do, a foreign optimizer is refused on
entry, and the windows are written as JSON lines under the schema."""

from __future__ import annotations

import json
import math
from pathlib import Path

import jsonschema
import pytest
import torch
from torch import Tensor, nn

import equiv
from equiv.auditing import audit
from equiv.auditing.replay import WindowAudit
from equiv.auditing.watch import Audit
from equiv.outcomes import Outcome
from equiv.results.protocol import Result, schema
from equiv.results.verdict import TensorDiff


class Regressor(nn.Module):
    def __init__(self, dropout: float | None = None) -> None:
        super().__init__()
        middle = nn.Tanh() if dropout is None else nn.Dropout(dropout)
        self.net = nn.Sequential(nn.Linear(3, 8), middle, nn.Linear(8, 1))

    def forward(self, inputs: Tensor, targets: Tensor | None = None) -> Tensor:
        return self.net(inputs)  # type: ignore[no-any-return]


def _batches(windows: int, *, poison: int | None = None) -> list[list[tuple[Tensor, Tensor]]]:
    """``windows`` windows of two micro-batches of 3 samples (targets NaN in window ``poison``)."""
    generator = torch.Generator().manual_seed(0)
    out = []
    for window in range(windows):
        micro = []
        for _ in range(2):
            inputs, targets = torch.randn(3, 3, generator=generator), torch.randn(3, 1, generator=generator)
            if window == poison:
                targets = torch.full_like(targets, math.nan)
            micro.append((inputs, targets))
        out.append(micro)
    return out


def _sgd_loop(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    windows: list[list[tuple[Tensor, Tensor]]],
    *,
    loss_scale: float = 1.0,
) -> None:
    for window in windows:
        samples = sum(targets.numel() for _, targets in window)
        for inputs, targets in window:
            loss = torch.nn.functional.mse_loss(model(inputs, targets), targets, reduction="sum") / samples
            (loss * loss_scale).backward()
        optimizer.step()
        optimizer.zero_grad()


def _audited(windows: list[list[tuple[Tensor, Tensor]]], **settings: object) -> Audit:
    torch.manual_seed(0)
    model = Regressor()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with audit(model, optimizer, loss=equiv.MSE(), **settings) as watched:  # type: ignore[arg-type]
        _sgd_loop(model, optimizer, windows)
    return watched


# -- 1. non-finite values ---------------------------------------------------------------------


def test_a_nan_diff_is_never_ok_whatever_its_allowance() -> None:
    # The engine's one rule: a row whose greatest difference or allowance is not finite is not ok
    # (a NaN allowance, from a NaN truth's scale, let an infinite difference through).
    row = TensorDiff(1, "w", "update", "noise", "float32", math.inf, (), math.nan, (), math.nan, "", 0, 4)
    assert not row.ok
    row = TensorDiff(1, "w", "update", "noise", "float32", math.inf, (), math.nan, (), math.inf, "", 0, 4)
    assert not row.ok
    assert TensorDiff(1, "w", "update", "noise", "float32", 0.5, (), 0.1, (), 1.0, "", 0, 4).ok


def test_a_nan_loss_run_is_never_equivalent_and_the_nan_is_named() -> None:
    torch.manual_seed(0)
    model = Regressor()
    with torch.no_grad():
        model.net[0].weight[1, 2] = math.nan  # the loss is NaN from the first step
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with audit(model, optimizer, loss=equiv.MSE()) as watched:
        _sgd_loop(model, optimizer, _batches(4))
    assert len(watched.windows) == 4
    assert not any(window.equivalent for window in watched.windows), watched.summary()
    assert all(window.status is Outcome.NOT_EQUIVALENT for window in watched.windows)
    first = watched.windows[0]
    assert first.not_finite is not None and "NaN" in first.not_finite
    assert "gradient" in first.not_finite and "'net.0.weight'" in first.not_finite, first.not_finite
    assert "NaN" in first.line() and "equivalent (worst" not in watched.summary()
    assert not watched
    with pytest.raises(AssertionError, match="NaN"):
        watched.assert_ok()


def test_a_window_whose_full_batch_loss_is_not_finite_is_said_plainly() -> None:
    # The user's data makes the window's loss NaN (NaN targets in window 1): the full-batch step of that
    # window is itself NaN, and its window is neither equivalent nor a run bug hidden behind "inf of its scale".
    watched = _audited(_batches(3, poison=1))
    flags = [window.equivalent for window in watched.windows]
    assert flags[0] is True and flags[1] is False, watched.summary()
    poisoned = watched.windows[1]
    assert poisoned.not_finite is not None and "not finite" in poisoned.line()
    assert "NaN" in poisoned.not_finite


class MaskedMSE(equiv.MSE):
    """MSE over the targets that are not NaN (a NaN target: a missing label)."""

    def sum(self, output: Tensor, target: Tensor) -> Tensor:
        keep = ~torch.isnan(target)
        return ((output - torch.nan_to_num(target)) ** 2 * keep).sum()

    def count(self, target: Tensor) -> int:
        return int((~torch.isnan(target)).sum())


def test_a_window_with_no_item_to_count_is_not_judged_and_its_run_is_finite() -> None:
    # Window 1 has every label missing: the run divides by max(count, 1) (no update), the full batch's
    # mean over 0 items is 0 / 0: its step is NaN while the run's is finite, so the window is not judged.
    loss = MaskedMSE()
    torch.manual_seed(0)
    model = Regressor()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with audit(model, optimizer, loss=loss) as watched:
        for window in _batches(3, poison=1):
            items = max(sum(loss.count(targets) for _, targets in window), 1)
            for inputs, targets in window:
                (loss.sum(model(inputs, targets), targets) / items).backward()
            optimizer.step()
            optimizer.zero_grad()
    poisoned = watched.windows[1]
    assert poisoned.full_batch_not_finite and poisoned.status is Outcome.NOT_APPLICABLE, watched.summary()
    assert "of the full-batch step is not finite" in poisoned.line() and "0 items" in poisoned.line()
    assert [window.equivalent for window in watched.windows] == [True, False, True]
    assert watched.failures == [] and not watched and watched.counts()["full_batch_not_finite"] == 1
    assert "1 whose full-batch step is not finite" in watched.summary()


def test_a_finite_run_has_no_not_finite_note() -> None:
    watched = _audited(_batches(2))
    assert watched and all(window.not_finite is None for window in watched.windows), watched.summary()


# -- 2. every window counted ---------------------------------------------------------------------


def test_an_audit_that_judged_nothing_says_why_and_fails_assert_ok() -> None:
    torch.manual_seed(0)
    model = Regressor()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with audit(model, optimizer, loss=equiv.MSE()) as watched:
        pass  # an empty loader: the loop never ran
    assert watched.failures == [] and watched.status is Outcome.NOT_APPLICABLE
    assert "nothing judged" in watched.line() and "no optimizer step" in watched.summary()
    with pytest.raises(AssertionError, match="nothing judged"):
        watched.assert_ok()
    with audit(model, optimizer, loss=equiv.MSE(), allow_nothing_judged=True) as allowed:
        pass
    allowed.assert_ok()  # the user said an empty audit is fine


def test_a_loop_that_never_steps_is_named() -> None:
    torch.manual_seed(0)
    model = Regressor()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with audit(model, optimizer, loss=equiv.MSE()) as watched:
        for inputs, targets in _batches(1)[0]:
            torch.nn.functional.mse_loss(model(inputs, targets), targets).backward()
    assert "optimizer.step() was never called" in watched.summary(), watched.summary()
    with pytest.raises(AssertionError):
        watched.assert_ok()


def test_every_window_is_counted_judged_or_not_sampled() -> None:
    watched = _audited(_batches(5), every=2)
    assert watched.steps == 5 and len(watched.windows) == 3
    assert watched.counts() == {
        "equivalent": 3,
        "not_equivalent": 0,
        "inherent": 0,
        "full_batch_not_finite": 0,
        "not_sampled": 2,
        "skipped": 0,
    }
    assert (
        "3 of 5 optimizer steps audited (every 2): 3 judged (3 equivalent, 0 not equivalent), 2 not judged "
        "(2 not sampled)" in watched.summary()
    ), watched.summary()
    assert watched.to_dict()["not_sampled"] == 2 and watched.to_dict()["judged"] == 3


@pytest.mark.parametrize("fused", [False, True], ids=["skips_the_call", "fused_skips_inside"])
def test_a_step_the_grad_scaler_skips_is_counted_and_the_next_window_judged_alone(fused: bool) -> None:
    # The first step overflows (a loss scale past float32): the scaler skips optimizer.step() (or, for a
    # fused optimizer, calls it with found_inf set, and it skips inside) and backs off; that window's
    # micro-batches are not the next step's, which is judged on its own (and equivalent).
    torch.manual_seed(0)
    model = Regressor()
    optimizer = (
        torch.optim.Adam(model.parameters(), lr=0.01, fused=True)
        if fused
        else torch.optim.SGD(model.parameters(), lr=0.1)
    )
    start = [param.detach().clone() for param in model.parameters()]
    seen_scales: list[float] = []
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**127, backoff_factor=2.0**-120)
    original = torch.amp.GradScaler.step
    with audit(model, optimizer, loss=equiv.MSE()) as watched:
        for window in _batches(3):
            samples = sum(targets.numel() for _, targets in window)
            for inputs, targets in ((inputs, 1e3 * targets) for inputs, targets in window):  # large gradients
                loss = torch.nn.functional.mse_loss(model(inputs, targets), targets, reduction="sum") / samples
                scaler.scale(loss).backward()
            scaler.step(optimizer)
            if not seen_scales:  # the skipped step left the weights as they were
                assert all(torch.equal(a, b) for a, b in zip(start, model.parameters(), strict=True))
            scaler.update()
            seen_scales.append(scaler.get_scale())
            optimizer.zero_grad()
    assert seen_scales[0] < 2.0**127  # the scale backed off
    assert watched.skipped == 1 and watched.steps == 2 and watched, watched.summary()
    assert [window.micro_batches for window in watched.windows] == [2, 2]
    assert watched.counts()["skipped"] == 1
    assert "1 step was skipped by the GradScaler" in watched.summary(), watched.summary()
    assert torch.amp.GradScaler.step is original  # torch's own back on exit


# -- 3. dropout ---------------------------------------------------------------------------------


def test_dropout_windows_say_what_to_do_and_count_as_not_judged() -> None:
    torch.manual_seed(0)
    model = Regressor(dropout=0.5)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with audit(model, optimizer, loss=equiv.MSE()) as watched:
        _sgd_loop(model, optimizer, _batches(2))
    assert watched.counts()["inherent"] == 2 and watched.counts()["equivalent"] == 0
    window = watched.windows[0]
    assert window.hint is not None and ".p = 0" in window.hint
    assert "nothing judged" in watched.line() and watched.failures == []
    assert ".p = 0" in watched.summary(), watched.summary()
    with pytest.raises(AssertionError, match="nothing judged"):
        watched.assert_ok()


def test_dropout_set_to_zero_as_the_hint_says_is_judged() -> None:
    torch.manual_seed(0)
    model = Regressor(dropout=0.5)
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with audit(model, optimizer, loss=equiv.MSE()) as watched:
        _sgd_loop(model, optimizer, _batches(2))
    assert watched and watched.counts()["equivalent"] == 2, watched.summary()


# -- 4. a foreign optimizer -----------------------------------------------------------------------


def test_an_optimizer_of_another_model_is_refused_on_entry() -> None:
    model, other = nn.Linear(3, 4), nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    optimizer = torch.optim.SGD(other.parameters(), lr=0.1)
    with pytest.raises(
        ValueError,
        match=r"the optimizer holds 4 parameter tensors that are not the model's "
        r"parameters \(first: shape \(4, 3\);.*model\.parameters\(\)",
    ):
        audit(model, optimizer, loss=equiv.MSE())


def test_an_optimizer_of_part_of_the_model_is_fine() -> None:
    torch.manual_seed(0)
    model = Regressor()
    optimizer = torch.optim.SGD(model.net[2].parameters(), lr=0.1)  # the first layer frozen
    with audit(model, optimizer, loss=equiv.MSE()) as watched:
        _sgd_loop(model, optimizer, _batches(2))
    assert watched, watched.summary()


# -- 5. the protocol and JSON lines ---------------------------------------------------------------


def test_windows_and_the_audit_are_results_and_written_as_schema_valid_json_lines(tmp_path: Path) -> None:
    seen: list[WindowAudit] = []
    streamed = tmp_path / "streamed.jsonl"
    watched = _audited(_batches(3, poison=2), on_window=equiv.auditing.jsonl_writer(streamed, then=seen.append))
    assert isinstance(watched, Result) and all(isinstance(window, Result) for window in watched.windows)
    assert len(seen) == 3
    path = watched.write_jsonl(tmp_path / "audit.jsonl")
    for written in (path, streamed):
        lines = written.read_text(encoding="utf-8").splitlines()
        assert len(lines) == 3
        for line in lines:
            record = json.loads(line)
            jsonschema.validate(record, schema())
            assert record["kind"] == "window_audit"
        assert json.loads(lines[2])["not_finite"] is not None
    jsonschema.validate(watched.to_dict(), schema())

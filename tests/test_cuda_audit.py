"""The audit (equiv.audit) of a run whose model lives on a CUDA device.

Skipped, with that reason, without a GPU (CI has none).  What they pin:

* the audit's verdicts on the GPU are the CPU's: nanoGPT's loss / N flagged on
  exactly the windows whose token counts differ, the window-token normaliser
  clean, a NaN run never equivalent;
* watching a micro-step (the forward and backward hooks) never waits for the
  host: the audit's cost per micro-batch is device work only;
* a fused optimizer under a CUDA GradScaler (the path mixed-precision runs
  take: the scaler calls ``step`` with ``found_inf`` set and the optimizer
  skips inside) has its skipped step counted, not judged as a step.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Iterator

import pytest
import torch
from torch import Tensor, nn

from equiv.auditing import audit
from equiv.auditing.runs import REAL_LENGTHS, TinyLM, padded_sequences
from equiv.losses import NextTokenCrossEntropy

if not torch.cuda.is_available():  # one skip for the module, not one per test (tests/conftest.py's reason)
    pytest.skip("needs a CUDA device; none is visible", allow_module_level=True)

pytestmark = pytest.mark.cuda

TOKENS = NextTokenCrossEntropy()
CUDA = torch.device("cuda")


def _windows(real_lengths: list[int], n: int) -> list[list[tuple[Tensor, Tensor]]]:
    """Micro-batches of 2 sequences on the GPU, n per window."""
    sequences = padded_sequences(real_lengths)
    micro = [
        (
            torch.stack([s[0] for s in sequences[i : i + 2]]).to(CUDA),
            torch.stack([s[1] for s in sequences[i : i + 2]]).to(CUDA),
        )
        for i in range(0, len(sequences), 2)
    ]
    return [micro[i : i + n] for i in range(0, len(micro), n)]


def _model_and_optimizer() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = TinyLM().to(CUDA)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _token_counts(window: list[tuple[Tensor, Tensor]]) -> list[int]:
    return [int(TOKENS.count(labels)) for _, labels in window]


@pytest.mark.parametrize("by_window_tokens", [False, True], ids=["loss_over_n", "window_tokens"])
def test_the_gpu_audit_gives_the_cpu_verdicts(by_window_tokens: bool) -> None:
    model, optimizer = _model_and_optimizer()
    windows = _windows(REAL_LENGTHS, 2)
    counts = [_token_counts(window) for window in windows]  # read before the run: the loop below never syncs
    with audit(model, optimizer, loss=TOKENS) as watched:
        for window, window_counts in zip(windows, counts, strict=True):
            total = sum(window_counts)
            for ids, labels in window:
                logits = model(ids, labels)
                loss = TOKENS.sum(logits, labels) / total if by_window_tokens else TOKENS(logits, labels) / len(window)
                loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    assert len(watched.windows) == 4
    expected = [True] * 4 if by_window_tokens else [len(set(c)) == 1 for c in counts]
    assert [window.equivalent for window in watched.windows] == expected, watched.summary()


@contextlib.contextmanager
def _host_syncs() -> Iterator[list[str]]:
    """The synchronizing calls torch's sync debug mode reports inside the block, filled on exit (not its
    own notice, since torch 2.11, that the mode "is a prototype feature")."""
    syncs: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield syncs
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs += [str(w.message) for w in caught if "called a synchronizing" in str(w.message)]


def test_watching_a_micro_step_never_waits_for_the_host() -> None:
    model, optimizer = _model_and_optimizer()
    windows = _windows([8] * 16, 2)
    syncs: list[str] = []
    with audit(model, optimizer, loss=TOKENS) as watched:
        for window in windows:
            total = torch.stack([TOKENS.count(labels) for _, labels in window]).sum()  # stays on the device
            for ids, labels in window:
                with _host_syncs() as here:
                    (TOKENS.sum(model(ids, labels), labels) / total).backward()
                syncs += here
            optimizer.step()  # the audit judges here: it may read the host once per window
            optimizer.zero_grad(set_to_none=True)
        with _host_syncs() as probe:
            float(total)
        assert len(probe) == 1  # the probe does see a read of the host
    assert syncs == [], f"{len(syncs)} host syncs in the micro-steps, e.g. {syncs[:2]}"
    assert len(watched.windows) == 4 and watched, watched.summary()


def test_a_nan_run_on_the_gpu_is_never_equivalent() -> None:
    model, optimizer = _model_and_optimizer()
    assert isinstance(model, TinyLM)
    with torch.no_grad():
        model.mix.weight[1, 2] = math.nan
    windows = _windows([8] * 8, 2)
    with audit(model, optimizer, loss=TOKENS) as watched:
        for window in windows:
            for ids, labels in window:
                (TOKENS(model(ids, labels), labels) / len(window)).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    assert watched.windows and not any(window.equivalent for window in watched.windows), watched.summary()
    assert "NaN" in watched.windows[0].line(), watched.windows[0].line()


def test_a_fused_optimizer_step_the_cuda_grad_scaler_skips_is_counted() -> None:
    torch.manual_seed(0)
    model = TinyLM().to(CUDA)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01, fused=True)
    start = [param.detach().clone() for param in model.parameters()]
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**127, backoff_factor=2.0**-120)
    windows = _windows([8] * 12, 2)
    with audit(model, optimizer, loss=TOKENS) as watched:
        for index, window in enumerate(windows):
            total = sum(_token_counts(window))
            overflow = 1e3 if index == 0 else 1.0  # the first step's scaled gradients pass float32's range
            for ids, labels in window:
                scaler.scale(overflow * TOKENS.sum(model(ids, labels), labels) / total).backward()
            scaler.step(optimizer)
            if index == 0:  # the overflowing first step left the weights as they were
                assert all(torch.equal(a, b) for a, b in zip(start, model.parameters(), strict=True))
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
    assert scaler.get_scale() < 2.0**127
    assert watched.skipped == 1 and watched.steps == 2 and watched, watched.summary()
    assert "1 step was skipped by the GradScaler" in watched.summary(), watched.summary()

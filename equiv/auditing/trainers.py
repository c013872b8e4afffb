"""The audit hooked into the trainers people run, as callbacks: nothing in the
training code changes but the callback list.

* transformers: ``Trainer(..., callbacks=[equiv.auditing.transformers_callback(loss=...)])``: the
  micro-batches are the calls the Trainer makes to the model (``labels`` among them);
* Lightning: ``pl.Trainer(..., callbacks=[equiv.auditing.lightning_callback(loss=...)])``: the
  micro-batches are the training batches (``on_train_batch_start``), since a ``training_step``
  usually computes its loss outside ``forward``; replayed as ``module(x)`` against ``y`` for a
  batch ``(x, y)`` unless ``call_model=`` / ``targets=`` say otherwise;
* a plain loop or Accelerate's ``accumulate()`` loop: ``with equiv.audit(model, optimizer, loss=...)``.

Each starts :func:`equiv.audit` on the model and the torch optimizer when
training begins (under a wrapper such as Accelerate's ``AcceleratedOptimizer``
or Lightning's ``LightningOptimizer``: the torch optimizer inside, whose
``step`` is the one that updates the weights) and ends it when training ends;
the audit is then in ``.audit`` (``.audit.summary()``).  transformers and
Lightning are imported only when a callback is made (extra ``peers``).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import Tensor, nn

from equiv.auditing.replay import Call
from equiv.auditing.watch import Audit, audit

__all__ = ["lightning_callback", "torch_optimizer", "transformers_callback"]


def torch_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside trainers' wrappers (``.optimizer`` of Accelerate's
    ``AcceleratedOptimizer`` and of Lightning's ``LightningOptimizer``, which wrap a
    torch optimizer; the wrapper's ``step`` may skip calling it inside a window)."""
    seen = optimizer
    while isinstance(getattr(seen, "optimizer", None), torch.optim.Optimizer):
        seen = seen.optimizer
    if not isinstance(seen, torch.optim.Optimizer):
        raise TypeError(f"the audit needs a torch.optim.Optimizer, found {type(optimizer).__name__}")
    return seen


def _start(model: nn.Module | None, optimizer: Any, settings: dict[str, Any]) -> Audit:
    if model is None or optimizer is None:
        raise RuntimeError("the trainer began training without handing its model and optimizer to callbacks: "
                           f"got model={type(model).__name__}, optimizer={type(optimizer).__name__}")
    started = audit(model, torch_optimizer(optimizer), **settings)
    return started.__enter__()


def transformers_callback(**settings: Any) -> Any:
    """A ``transformers.TrainerCallback`` auditing the Trainer's optimizer steps;
    ``settings``: those of :func:`equiv.audit` (``loss=`` at least)."""
    from transformers import TrainerCallback

    class _TransformersAudit(TrainerCallback):  # type: ignore[misc,unused-ignore]
        def __init__(self) -> None:
            self.audit: Audit | None = None

        def on_train_begin(self, args: Any, state: Any, control: Any, model: nn.Module | None = None,
                           optimizer: Any = None, **kwargs: Any) -> None:
            self.audit = _start(model, optimizer, settings)

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if self.audit is not None:  # the epoch as a fraction (the Trainer's own count)
                self.audit.position = f"epoch {state.epoch:.2f}" if state.epoch is not None else None

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if self.audit is not None:
                self.audit.__exit__(None, None, None)

    return _TransformersAudit()


def lightning_callback(**settings: Any) -> Any:
    """A Lightning ``Callback`` auditing ``Trainer.fit``'s optimizer steps (one
    optimizer); ``settings``: those of :func:`equiv.audit` (``loss=`` at least)."""
    import pytorch_lightning as pl

    settings = {"record_forward": False, "call_model": _lightning_call, "targets": _lightning_targets, **settings}

    class _LightningAudit(pl.Callback):  # type: ignore[misc,unused-ignore]
        def __init__(self) -> None:
            self.audit: Audit | None = None

        def on_train_start(self, trainer: Any, pl_module: nn.Module) -> None:
            if len(trainer.optimizers) != 1:
                raise ValueError(f"the audit follows one optimizer, the Trainer has {len(trainer.optimizers)}")
            self.audit = _start(pl_module, trainer.optimizers[0], settings)

        def on_train_batch_start(self, trainer: Any, pl_module: nn.Module, batch: Any, batch_idx: int) -> None:
            if self.audit is not None:
                self.audit.position = f"epoch {trainer.current_epoch}, batch {batch_idx}"
                # The batch is recorded here, before Lightning's precision plugin enters its autocast for
                # the training step: enter the same one, so the record carries the mixed precision to replay.
                with _lightning_autocast(trainer, pl_module):
                    self.audit.record(batch)

        def on_train_end(self, trainer: Any, pl_module: nn.Module) -> None:
            if self.audit is not None:
                self.audit.__exit__(None, None, None)

    return _LightningAudit()


#: Lightning's mixed-precision settings and the autocast dtype each trains its forward in.
_LIGHTNING_MIXED = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


def _lightning_autocast(trainer: Any, module: nn.Module) -> Any:
    """The ``torch.autocast`` Lightning runs the training step under (``precision="bf16-mixed"`` or
    ``"16-mixed"``), or a no-op for full precision."""
    dtype = _LIGHTNING_MIXED.get(str(getattr(trainer, "precision", "")))
    first = next(module.parameters(), None)
    if dtype is None or first is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=first.device.type, dtype=dtype)


def _lightning_call(module: nn.Module, call: Call) -> Any:
    """A training batch ``(x, y)`` replayed as ``module(x)``."""
    batch = call[0][0]
    return module(batch[0])


def _lightning_targets(call: Call) -> Tensor:
    """The ``y`` of a training batch ``(x, y)``."""
    batch = call[0][0]
    if not (isinstance(batch, (tuple, list)) and len(batch) >= 2 and isinstance(batch[1], Tensor)):
        raise ValueError(f"the audit takes a Lightning batch as (inputs, targets), got {type(batch).__name__}: pass "
                         "call_model=lambda module, call: ... and targets=lambda call: ... (the batch is call[0][0])")
    return batch[1]

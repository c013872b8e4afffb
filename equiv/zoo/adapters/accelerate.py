"""Hugging Face Accelerate (tested with accelerate 1.15) under the candidate contract.

Drives the API exactly as Accelerate's gradient-accumulation guide shows
(https://huggingface.co/docs/accelerate/usage_guides/gradient_accumulation)::

    accelerator = Accelerator(gradient_accumulation_steps=N)    # or a GradientAccumulationPlugin
    model, optimizer, dataloader = accelerator.prepare(model, optimizer, dataloader)
    for inputs, targets in dataloader:
        with accelerator.accumulate(model):
            loss = loss_fn(model(inputs), targets)
            accelerator.backward(loss)                           # divides by N
            if accelerator.sync_gradients: accelerator.clip_grad_norm_(...)
            optimizer.step(); optimizer.zero_grad()              # no-ops until the window closes

Each window's micro-batches come through a prepared DataLoader, so Accelerate
sees the end of the data as at the end of an epoch (its short-tail rule).
Accelerate keeps process-global state (``AcceleratorState``,
``GradientState``): it is reset whenever a new run starts, so cases stay
independent.  Needs the ``accelerate`` extra.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import GradientAccumulationPlugin
from torch import Tensor, nn
from torch.utils.data import DataLoader

from equiv.zoo.adapters._state import PerRun, describe

__all__ = ["AccelerateStep"]


class AccelerateStep:
    """A candidate driving ``accelerate.Accelerator``.

    ``gradient_accumulation_steps`` None: the number of micro-batches in the
    first window of a run.  ``sync_with_dataloader`` / ``sync_each_batch`` are
    the ``GradientAccumulationPlugin`` options of the same names.
    """

    def __init__(self, gradient_accumulation_steps: int | None = None, *, sync_with_dataloader: bool = True,
                 sync_each_batch: bool = False) -> None:
        if gradient_accumulation_steps is not None and gradient_accumulation_steps < 1:
            raise ValueError(f"gradient_accumulation_steps must be a positive int or None, got {gradient_accumulation_steps!r}")
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.sync_with_dataloader = sync_with_dataloader
        self.sync_each_batch = sync_each_batch
        self._run = PerRun()
        self._prepared: tuple[Accelerator, Any, Any] | None = None

    def _start_run(self, model: nn.Module, optimizer: torch.optim.Optimizer, window: int) -> None:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        plugin = GradientAccumulationPlugin(
            num_steps=self.gradient_accumulation_steps or window,
            sync_with_dataloader=self.sync_with_dataloader,
            sync_each_batch=self.sync_each_batch,
        )
        device = next(model.parameters()).device
        accelerator = Accelerator(gradient_accumulation_plugin=plugin, cpu=device.type == "cpu")
        prepared_model, prepared_optimizer = accelerator.prepare(model, optimizer)
        self._prepared = (accelerator, prepared_model, prepared_optimizer)

    def __call__(self, model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: list[tuple[Tensor, Tensor]],
                 loss_fn: Callable[..., Tensor], *, max_grad_norm: float | None = None) -> None:
        if self._run.is_new(model):
            self._start_run(model, optimizer, len(micro_batches))
        assert self._prepared is not None
        accelerator, prepared_model, prepared_optimizer = self._prepared
        # batch_size=None: each item of the list is already one micro-batch.
        dataloader = accelerator.prepare_data_loader(DataLoader(micro_batches, batch_size=None))  # type: ignore[arg-type]  # a list is a map-style dataset
        for inputs, targets in dataloader:
            with accelerator.accumulate(prepared_model):
                loss = loss_fn(prepared_model(inputs), targets)
                accelerator.backward(loss)
                if max_grad_norm is not None and accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(prepared_model.parameters(), max_grad_norm)
                prepared_optimizer.step()
                prepared_optimizer.zero_grad()

    def __repr__(self) -> str:
        return describe("AccelerateStep", gradient_accumulation_steps=self.gradient_accumulation_steps,
                        sync_with_dataloader=None if self.sync_with_dataloader else False,
                        sync_each_batch=self.sync_each_batch or None)

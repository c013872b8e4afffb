"""Hugging Face Accelerate (tested with accelerate 1.15) under the candidate contract.

:class:`AccelerateStep` drives the API exactly as Accelerate's
gradient-accumulation guide shows
(https://huggingface.co/docs/accelerate/usage_guides/gradient_accumulation)::

    accelerator = Accelerator(gradient_accumulation_steps=N)    # or a GradientAccumulationPlugin
    model, optimizer, dataloader = accelerator.prepare(model, optimizer, dataloader)
    for inputs, targets in dataloader:
        with accelerator.accumulate(model):
            loss = loss_fn(model(inputs), targets)
            accelerator.backward(loss)                           # divides by N
            if accelerator.sync_gradients: accelerator.clip_grad_norm_(...)
            optimizer.step(); optimizer.zero_grad()              # no-ops until the window closes

:class:`AccelerateVariableSizeStep` drives the same guide's recipe for
"gradient accumulation on training samples of variable size" (the example
https://github.com/huggingface/accelerate/blob/main/examples/by_feature/gradient_accumulation_for_autoregressive_models.py):
it pre-loads the window's batches, counts the window's items, and each
batch's loss is its SUM over that count times N (``accelerator.backward``
divides by N again)::

    num_items_in_batch = accelerator.gather(local_num_items_in_batch).sum().item()
    loss = loss * gradient_accumulation_steps * accelerator.num_processes
    accelerator.backward(loss)
    ...
    grad_norm = accelerator.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()

Under the contract each window comes through its own prepared DataLoader (so
it ends where the data ends); ``run_epochs`` drives one DataLoader over a
whole run, as users do, so the mid-epoch counter is exercised too.
Accelerate keeps process-global state (``AcceleratorState``,
``GradientState``): it is reset whenever a new run starts, so cases stay
independent.  ``GradientAccumulationPlugin(sync_each_batch=...)`` is left out:
it only changes when DDP synchronises, which one process never does.  Needs
the ``accelerate`` extra.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import GradientAccumulationPlugin
from torch import Tensor, nn
from torch.utils.data import DataLoader

from equiv.adapters.state import PerRun, describe
from equiv.batches import MicroBatches
from equiv.losses import Loss

__all__ = ["AccelerateStep", "AccelerateVariableSizeStep"]


def _check_steps(value: int | None) -> None:
    if value is not None and value < 1:
        raise ValueError(f"gradient_accumulation_steps must be a positive int or None, got {value!r}")


def _fresh_accelerator(model: nn.Module, plugin: GradientAccumulationPlugin) -> Accelerator:
    """A new Accelerator with the process-global state of any earlier run cleared."""
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    return Accelerator(gradient_accumulation_plugin=plugin, cpu=next(model.parameters()).device.type == "cpu")


def _loader(accelerator: Accelerator, micro_batches: MicroBatches) -> Any:
    # batch_size=None: each item of the list is already one micro-batch.
    return accelerator.prepare_data_loader(DataLoader(micro_batches, batch_size=None))  # type: ignore[arg-type]  # a list is a map-style dataset


class AccelerateStep:
    """A candidate driving ``accelerate.Accelerator``'s ``accumulate()``.

    ``gradient_accumulation_steps`` None: the number of micro-batches in the
    first window of a run.  ``sync_with_dataloader`` is the
    ``GradientAccumulationPlugin`` option of that name.
    """

    def __init__(self, gradient_accumulation_steps: int | None = None, *, sync_with_dataloader: bool = True) -> None:
        _check_steps(gradient_accumulation_steps)
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.sync_with_dataloader = sync_with_dataloader
        self._run = PerRun()
        self._prepared: tuple[Accelerator, Any, Any] | None = None

    def _start_run(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, window: int
    ) -> tuple[Accelerator, Any, Any]:
        plugin = GradientAccumulationPlugin(
            num_steps=self.gradient_accumulation_steps or window, sync_with_dataloader=self.sync_with_dataloader
        )
        accelerator = _fresh_accelerator(model, plugin)
        prepared_model, prepared_optimizer = accelerator.prepare(model, optimizer)
        return accelerator, prepared_model, prepared_optimizer

    def _train(
        self,
        accelerator: Accelerator,
        model: Any,
        optimizer: Any,
        dataloader: Any,
        loss_fn: Callable[..., Tensor],
        max_grad_norm: float | None,
    ) -> None:
        for inputs, targets in dataloader:
            with accelerator.accumulate(model):
                loss = loss_fn(model(inputs), targets)
                accelerator.backward(loss)
                if max_grad_norm is not None and accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), max_grad_norm)
                optimizer.step()
                optimizer.zero_grad()

    def __call__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        micro_batches: MicroBatches,
        loss_fn: Callable[..., Tensor],
        *,
        max_grad_norm: float | None = None,
    ) -> None:
        if self._run.is_new(model):
            self._prepared = self._start_run(model, optimizer, len(micro_batches))
        assert self._prepared is not None
        accelerator, prepared_model, prepared_optimizer = self._prepared
        self._train(
            accelerator, prepared_model, prepared_optimizer, _loader(accelerator, micro_batches), loss_fn, max_grad_norm
        )

    def run_epochs(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        micro_batches: MicroBatches,
        loss_fn: Loss,
        *,
        epochs: int,
    ) -> None:
        """One prepared DataLoader over ``micro_batches``, iterated ``epochs`` times."""
        accelerator, prepared_model, prepared_optimizer = self._start_run(model, optimizer, len(micro_batches))
        dataloader = _loader(accelerator, micro_batches)
        for _ in range(epochs):
            self._train(accelerator, prepared_model, prepared_optimizer, dataloader, loss_fn, None)

    def __repr__(self) -> str:
        return describe(
            "AccelerateStep",
            gradient_accumulation_steps=self.gradient_accumulation_steps,
            sync_with_dataloader=None if self.sync_with_dataloader else False,
        )


class AccelerateVariableSizeStep:
    """A candidate driving Accelerate's recipe for samples of variable size:
    ``Accelerator(gradient_accumulation_steps=N)``, no ``accumulate()``; each
    window's batches pre-loaded, ``loss = sum / num_items_in_batch * N``,
    ``accelerator.backward(loss)``, one clip and one step per window.

    ``gradient_accumulation_steps`` None: the number of micro-batches in the
    first window of a run.
    """

    def __init__(self, gradient_accumulation_steps: int | None = None) -> None:
        _check_steps(gradient_accumulation_steps)
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self._run = PerRun()
        self._prepared: tuple[Accelerator, Any, Any] | None = None

    def _start_run(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, window: int
    ) -> tuple[Accelerator, Any, Any]:
        plugin = GradientAccumulationPlugin(num_steps=self.gradient_accumulation_steps or window)
        accelerator = _fresh_accelerator(model, plugin)
        prepared_model, prepared_optimizer = accelerator.prepare(model, optimizer)
        return accelerator, prepared_model, prepared_optimizer

    @staticmethod
    def _update(
        accelerator: Accelerator,
        model: Any,
        optimizer: Any,
        batch_samples: MicroBatches,
        loss_fn: Loss,
        max_grad_norm: float | None,
    ) -> None:
        """One update step of the recipe over the pre-loaded ``batch_samples``."""
        local_num_items_in_batch = sum(torch.as_tensor(loss_fn.count(targets)) for _, targets in batch_samples)
        num_items_in_batch = accelerator.gather(local_num_items_in_batch).sum().item()
        for inputs, targets in batch_samples:
            loss = loss_fn.sum(model(inputs), targets) / num_items_in_batch
            loss = loss * accelerator.gradient_accumulation_steps * accelerator.num_processes
            accelerator.backward(loss)
        if max_grad_norm is not None:
            accelerator.clip_grad_norm_(model.parameters(), max_grad_norm)
        optimizer.step()
        optimizer.zero_grad()

    def __call__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        micro_batches: MicroBatches,
        loss_fn: Loss,
        *,
        max_grad_norm: float | None = None,
    ) -> None:
        if self._run.is_new(model):
            self._prepared = self._start_run(model, optimizer, len(micro_batches))
        assert self._prepared is not None
        accelerator, prepared_model, prepared_optimizer = self._prepared
        self._update(accelerator, prepared_model, prepared_optimizer, micro_batches, loss_fn, max_grad_norm)

    def run_epochs(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        micro_batches: MicroBatches,
        loss_fn: Loss,
        *,
        epochs: int,
    ) -> None:
        """The recipe's epoch loop: ``total_gradient_updates`` windows of N
        batches from one iterator, the last one ``remainder`` batches long."""
        accelerator, prepared_model, prepared_optimizer = self._start_run(model, optimizer, len(micro_batches))
        train_dataloader = _loader(accelerator, micro_batches)
        steps = accelerator.gradient_accumulation_steps
        num_samples_in_epoch = len(train_dataloader)
        remainder = num_samples_in_epoch % steps
        remainder = remainder if remainder != 0 else steps
        total_gradient_updates = math.ceil(num_samples_in_epoch / steps)
        for _ in range(epochs):
            training_iterator = iter(train_dataloader)
            for update_step in range(total_gradient_updates):
                num_batches_in_step = steps if update_step != (total_gradient_updates - 1) else remainder
                batch_samples = [next(training_iterator) for _ in range(num_batches_in_step)]
                self._update(accelerator, prepared_model, prepared_optimizer, batch_samples, loss_fn, None)

    def __repr__(self) -> str:
        return describe("AccelerateVariableSizeStep", gradient_accumulation_steps=self.gradient_accumulation_steps)

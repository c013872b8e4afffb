"""PyTorch Lightning (tested with pytorch-lightning 2.6) under the candidate contract.

``Trainer(accumulate_grad_batches=N, gradient_clip_val=...)`` on a
LightningModule that wraps the case's model, loss and optimizer (automatic
optimisation: Lightning scales each loss by 1/N, steps when
``batch_idx + 1`` is a multiple of N or at the epoch's end, clips once;
https://lightning.ai/docs/pytorch/stable/common/gradient_accumulation.html).
Under the contract each window is one ``Trainer.fit`` epoch over the window's
micro-batches; ``run_epochs`` is one ``fit`` over a whole run, as users do, so
the mid-epoch counter and the epoch's tail are exercised.  Quiet: no logger,
progress bar, model summary, checkpoints or sanity checks.  Needs the
``lightning`` extra.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from typing import Any

import pytorch_lightning as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader

from equiv.adapters.state import describe
from equiv.batches import MicroBatches

__all__ = ["LightningStep"]

_PRECISION = {torch.float64: "64-true", torch.float32: "32-true", torch.bfloat16: "bf16-true", torch.float16: "16-true"}


class _Wrapped(pl.LightningModule):
    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Callable[..., Tensor]) -> None:
        super().__init__()
        self.model = model
        self._optimizer = optimizer
        self._loss_fn = loss_fn

    def training_step(self, batch: tuple[Tensor, Tensor], batch_index: int) -> Tensor:
        inputs, targets = batch
        loss: Tensor = self._loss_fn(self.model(inputs), targets)
        return loss

    def configure_optimizers(self) -> Any:
        return self._optimizer  # the case's optimizer: its state carries across windows


class LightningStep:
    """A candidate driving ``pytorch_lightning.Trainer``.

    ``accumulate_grad_batches`` None: the number of micro-batches in the window.
    """

    def __init__(self, accumulate_grad_batches: int | None = None) -> None:
        if accumulate_grad_batches is not None and accumulate_grad_batches < 1:
            raise ValueError(f"accumulate_grad_batches must be a positive int or None, got {accumulate_grad_batches!r}")
        self.accumulate_grad_batches = accumulate_grad_batches

    def _fit(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        micro_batches: MicroBatches,
        loss_fn: Callable[..., Tensor],
        *,
        n: int,
        epochs: int,
        max_grad_norm: float | None,
    ) -> None:
        dtype = next(model.parameters()).dtype
        logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
        logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
        trainer = pl.Trainer(
            accelerator="cpu" if next(model.parameters()).device.type == "cpu" else "gpu",
            devices=1,
            max_epochs=epochs,
            accumulate_grad_batches=n,
            gradient_clip_val=max_grad_norm,
            precision=_PRECISION[dtype],  # type: ignore[arg-type,unused-ignore]  # a Literal when lightning is installed
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
        )
        with warnings.catch_warnings():
            # "does not have many workers", "no validation loop": true and irrelevant here.
            warnings.simplefilter("ignore")
            batches: DataLoader[Any] = DataLoader(micro_batches, batch_size=None)  # type: ignore[arg-type]  # a list is a map-style dataset
            trainer.fit(_Wrapped(model, optimizer, loss_fn), train_dataloaders=batches)

    def __call__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        micro_batches: MicroBatches,
        loss_fn: Callable[..., Tensor],
        *,
        max_grad_norm: float | None = None,
    ) -> None:
        self._fit(
            model,
            optimizer,
            micro_batches,
            loss_fn,
            n=self.accumulate_grad_batches or len(micro_batches),
            epochs=1,
            max_grad_norm=max_grad_norm,
        )

    def run_epochs(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        micro_batches: MicroBatches,
        loss_fn: Callable[..., Tensor],
        *,
        epochs: int,
    ) -> None:
        """One ``Trainer(max_epochs=epochs).fit`` over ``micro_batches``."""
        self._fit(
            model,
            optimizer,
            micro_batches,
            loss_fn,
            n=self.accumulate_grad_batches or len(micro_batches),
            epochs=epochs,
            max_grad_norm=None,
        )

    def __repr__(self) -> str:
        return describe("LightningStep", accumulate_grad_batches=self.accumulate_grad_batches)

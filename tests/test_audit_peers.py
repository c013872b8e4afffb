"""The audit on the trainers people run, unmodified but for a callback (or a
``with``): the transformers Trainer, Lightning, Accelerate's accumulate().
Each needs its extra (``pip install equiv[peers]``; ``tox -e peers`` runs them)
and skips with the reason without it."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import tempfile
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import equiv
from equiv.auditing import lightning_callback, transformers_callback


def _needs(*packages: str) -> pytest.MarkDecorator:
    missing = [package for package in packages if importlib.util.find_spec(package) is None]
    return pytest.mark.skipif(bool(missing), reason=f"needs {', '.join(missing)} (pip install equiv[peers])")


# -- the transformers Trainer (transformers #37766) ---------------------------

#: Micro-batches of 2 right-padded sequences, real lengths per micro-batch; N = 2:
#: windows 0 and 2 hold equal real-token counts, windows 1 and 3 do not.
TRAINER_LENGTHS = [[8, 8], [8, 8], [7, 2], [3, 2], [5, 5], [5, 5], [8, 6], [2, 1]]


def _trainer_audit(loss_kwargs: bool) -> equiv.Audit:
    from transformers import Trainer, TrainingArguments
    from transformers.utils import logging as transformers_logging

    from equiv.zoo.adapters.transformers import NoLossKwargs, tiny_causal_lm, token_micro_batches

    transformers_logging.set_verbosity_error()
    micro_batches = token_micro_batches(TRAINER_LENGTHS)
    rows = [{key: value[row] for key, value in batch.items()} for batch in micro_batches for row in range(2)]
    model: nn.Module = tiny_causal_lm().float()
    if not loss_kwargs:
        model = NoLossKwargs(model)

    class InOrder(Trainer):  # type: ignore[misc]
        def _get_train_sampler(self, *args: Any, **kwargs: Any) -> torch.utils.data.Sampler[int]:
            return torch.utils.data.SequentialSampler(rows)

    callback = transformers_callback(loss=equiv.NextTokenCrossEntropy())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with tempfile.TemporaryDirectory() as output_dir:
        args = TrainingArguments(output_dir=output_dir, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                                 num_train_epochs=1, max_grad_norm=0.0, use_cpu=True, report_to="none",
                                 save_strategy="no", logging_strategy="no", disable_tqdm=True,
                                 dataloader_num_workers=0, remove_unused_columns=False)
        trainer = InOrder(model=model, args=args, train_dataset=rows, callbacks=[callback],
                          optimizers=(optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)))
        with contextlib.redirect_stdout(io.StringIO()):
            trainer.train()
    assert callback.audit is not None
    return callback.audit  # type: ignore[no-any-return]


@_needs("transformers", "accelerate")
def test_the_trainer_on_a_model_taking_kwargs_is_clean() -> None:
    audited = _trainer_audit(loss_kwargs=True)
    assert len(audited.windows) == 4 and audited, audited.summary()


@_needs("transformers", "accelerate")
def test_the_trainer_on_a_model_without_kwargs_is_flagged_where_token_counts_differ() -> None:
    audited = _trainer_audit(loss_kwargs=False)
    assert [w.equivalent for w in audited.windows] == [True, False, True, False], audited.summary()


# -- Lightning (Lightning #19987) ---------------------------------------------


def _classification_batches(count: int) -> list[tuple[Tensor, Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [(torch.randn(4, 3, generator=generator), torch.randint(0, 2, (4,), generator=generator))
            for _ in range(count)]


@_needs("pytorch_lightning")
def test_lightning_divides_the_epochs_short_tail_window_by_n_and_the_audit_flags_it() -> None:
    import pytorch_lightning as pl

    class Classifier(pl.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2))

        def forward(self, x: Tensor) -> Tensor:
            return self.net(x)  # type: ignore[no-any-return]

        def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
            inputs, targets = batch
            return torch.nn.functional.cross_entropy(self(inputs), targets)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.manual_seed(0)
    callback = lightning_callback(loss=equiv.CrossEntropy())
    trainer = pl.Trainer(max_epochs=1, accumulate_grad_batches=3, accelerator="cpu", logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[callback])
    trainer.fit(Classifier(), torch.utils.data.DataLoader(_classification_batches(7), batch_size=None))
    audited = callback.audit
    assert [w.micro_batches for w in audited.windows] == [3, 3, 1]
    assert [w.equivalent for w in audited.windows] == [True, True, False], audited.summary()
    assert "a window of 1 where the run's others have 3" in audited.windows[-1].line()
    assert abs(audited.windows[-1].mismatches[0].update_ratio - 1 / 3) < 1e-3


# -- Accelerate's accumulate() ------------------------------------------------


class _TakesTargets(nn.Module):
    """A classifier called as nanoGPT's model is, ``model(x, y)``: the targets reach forward."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2))

    def forward(self, inputs: Tensor, targets: Tensor | None = None) -> Tensor:
        return self.net(inputs)  # type: ignore[no-any-return]


@_needs("accelerate")
def test_accelerates_accumulate_divides_the_short_tail_by_n_and_the_audit_flags_it() -> None:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    from equiv.auditing.trainers import torch_optimizer

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    torch.manual_seed(0)
    model = _TakesTargets()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    accelerator = Accelerator(gradient_accumulation_steps=3, cpu=True)
    model, optimizer, loader = accelerator.prepare(
        model, optimizer, torch.utils.data.DataLoader(_classification_batches(7), batch_size=None))
    # Accelerate's documented loop; only the with-line is added.
    with equiv.audit(model, torch_optimizer(optimizer), loss=equiv.CrossEntropy()) as audited:
        for inputs, targets in loader:
            with accelerator.accumulate(model):
                accelerator.backward(torch.nn.functional.cross_entropy(model(inputs, targets), targets))
                optimizer.step()
                optimizer.zero_grad()
    assert [w.micro_batches for w in audited.windows] == [3, 3, 1]
    assert [w.equivalent for w in audited.windows] == [True, True, False], audited.summary()
    assert abs(audited.windows[-1].mismatches[0].update_ratio - 1 / 3) < 1e-3

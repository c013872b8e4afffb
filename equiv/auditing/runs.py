"""Real runs audited as their users write them: the loops and trainers where
accumulation breaks, each run unmodified but for the audit (a ``with`` line or
a callback).  The tests (tests/test_audit.py, tests/test_audit_peers.py)
assert their verdicts; the peers report shows them.

* nanoGPT's loop (each micro-batch's token mean / N) over padded sequences:
  not equivalent exactly on the windows whose micro-batches hold different
  numbers of real tokens; the same loop dividing by the window's token count:
  equivalent;
* a plain loop whose last window is short but still divided by N (Lightning
  #19987, Accelerate's ``accumulate()`` at an epoch's end);
* a loop whose loss is scaled by the accumulation steps before backward (as RL
  loss normalisers were, trl #6024): the logged loss is right, AdamW absorbs
  the scale in the update, only the optimizer state shows it;
* the transformers Trainer on a model whose ``forward`` takes ``**kwargs``
  (it receives ``num_items_in_batch``) and on one whose ``forward`` does not
  (transformers #37766); Lightning's ``accumulate_grad_batches`` and
  Accelerate's ``accumulate()`` over an epoch of 7 batches with N = 3.
"""

from __future__ import annotations

import contextlib
import io
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader

from equiv.auditing.trainers import lightning_callback, torch_optimizer, transformers_callback
from equiv.auditing.watch import Audit, audit
from equiv.losses import CrossEntropy, NextTokenCrossEntropy

__all__ = [
    "AUDIT_RUNS",
    "AuditRun",
    "accelerate_tail_run",
    "lightning_tail_run",
    "nanogpt_run",
    "scaled_loss_run",
    "tail_run",
    "trainer_run",
]

VOCAB, LENGTH = 13, 8
TOKENS = NextTokenCrossEntropy()

#: 16 sequences; micro-batches of 2, N = 2: per window, the micro-batches' real
#: next-token counts are [14, 14], [8, 2], [8, 8], [7, 8].
REAL_LENGTHS = [8, 8, 8, 8, 3, 7, 2, 2, 5, 5, 5, 5, 1, 8, 8, 2]


class TinyLM(nn.Module):
    """A causal LM's shape in miniature, called as nanoGPT's is: ``model(idx, targets)``."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.mix = nn.Linear(16, 16)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, input_ids: Tensor, labels: Tensor | None = None) -> Tensor:
        return self.head(torch.tanh(self.mix(self.embed(input_ids))))  # type: ignore[no-any-return,unused-ignore]


def padded_sequences(real_lengths: list[int], seed: int = 0) -> list[tuple[Tensor, Tensor]]:
    """One sequence per entry, right-padded to LENGTH; labels -100 on padding."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for real in real_lengths:
        ids = torch.randint(0, VOCAB, (LENGTH,), generator=generator)
        labels = ids.clone()
        labels[real:] = -100
        out.append((ids, labels))
    return out


def token_loader(real_lengths: list[int], micro_batch: int = 2) -> DataLoader[tuple[Tensor, Tensor]]:
    return DataLoader(padded_sequences(real_lengths), batch_size=micro_batch, shuffle=False)  # type: ignore[arg-type]


def windows(loader: DataLoader[tuple[Tensor, Tensor]], n: int) -> Iterator[list[tuple[Tensor, Tensor]]]:
    """The loader's micro-batches, n at a time, the last window shorter."""
    window: list[tuple[Tensor, Tensor]] = []
    for micro_batch in loader:
        window.append(micro_batch)
        if len(window) == n:
            yield window
            window = []
    if window:
        yield window


def nanogpt_loop(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loader: DataLoader[tuple[Tensor, Tensor]],
    n: int,
    *,
    normalise_by_window_tokens: bool = False,
    scale: float = 1.0,
) -> list[float]:
    """nanoGPT's accumulation (each micro-batch's token mean / N), or the window's
    token count as the normaliser; ``scale`` multiplies the loss back-propagated,
    not the one logged.  Returns the logged losses (the loss curve)."""
    logged = []
    for window in windows(loader, n):
        tokens = sum(int(TOKENS.count(labels)) for _, labels in window)
        for ids, labels in window:
            logits = model(ids, labels)
            loss = TOKENS.sum(logits, labels) / tokens if normalise_by_window_tokens else TOKENS(logits, labels) / n
            (loss * scale).backward()
            logged.append(float(loss.detach()))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return logged


def tiny_lm_and_optimizer(optimizer: str = "AdamW") -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = TinyLM()
    opt: torch.optim.Optimizer = (
        torch.optim.AdamW(model.parameters(), lr=1e-2)
        if optimizer == "AdamW"
        else torch.optim.SGD(model.parameters(), lr=0.5)
    )
    return model, opt


def nanogpt_run(*, normalise_by_window_tokens: bool) -> Audit:
    """nanoGPT's loop (or the window-token normaliser) over REAL_LENGTHS, N = 2, audited."""
    model, optimizer = tiny_lm_and_optimizer()
    with audit(model, optimizer, loss=TOKENS) as watched:
        nanogpt_loop(
            model, optimizer, token_loader(REAL_LENGTHS), 2, normalise_by_window_tokens=normalise_by_window_tokens
        )
    return watched


def tail_run() -> Audit:
    """7 micro-batches of equal token counts, N = 3, each micro-batch's mean / 3, plain SGD."""
    model, optimizer = tiny_lm_and_optimizer("SGD")
    with audit(model, optimizer, loss=TOKENS) as watched:
        nanogpt_loop(model, optimizer, token_loader([8] * 14), 3)
    return watched


def scaled_loss_run() -> tuple[Audit, list[float], list[float]]:
    """The window-token normaliser with the loss scaled by N = 2 before backward;
    returns the audit and the logged losses of this run and of the same run unscaled."""
    model, optimizer = tiny_lm_and_optimizer()
    with audit(model, optimizer, loss=TOKENS) as watched:
        logged = nanogpt_loop(model, optimizer, token_loader([8] * 8), 2, normalise_by_window_tokens=True, scale=2.0)
    clean_model, clean_optimizer = tiny_lm_and_optimizer()
    clean = nanogpt_loop(clean_model, clean_optimizer, token_loader([8] * 8), 2, normalise_by_window_tokens=True)
    return watched, logged, clean


#: The Trainer's micro-batches of 2 right-padded sequences (real lengths); N = 2:
#: windows 0 and 2 hold equal real-token counts, windows 1 and 3 do not.
TRAINER_LENGTHS = [[8, 8], [8, 8], [7, 2], [3, 2], [5, 5], [5, 5], [8, 6], [2, 1]]


def trainer_run(
    *,
    loss_kwargs: bool,
    gradient_accumulation_steps: int = 2,
    max_grad_norm: float | None = 0.0,
    lengths: list[list[int]] = TRAINER_LENGTHS,
    attention_dropout: float = 0.0,
) -> Audit:
    """The transformers Trainer (gradient_accumulation_steps=2, in order, no clipping unless
    ``max_grad_norm`` says: None leaves TrainingArguments' default, 1.0) on a one-layer Llama
    from a config (its ``attention_dropout`` as given: the attention's functional dropout), float32,
    with the audit's callback as the README writes it."""
    from transformers import Trainer, TrainingArguments
    from transformers.utils import logging as transformers_logging

    from equiv.adapters.transformers import NoLossKwargs, tiny_causal_lm, token_micro_batches

    transformers_logging.set_verbosity_error()
    micro_batches = token_micro_batches(lengths)
    rows = [{key: value[row] for key, value in batch.items()} for batch in micro_batches for row in range(2)]
    model: nn.Module = tiny_causal_lm().float()
    for module in model.modules():  # read by each attention layer at construction, as its config's field
        if hasattr(module, "attention_dropout"):
            setattr(module, "attention_dropout", attention_dropout)  # noqa: B010 (a float, not a submodule)
    if not loss_kwargs:
        model = NoLossKwargs(model)

    class InOrder(Trainer):  # type: ignore[misc,unused-ignore]
        def _get_train_sampler(self, *args: Any, **kwargs: Any) -> torch.utils.data.Sampler[int]:
            return torch.utils.data.SequentialSampler(rows)

    callback = transformers_callback(loss=TOKENS)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with tempfile.TemporaryDirectory() as output_dir:
        clipping: dict[str, Any] = {} if max_grad_norm is None else {"max_grad_norm": max_grad_norm}
        args = TrainingArguments(
            output_dir=output_dir,
            per_device_train_batch_size=2,
            gradient_accumulation_steps=gradient_accumulation_steps,
            num_train_epochs=1,
            use_cpu=True,
            report_to="none",
            save_strategy="no",
            logging_strategy="no",
            disable_tqdm=True,
            dataloader_num_workers=0,
            remove_unused_columns=False,
            **clipping,
        )
        trainer = InOrder(
            model=model,
            args=args,
            train_dataset=rows,
            callbacks=[callback],
            optimizers=(optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)),
        )
        with contextlib.redirect_stdout(io.StringIO()):
            trainer.train()
    assert callback.audit is not None
    return callback.audit  # type: ignore[no-any-return,unused-ignore]


def classification_batches(count: int) -> list[tuple[Tensor, Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [
        (torch.randn(4, 3, generator=generator), torch.randint(0, 2, (4,), generator=generator)) for _ in range(count)
    ]


def lightning_tail_run(precision: str = "32-true", **trainer_settings: Any) -> Audit:
    """Lightning's ``Trainer.fit`` with accumulate_grad_batches=3 over 7 batches, the audit's callback;
    ``precision``: Lightning's (``"bf16-mixed"``: the training step under bfloat16 autocast);
    ``trainer_settings``: more of ``pl.Trainer``'s (``gradient_clip_val=``)."""
    import pytorch_lightning as pl

    class Classifier(pl.LightningModule):  # type: ignore[misc,unused-ignore]
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2))

        def forward(self, x: Tensor) -> Tensor:
            return self.net(x)  # type: ignore[no-any-return,unused-ignore]

        def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
            inputs, targets = batch
            return torch.nn.functional.cross_entropy(self(inputs), targets)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.manual_seed(0)
    callback = lightning_callback(loss=CrossEntropy())
    trainer = pl.Trainer(
        max_epochs=1,
        accumulate_grad_batches=3,
        accelerator="cpu",
        logger=False,
        precision=precision,  # type: ignore[arg-type,unused-ignore]  # Lightning's Literal of names
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
        **trainer_settings,
    )
    trainer.fit(Classifier(), DataLoader(classification_batches(7), batch_size=None))  # type: ignore[arg-type]
    assert callback.audit is not None
    return callback.audit  # type: ignore[no-any-return,unused-ignore]


class TakesTargets(nn.Module):
    """A classifier called as nanoGPT's model is, ``model(x, y)``: the targets reach forward."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2))

    def forward(self, inputs: Tensor, targets: Tensor | None = None) -> Tensor:
        return self.net(inputs)  # type: ignore[no-any-return,unused-ignore]


def accelerate_tail_run() -> Audit:
    """Accelerate's documented ``accumulate()`` loop (gradient_accumulation_steps=3) over 7 batches."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    torch.manual_seed(0)
    model = TakesTargets()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    accelerator = Accelerator(gradient_accumulation_steps=3, cpu=True)
    model, optimizer, loader = accelerator.prepare(
        model,
        optimizer,
        DataLoader(classification_batches(7), batch_size=None),  # type: ignore[arg-type]
    )
    with audit(model, torch_optimizer(optimizer), loss=CrossEntropy()) as watched:
        for inputs, targets in loader:
            with accelerator.accumulate(model):
                accelerator.backward(torch.nn.functional.cross_entropy(model(inputs, targets), targets))
                optimizer.step()
                optimizer.zero_grad()
    return watched


@dataclass(frozen=True, slots=True)
class AuditRun:
    """One real run for the report: how to make it, what it is, what it reproduces."""

    run: Callable[[], Audit]
    what: str
    reproduces: str
    #: the packages it needs besides torch
    needs: tuple[str, ...]
    #: the test that asserts its verdicts (``pytest <test>``)
    test: str


AUDIT_RUNS: dict[str, AuditRun] = {
    "nanoGPT's loop, loss / N": AuditRun(
        lambda: nanogpt_run(normalise_by_window_tokens=False),
        "each micro-batch's token mean / N over padded sequences (micro-batches of 2, N = 2)",
        "transformers PR #34191 (fixed a mean of token means in the Trainer)",
        (),
        "tests/test_audit.py::test_nanogpts_loss_over_n_is_flagged_exactly_on_windows_whose_token_counts_differ",
    ),
    "the same loop, / window tokens": AuditRun(
        lambda: nanogpt_run(normalise_by_window_tokens=True),
        "each micro-batch's summed loss / the window's real-token count",
        "-",
        (),
        "tests/test_audit.py::test_the_same_loop_normalising_by_the_windows_tokens_is_clean",
    ),
    "a plain loop's short tail": AuditRun(
        tail_run,
        "7 micro-batches, N = 3, every window divided by 3",
        "Lightning #19987",
        (),
        "tests/test_audit.py::test_a_short_tail_window_divided_by_n_is_flagged_and_named",
    ),
    "loss scaled by N before backward": AuditRun(
        lambda: scaled_loss_run()[0],
        "the window-token loss x 2 back-propagated (the logged loss is right)",
        "trl #6024 (normaliser scaled by the accumulation steps)",
        (),
        "tests/test_audit.py::test_a_users_own_bug_hidden_by_the_loss_curve_is_found",
    ),
    "transformers Trainer, forward(**kwargs)": AuditRun(
        lambda: trainer_run(loss_kwargs=True),
        "gradient_accumulation_steps=2, num_items_in_batch reaches the model",
        "-",
        ("transformers", "accelerate"),
        "tests/test_audit_peers.py::test_the_trainer_on_a_model_taking_kwargs_is_clean",
    ),
    "transformers Trainer, forward without **kwargs": AuditRun(
        lambda: trainer_run(loss_kwargs=False),
        "the same model behind a forward(input_ids, attention_mask, labels)",
        "transformers #37766",
        ("transformers", "accelerate"),
        "tests/test_audit_peers.py::test_the_trainer_on_a_model_without_kwargs_is_flagged_where_token_counts_differ",
    ),
    "Lightning, accumulate_grad_batches=3": AuditRun(
        lightning_tail_run,
        "Trainer.fit over 7 batches",
        "Lightning #19987",
        ("pytorch_lightning",),
        "tests/test_audit_peers.py::test_lightning_divides_the_epochs_short_tail_window_by_n_and_the_audit_flags_it",
    ),
    "Accelerate accumulate(), 3 steps": AuditRun(
        accelerate_tail_run,
        "the documented loop over 7 batches",
        "accelerate #1847 (end of the DataLoader)",
        ("accelerate",),
        "tests/test_audit_peers.py::test_accelerates_accumulate_divides_the_short_tail_by_n_and_the_audit_flags_it",
    ),
}

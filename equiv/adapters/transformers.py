"""Hugging Face transformers' ``Trainer`` (tested with transformers 5.23 and 4.45.2), driven as its users drive it.

What a user writes, on a tiny causal LM built from a config (nothing downloaded)::

    args = TrainingArguments(per_device_train_batch_size=B, gradient_accumulation_steps=N, ...)
    trainer = Trainer(model=model, args=args, train_dataset=dataset, optimizers=(optimizer, constant_schedule))
    trainer.train()

over a dataset of right-padded token sequences (``labels`` = ``input_ids``
with -100 on padding; the model shifts them).  The Trainer counts the
window's real tokens (``num_items_in_batch``) and passes them to a model
whose ``forward`` takes ``**kwargs`` (the 2024 fix, transformers #34191);
a model whose forward does not gets the fallback: its own token mean divided
by the number of micro-batches (transformers #37766).  Training order is made
sequential (users shuffle; the comparison needs known windows) and gradient
clipping is off (``max_grad_norm=0``) unless asked.  Needs the
``transformers`` package (extra ``peers``); it is imported only when used.
"""

from __future__ import annotations

import contextlib
import io
import tempfile
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["PAD_LABEL", "NoLossKwargs", "TrainerRun", "tiny_causal_lm", "token_micro_batches"]

#: The label the loss ignores (padding).
PAD_LABEL = -100
_VOCAB = 32


def tiny_causal_lm(seed: int = 0) -> nn.Module:
    """A one-layer Llama with 16-wide hidden states, built from a config, in float64."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=_VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model: nn.Module = LlamaForCausalLM(config)
    return model.double()


class NoLossKwargs(nn.Module):
    """The same model behind a ``forward`` without ``**kwargs``: the Trainer
    cannot pass ``num_items_in_batch`` and falls back to its own scaling."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, labels: Tensor | None = None) -> Any:
        return self.model(input_ids=input_ids, attention_mask=attention_mask, labels=labels)


def token_micro_batches(real_lengths: list[list[int]], *, seq_len: int = 8, seed: int = 0) -> list[dict[str, Tensor]]:
    """One micro-batch per inner list, one right-padded sequence per real length
    (random tokens from a fixed seed; padding token 0, label -100)."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for lengths in real_lengths:
        input_ids = torch.zeros(len(lengths), seq_len, dtype=torch.long)
        attention_mask = torch.zeros(len(lengths), seq_len, dtype=torch.long)
        for row, length in enumerate(lengths):
            input_ids[row, :length] = torch.randint(3, _VOCAB, (length,), generator=generator)
            attention_mask[row, :length] = 1
        labels = input_ids.masked_fill(attention_mask == 0, PAD_LABEL)
        out.append({"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels})
    return out


class _Examples(torch.utils.data.Dataset[dict[str, Tensor]]):
    def __init__(self, micro_batches: list[dict[str, Tensor]]) -> None:
        self.rows = [
            {key: value[row] for key, value in batch.items()}
            for batch in micro_batches
            for row in range(len(batch["input_ids"]))
        ]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        return self.rows[index]


class TrainerRun:
    """``Trainer(args=TrainingArguments(gradient_accumulation_steps=N)).train()``
    over every micro-batch of an epoch, ``epochs`` times, in order."""

    def __init__(self, gradient_accumulation_steps: int, *, max_grad_norm: float = 0.0) -> None:
        if gradient_accumulation_steps < 1:
            raise ValueError(f"gradient_accumulation_steps must be a positive int, got {gradient_accumulation_steps!r}")
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.max_grad_norm = max_grad_norm

    def train(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: list[dict[str, Tensor]], *, epochs: int
    ) -> None:
        from transformers import Trainer, TrainingArguments
        from transformers.utils import logging as transformers_logging

        transformers_logging.set_verbosity_error()

        examples = _Examples(micro_batches)

        class SequentialTrainer(Trainer):  # type: ignore[misc,unused-ignore]
            def _get_train_sampler(self, *args: Any, **kwargs: Any) -> torch.utils.data.Sampler[int]:
                # Users shuffle; here the windows must be known to compare them with full batch.
                return torch.utils.data.SequentialSampler(examples)

        sizes = {len(batch["input_ids"]) for batch in micro_batches}
        if len(sizes) != 1:
            raise ValueError(
                f"the Trainer batches the dataset itself: micro-batches must hold equal numbers of sequences, got {sorted(sizes)}"
            )
        with tempfile.TemporaryDirectory() as output_dir:
            args = TrainingArguments(
                output_dir=output_dir,
                per_device_train_batch_size=sizes.pop(),
                gradient_accumulation_steps=self.gradient_accumulation_steps,
                num_train_epochs=epochs,
                max_grad_norm=self.max_grad_norm,
                use_cpu=True,
                report_to="none",
                save_strategy="no",
                logging_strategy="no",
                disable_tqdm=True,
                dataloader_num_workers=0,
                remove_unused_columns=False,
            )
            constant = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
            trainer = SequentialTrainer(
                model=model, args=args, train_dataset=examples, optimizers=(optimizer, constant)
            )
            # The Trainer prints its closing metrics; the run's result is in the model.
            with contextlib.redirect_stdout(io.StringIO()):
                trainer.train()

    def __repr__(self) -> str:
        return f"TrainerRun(gradient_accumulation_steps={self.gradient_accumulation_steps})"

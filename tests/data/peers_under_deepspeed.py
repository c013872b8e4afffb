"""The transformers Trainer and Accelerate with a DeepSpeed ZeRO-2 config, audited as the docs write it
(tests/test_audit_deepspeed.py), launched by torchrun on gloo with ``DS_ACCELERATOR=cpu``; rank 0 writes one JSON
line per scenario (to_dict(), summary, what was read) to argv[1].  argv[2:] names the scenarios:

* ``trainer-llama``: the Trainer on default ``TrainingArguments`` but ``gradient_accumulation_steps=2`` and the
  config (clipping at the default max_grad_norm=1.0 included), a tiny LlamaForCausalLM whose loss divides by the
  ``num_items_in_batch`` the Trainer passes: the callback, as the README writes it;
* ``trainer-gpt2_token_classification``: the same with transformers' GPT2ForTokenClassification, whose forward takes
  ``**kwargs`` (so the Trainer passes ``num_items_in_batch`` and leaves the normalising to it) but whose loss
  ignores it (transformers #47688);
* ``accelerate-correct`` / ``accelerate-mean``: Accelerate's ``DeepSpeedPlugin`` (ZeRO-2, 2 accumulation steps,
  clipping at 1.0), the prepared model and optimizer handed to ``equiv.audit``; the loop's loss each micro-batch's
  summed token loss over the window's global count times the ranks and the steps (what the engine's averaging and
  its ``engine.backward`` division need), or the model's own per-micro-batch mean.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
import tempfile
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import equiv
from equiv.losses import NextTokenCrossEntropy, TokenCrossEntropy

#: the real-token counts of each row (labels -100 past them): per rank, micro-batches of 2 rows, windows of 2
LENGTHS = [[8, 7], [2, 1], [5, 5], [8, 6], [3, 8], [1, 3], [6, 2], [4, 4]]
DEEPSPEED = {
    "zero_optimization": {"stage": 2},
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
}


def rows(classes: int, shift: bool) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    made = []
    for pair in LENGTHS:
        for length in pair:
            ids = torch.randint(1, 32, (8,), generator=generator)
            labels = (ids.clone() if shift else torch.randint(0, classes, (8,), generator=generator)).long()
            labels[length:] = -100
            made.append({"input_ids": ids, "attention_mask": torch.ones(8, dtype=torch.long), "labels": labels})
    return made


def model_of(kind: str) -> tuple[nn.Module, Any, list[dict[str, torch.Tensor]]]:
    torch.manual_seed(0)
    if kind == "llama":
        from equiv.adapters.transformers import tiny_causal_lm

        return tiny_causal_lm().float(), NextTokenCrossEntropy(), rows(32, shift=True)
    from transformers import GPT2Config, GPT2ForTokenClassification

    config = GPT2Config(
        vocab_size=32, n_positions=16, n_embd=16, n_layer=1, n_head=2, num_labels=5,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, classifier_dropout=0.0,
    )  # fmt: skip
    return GPT2ForTokenClassification(config), TokenCrossEntropy(), rows(5, shift=False)


def trainer_scenario(kind: str) -> dict[str, Any]:
    from transformers import Trainer, TrainingArguments
    from transformers.utils import logging as transformers_logging

    transformers_logging.set_verbosity_error()
    model, loss, data = model_of(kind.removeprefix("trainer-"))

    class InOrder(Trainer):  # each rank its shard of the rows, in order
        def _get_train_sampler(self, *args: Any, **kwargs: Any) -> torch.utils.data.Sampler[int]:
            return torch.utils.data.distributed.DistributedSampler(data, shuffle=False)

    callback = equiv.auditing.transformers_callback(loss=loss, say=None)
    with tempfile.TemporaryDirectory() as output_dir:
        args = TrainingArguments(
            output_dir=output_dir,
            per_device_train_batch_size=2,
            gradient_accumulation_steps=2,
            report_to="none",
            save_strategy="no",
            disable_tqdm=True,
            remove_unused_columns=False,
            deepspeed=DEEPSPEED,
        )
        trainer = InOrder(model=model, args=args, train_dataset=data, callbacks=[callback])
        with contextlib.redirect_stdout(io.StringIO()):
            trainer.train()
    audit = callback.audit
    return {"kind": kind, "audit": audit.to_dict(), "summary": audit.summary(), "read": audit.read}


def accelerate_scenario(kind: str) -> dict[str, Any]:
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin

    steps = 2
    plugin = DeepSpeedPlugin(
        hf_ds_config={
            "zero_optimization": {"stage": 2},
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": steps,
            "gradient_clipping": 1.0,
        }
    )
    accelerator = Accelerator(deepspeed_plugin=plugin)
    model, loss, data = model_of("llama")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = data[rank::world]
    batches = [{key: torch.stack([row[key] for row in mine[at : at + 2]]) for key in mine[0]} for at in (0, 2, 4, 6)]
    with equiv.audit(model, optimizer, loss=loss) as audit:
        for start in range(0, len(batches), steps):
            window = batches[start : start + steps]
            count = torch.tensor([float(sum(int((b["labels"][:, 1:] != -100).sum()) for b in window))])
            dist.all_reduce(count)
            for batch in window:
                with accelerator.accumulate(model):
                    output = model(**batch)
                    if kind == "accelerate-mean":
                        accelerator.backward(output.loss)  # the model's own mean over this micro-batch's tokens
                    else:
                        summed = torch.nn.functional.cross_entropy(
                            output.logits[:, :-1].reshape(-1, output.logits.shape[-1]),
                            batch["labels"][:, 1:].reshape(-1),
                            ignore_index=-100,
                            reduction="sum",
                        )
                        accelerator.backward(summed / float(count) * world * steps)
                    optimizer.step()
                    optimizer.zero_grad()
    return {"kind": kind, "audit": audit.to_dict(), "summary": audit.summary(), "read": audit.read}


def accelerate_sees_the_ranks() -> None:
    """Accelerate finds a DeepSpeed run's ranks from its accelerator's backend (NCCL on GPUs); on CPU, DeepSpeed's
    ``DS_ACCELERATOR=cpu`` has none it knows, so its state says one process and the Trainer would count
    ``num_items_in_batch`` on each rank alone.  Here it is told what GPUs would tell it: gloo over the
    torchrun ranks (accelerate's own multi-CPU branch), DeepSpeed on top."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    prepare = PartialState._prepare_backend

    def on_the_ranks(self: Any, *args: Any, **kwargs: Any) -> tuple[str, Any]:
        backend, kind = prepare(self, *args, **kwargs)
        return ("gloo", DistributedType.MULTI_CPU) if backend is None else (backend, kind)

    PartialState._prepare_backend = on_the_ranks


def main() -> None:
    import deepspeed

    out, kinds = sys.argv[1], sys.argv[2:]
    deepspeed.init_distributed(dist_backend="gloo")
    accelerate_sees_the_ranks()
    results = []
    for kind in kinds:
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(True)  # each scenario its own Accelerator (and DeepSpeed plugin), as a new run's
        results.append((accelerate_scenario if kind.startswith("accelerate") else trainer_scenario)(kind))
    if dist.get_rank() == 0:
        with open(out, "w") as handle:
            for result in results:
                handle.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()

"""torchtune's full fine-tune recipe (``recipes/full_finetune_single_device.py``) under
gradient accumulation, its training loop run unmodified and audited (:mod:`equiv.auditing`).

The recipe's loop (torchtune 0.6.1, the last release; torchtune #1875) normalises by a
running token count: each micro-batch's mean loss times its count of labels that are not
``ignore_index``, the gradients scaled by 1 / the window's count before the step.  The
count is taken on the labels *before* the recipe shifts them (``labels[..., 1:]``), so a
sequence whose first label is not masked adds a token that no loss term has (the shift
moved into the datasets after 0.6.1, torchtune #2613).  Two datasets show it:

* ``first_label_masked=True`` (an SFT sample whose prompt is masked: its first label is
  ``ignore_index``): the count is the window's next-token count, equivalent;
* ``first_label_masked=False`` (text completion: labels are the tokens): not equivalent,
  each micro-batch weighted by its unshifted over its shifted count; the run is audited a
  second time against that normaliser (:class:`UnshiftedCount`), which the judge finds equivalent.

The recipe object is the installed recipe's class, built by its ``__init__`` from a
config; the components its ``setup`` would instantiate from checkpoint and tokenizer files
(none are downloaded here) are torchtune's own, set on it: a one-layer ``llama3`` from its
component builder, ``CEWithChunkedOutputLoss``, ``padded_collate_sft`` over a
``DistributedSampler``, SGD.  Each micro-batch ``_loss_step`` receives is recorded for the
replay (its labels never reach the model's ``forward``).  float32 (torchtune's RMSNorm
computes in float32 whatever the model's dtype).  Needs torchtune and torchao (see
README: torchao 0.15, the last whose names torchtune 0.6.1 imports on torch 2.13).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from equiv.auditing.replay import Call
from equiv.auditing.watch import Audit, audit
from equiv.losses import NextTokenCrossEntropy

__all__ = ["UnshiftedCount", "full_finetune_run", "recipe_class", "results", "versions", "write_results"]

VOCAB = 16
#: real lengths of 12 sequences, micro-batches of 2 in order: unequal counts per micro-batch
LENGTHS = [8, 3, 5, 5, 2, 7, 6, 1, 4, 8, 3, 3]


def versions() -> dict[str, str]:
    return {package: importlib.metadata.version(package) for package in ("torchtune", "torchao", "torch")}


def recipe_class() -> Any:
    """``FullFinetuneRecipeSingleDevice`` from the installed torchtune's ``recipes/`` folder
    (not an importable package: torchtune runs recipes as scripts, ``tune run``)."""
    spec = importlib.util.find_spec("recipes")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("torchtune's recipes folder is not installed (pip install torchtune)")
    path = f"{next(iter(spec.submodule_search_locations))}/full_finetune_single_device.py"
    module_spec = importlib.util.spec_from_file_location("equiv_torchtune_full_finetune_single_device", path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.FullFinetuneRecipeSingleDevice


class UnshiftedCount(NextTokenCrossEntropy):
    """The hypothesis: each micro-batch's next-token mean weighted by its count of labels
    before the shift, the window divided by the sum of those counts."""

    def sum(self, output: Tensor, target: Tensor) -> Tensor:
        return super().sum(output, target) * (target != self.ignore_index).sum() / super().count(target)

    def count(self, target: Tensor) -> Tensor:
        return (target != self.ignore_index).sum()


def _call(model: nn.Module, call: Call) -> Any:
    return model(tokens=call[0][0]["tokens"])


def _output(output: Any) -> Tensor:
    """The chunked output (a list of sequence chunks, CEWithChunkedOutputLoss) put back together."""
    return torch.cat(output, dim=1) if isinstance(output, list) else output


def _targets(call: Call) -> Tensor:
    labels: Tensor = call[0][0]["labels"]
    return labels


def full_finetune_run(
    *, first_label_masked: bool, gradient_accumulation_steps: int = 2, seed: int = 0
) -> dict[str, Audit]:
    """The recipe's ``train()`` for 3 optimizer steps over ``LENGTHS``, audited against the
    window's next-token mean (``"documented"``) and against :class:`UnshiftedCount` (``"unshifted count"``)."""
    with tempfile.TemporaryDirectory() as output_dir:
        recipe = recipe_class()(_config(output_dir, gradient_accumulation_steps, seed))
        _set_components(recipe, output_dir, seed=seed, first_label_masked=first_label_masked)
        return _train_audited(recipe)


#: Samples per micro-batch, and optimizer steps run.
_MICRO_BATCH, _STEPS = 2, 3


def _config(output_dir: str, gradient_accumulation_steps: int, seed: int) -> Any:
    """The recipe's config: float32 on the CPU, SGD steps with no clipping, no checkpoint to resume."""
    from omegaconf import OmegaConf

    return OmegaConf.create(
        {
            "device": "cpu",
            "dtype": "fp32",
            "output_dir": output_dir,
            "resume_from_checkpoint": False,
            "gradient_accumulation_steps": gradient_accumulation_steps,
            "optimizer_in_bwd": False,
            "clip_grad_norm": None,
            "seed": seed,
            "epochs": 1,
            "max_steps_per_epoch": _STEPS,
            "batch_size": _MICRO_BATCH,
            "checkpointer": {"model_type": "LLAMA3"},
            "log_every_n_steps": 1,
        }
    )


def _set_components(recipe: Any, output_dir: str, *, seed: int, first_label_masked: bool) -> None:
    """What the recipe's ``setup`` would build from checkpoint and tokenizer files, set on it:
    the model, the loss, the data loader, the optimizer, the logger and the step counters."""
    from torchtune import training
    from torchtune.data import padded_collate_sft
    from torchtune.models.llama3 import llama3
    from torchtune.modules.loss import CEWithChunkedOutputLoss
    from torchtune.training.metric_logging import DiskLogger

    torch.manual_seed(seed)
    model = llama3(
        vocab_size=VOCAB, num_layers=1, num_heads=2, num_kv_heads=1, embed_dim=16, max_seq_len=32, intermediate_dim=32
    )
    loss_fn = CEWithChunkedOutputLoss(num_output_chunks=2)
    model.set_num_output_chunks(loss_fn.num_output_chunks)
    data = _dataset(seed, first_label_masked, loss_fn.ignore_index)
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=1, rank=0, shuffle=False)  # type: ignore[var-annotated,arg-type]
    recipe._model, recipe._loss_fn = model, loss_fn
    recipe._dataloader = torch.utils.data.DataLoader(
        data,  # type: ignore[arg-type]
        batch_size=_MICRO_BATCH,
        sampler=sampler,
        collate_fn=padded_collate_sft,
    )
    recipe._optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    recipe._lr_scheduler, recipe._compile, recipe.profiler_profile_memory = None, False, False
    recipe._metric_logger, recipe._profiler = DiskLogger(log_dir=output_dir), training.DummyProfiler()
    recipe._steps_per_epoch, recipe.global_step, recipe.epochs_run = _STEPS, 0, 0
    recipe.ignore_labels_cache = torch.full((_MICRO_BATCH, 1), loss_fn.ignore_index)
    recipe.activations_handling_ctx = training.get_act_offloading_ctx_manager(model, False)
    recipe.save_checkpoint = lambda epoch: None  # no checkpoint files: nothing was loaded from one


def _dataset(seed: int, first_label_masked: bool, ignore_index: int) -> list[dict[str, list[int]]]:
    """One sample of random tokens per length in ``LENGTHS``; its first label ``ignore_index``
    when ``first_label_masked`` (an SFT prompt), else the labels are the tokens (text completion)."""
    generator = torch.Generator().manual_seed(seed)
    data = []
    for length in LENGTHS:
        tokens = torch.randint(1, VOCAB, (length,), generator=generator).tolist()
        data.append({"tokens": tokens, "labels": [ignore_index, *tokens[1:]] if first_label_masked else tokens})
    return data


def _train_audited(recipe: Any) -> dict[str, Audit]:
    """Run the recipe's ``train()`` with two audits watching, each micro-batch recorded as
    ``_loss_step`` receives it."""
    settings: dict[str, Any] = {"record_forward": False, "call_model": _call, "output": _output, "targets": _targets}
    audits = {
        "documented": audit(recipe._model, recipe._optimizer, loss=NextTokenCrossEntropy(), **settings),
        "unshifted count": audit(recipe._model, recipe._optimizer, loss=UnshiftedCount(), **settings),
    }
    loss_step = recipe._loss_step

    def recording(batch: dict[str, Tensor]) -> Tensor:
        for watching in audits.values():
            watching.record(dict(batch))
        return loss_step(batch)

    recipe._loss_step = recording
    for watching in audits.values():
        watching.__enter__()
    try:
        recipe.train()
    finally:
        for watching in audits.values():
            watching.__exit__(None, None, None)
        recipe.cleanup()
    return audits


#: What each dataset is, and what the recipe's count is off by when it is not equivalent.
_DATASETS = {
    True: "SFT: each sequence's first label masked (a prompt)",
    False: "text completion: every label a token",
}
_UNSHIFTED_KIND = (
    "normaliser counts the labels before the recipe's shift (one token per sequence that no loss term has)"
)


def results() -> list[dict[str, Any]]:
    """The recipe on both datasets, as rows the peers report renders (the fields of
    :func:`equiv.peers.trl.results`' rows): each audited against the window's next-token mean,
    and a failing one again against the count the recipe used (its kind, when that explains every step)."""
    rows = []
    for masked in (True, False):
        audits = full_finetune_run(first_label_masked=masked)
        documented, unshifted = audits["documented"], audits["unshifted count"]
        failing = [w for w in documented.windows if not w.equivalent]
        ratios = [w.mismatches[0].update_ratio for w in failing]
        cosines = [w.mismatches[0].cosine for w in failing]
        magnitude = (
            f"update {min(ratios):.3g}-{max(ratios):.3g}x the full-batch one, cosine >= {min(cosines):.3f}"
            if failing
            else "within the allowance"
        )
        rows.append(
            {
                "trainer": "torchtune full_finetune_single_device",
                "loss_type": "CEWithChunkedOutputLoss",
                "setting": f"GA=2, {_DATASETS[masked]}",
                "verdict": "NOT equivalent" if failing else "equivalent",
                "kind": _UNSHIFTED_KIND if failing and unshifted else ("" if not failing else "not explained"),
                "magnitude": magnitude,
                "upstream": "torchtune #2613 (the shift moved into the datasets after 0.6.1)" if failing else "",
                "steps": [w.line() for w in documented.windows],
                "versions": versions(),
            }
        )
    return rows


def write_results(path: str | Path) -> list[dict[str, Any]]:
    """Measure the installed torchtune into ``path`` (JSON rows) for the peers report."""
    rows = results()
    Path(path).write_text(json.dumps(rows, indent=1, sort_keys=True) + "\n")
    return rows

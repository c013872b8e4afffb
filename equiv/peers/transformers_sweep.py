"""``equiv sweep transformers`` (issue 45): every model class of the installed transformers whose forward
computes a loss from its labels, built tiny, trained by the real ``Trainer`` with gradient accumulation on
default ``TrainingArguments``, audited by :func:`equiv.auditing.transformers_callback`: one
:class:`~equiv.peers.sweep_rows.SweepRow` a class.

The classes are those of the auto mappings (:data:`equiv.peers.transformers_tiny.FAMILIES`: causal LM,
masked LM, seq2seq LM, token and sequence classification, question answering, multiple choice,
pre-training), the config class from ``CONFIG_MAPPING_NAMES``.  Each is audited against the loss its family
declares, the float64 full-batch step of that loss over the window's items (the label tokens a token-level
head counts, the labelled sequences a per-sequence head counts, the examples a question-answering head
counts): the audit's verdict is the float64 check, and a failing window's witness names the weights the
Trainer applied and the setting involved (``model_accepts_loss_kwargs``, transformers #47688 / #37766).

A class's own failure never ends the sweep: it is a row whose reason names the stage ("building the
config", "building the model", "training") and the exception's type and first line.
"""

from __future__ import annotations

import contextlib
import copy
import io
import os
import tempfile
from typing import Any

import torch
from torch import Tensor

from equiv.auditing.settings import default_output, default_targets
from equiv.losses import CrossEntropy, Loss, NextTokenCrossEntropy, TokenCrossEntropy
from equiv.peers.sweep_rows import SweepRow
from equiv.peers.transformers_tiny import FAMILIES, SEQUENCE_LENGTH, family_rows, tiny_config

__all__ = ["TRAINER_ARGUMENTS", "audit_keywords", "declared_loss", "run_subject", "subjects"]

#: The TrainingArguments set, beside the defaults: the accumulation under test, and what running on CPU in a
#: temporary folder needs (no checkpoint, no reporting, no progress bar on the sweep's stderr).
TRAINER_ARGUMENTS: dict[str, Any] = {
    "gradient_accumulation_steps": 2,
    "use_cpu": True,
    "save_strategy": "no",
    "report_to": "none",
    "disable_tqdm": True,
}
#: A tiny model has tens of thousands of parameters; past this one a size field was left large, and the class
#: is a reason row rather than minutes (or gigabytes) of the sweep.
MAX_PARAMETERS = 5_000_000
#: One window audited in every ``_EVERY`` optimizer steps (3 epochs of one step each: steps 1 and 3 audited).
_EVERY = 2


def subjects(options: dict[str, Any]) -> list[tuple[str, str]]:
    """The model classes swept, (class name, family), sorted by name; ``options["only"]`` (names) keeps those
    alone, an unknown name refused in one line."""
    from transformers.models.auto import modeling_auto

    family_of: dict[str, str] = {}
    for mapping, family in FAMILIES:
        for name in getattr(modeling_auto, mapping, {}).values():
            for class_name in (name,) if isinstance(name, str) else name:
                family_of.setdefault(class_name, family)
    only = list(options.get("only") or [])
    unknown = [name for name in only if name not in family_of]
    if unknown:
        raise ValueError(
            f"--only names no model class of the installed transformers' loss-computing heads: {', '.join(unknown)} "
            f"(expected class names such as GPT2ForTokenClassification, LlamaForCausalLM)"
        )
    chosen = only or list(family_of)
    return sorted((name, family_of[name]) for name in dict.fromkeys(chosen))


def _config_class_of(class_name: str) -> type:
    """The config class of a model class, from the auto mappings (model type -> config class name)."""
    import transformers
    from transformers.models.auto import configuration_auto, modeling_auto

    for mapping, _ in FAMILIES:
        for model_type, name in getattr(modeling_auto, mapping, {}).items():
            if class_name == name or (not isinstance(name, str) and class_name in name):
                config_name = configuration_auto.CONFIG_MAPPING_NAMES[model_type]
                config_class: type = getattr(transformers, config_name)
                return config_class
    raise KeyError(f"{class_name} is in none of the swept auto mappings")


def _span_output(output: Any) -> Tensor:
    """A question-answering head's start and end logits, (batch, positions, 2): the positions are the classes."""
    return torch.stack([output.start_logits, output.end_logits], dim=-1)


def _span_targets(call: tuple[tuple[Any, ...], dict[str, Any]]) -> Tensor:
    """A question-answering call's start and end positions, (batch, 2)."""
    kwargs = call[1]
    return torch.stack([kwargs["start_positions"], kwargs["end_positions"]], dim=-1)


def _declared_losses(family: str) -> list[tuple[Loss, dict[str, Any]]]:
    """The losses a head of ``family`` may compute, the family's own first: a token-level head's labels are
    shifted (a decoder-only model predicting the next token, some in the seq2seq mapping) or not."""
    first = declared_loss(family)
    if family == "causal LM":
        return [first, (TokenCrossEntropy(), {})]
    if isinstance(first[0], TokenCrossEntropy):
        return [first, (NextTokenCrossEntropy(), {})]
    return [first]


def declared_loss(family: str) -> tuple[Loss, dict[str, Any]]:
    """The loss a head of ``family`` computes, as an equiv loss with its items, and the audit's keywords that
    read it from the call: next-token cross-entropy over the label tokens (causal LM); cross-entropy over the
    label tokens (masked, seq2seq, token classification, pre-training); over the labelled sequences, -100 not
    counted (sequence classification, multiple choice); a question-answering head's mean of its start and end
    cross-entropies, over the examples (every position in range, so ``ignore_index`` never matches: each
    example counts its two targets, the mean of the two means)."""
    if family == "causal LM":
        return NextTokenCrossEntropy(), {}
    if family in ("masked LM", "seq2seq LM", "token classification", "pre-training"):
        return TokenCrossEntropy(), {}
    if family in ("sequence classification", "multiple choice"):
        return CrossEntropy(ignore_index=-100), {}
    if family == "question answering":
        return CrossEntropy(ignore_index=SEQUENCE_LENGTH), {"output": _span_output, "targets": _span_targets}
    raise ValueError(f"unknown family {family!r}; expected one of {[name for _, name in FAMILIES]}")


#: How close a head's own loss and a declared one must be to be the same objective: float32's rounding (heads
#: upcast their logits to float32 for the loss, whatever the model's dtype), far below the gap between two
#: objectives (a shifted and an unshifted cross-entropy differ by about 1e-3 of the loss on the rows swept).
_SAME_LOSS = 1e-5


def matching_loss(model: Any, family: str, rows: list[dict[str, Tensor]]) -> tuple[Loss, dict[str, Any]]:
    """The family's loss that the head computes: its own loss on the first micro-batch, in float64 and without
    the Trainer's ``num_items_in_batch``, equal to the declared loss's mean (to :data:`_SAME_LOSS`).  A head computing
    another objective (a label smoothing, an auxiliary loss, labels read otherwise) is refused here, never
    judged by a loss it does not train: the audit would flag a right run.  Raises ValueError naming both."""
    from transformers import default_data_collator

    batch = default_data_collator(rows[:8])
    twin = copy.deepcopy(model).double().train()
    with torch.no_grad():
        output = twin(**batch)
    own = getattr(output, "loss", None)
    if not isinstance(own, Tensor):
        raise ValueError(f"the forward returned no loss from {sorted(batch)}")
    found = []
    for loss, reading in _declared_losses(family):
        logits = reading.get("output", default_output)(output)
        targets = reading.get("targets", default_targets)(((), batch))
        declared = float(loss.sum(logits, targets) / loss.count(targets))
        if abs(declared - float(own)) <= _SAME_LOSS * max(1.0, abs(float(own))):
            return loss, reading
        found.append(f"{loss!r} {declared:.6g}")
    raise ValueError(f"the head's own loss ({float(own):.6g} in float64) is none of {', '.join(found)}")


def audit_keywords(family: str, loss: str) -> str:
    """The callback's keywords as code, for a reproduction: ``loss`` (the repr of the loss the head was found
    to compute), the audit's share, and a question-answering head's readers of its logits and positions."""
    keywords = [f"loss=equiv.losses.{loss}" if loss else "loss=...", f"every={_EVERY}"]
    if family == "question answering":
        keywords += [
            "output=lambda out: torch.stack([out.start_logits, out.end_logits], dim=-1)",
            'targets=lambda call: torch.stack([call[1]["start_positions"], call[1]["end_positions"]], dim=-1)',
        ]
    return ", ".join(keywords)


def _reason(stage: str, exc: BaseException) -> str:
    """One line: where, the exception's type and the first line of its message."""
    first = (str(exc).strip().splitlines() or [""])[0][:200]
    return f"{stage}: {type(exc).__name__}: {first}" if first else f"{stage}: {type(exc).__name__}"


def _build(subject: str, family: str, seed: int) -> tuple[Any, dict[str, Any]]:
    """The tiny model and the config fields set; raises with the stage named (``_Stage``)."""
    import transformers

    try:
        config_class = _config_class_of(subject)
        config, fields = tiny_config(config_class)
    except Exception as exc:
        raise _Stage("building the config", exc) from exc
    try:
        model_class = getattr(transformers, subject)
        with torch.device("meta"):  # counted before a byte is allocated: a size field not shrunk shows here
            parameters = sum(p.numel() for p in model_class(config).parameters())
        if parameters > MAX_PARAMETERS:
            raise ValueError(
                f"{parameters:,} parameters after shrinking, over the sweep's {MAX_PARAMETERS:,} (a size field "
                "the generic shrinking does not know)"
            )
        torch.manual_seed(seed)
        model = model_class(config)
    except Exception as exc:
        raise _Stage("building the model", exc) from exc
    built: dict[str, Any] = {"config_class": config_class.__name__, "config": fields}
    # A dropout whose probability no config field reaches (a head's own constant): turned off here, by name in
    # the receipt, since a mask drawn per forward makes no run the full-batch one (the audit would say so).
    zeroed = [name for name, module in model.named_modules() if isinstance(module, torch.nn.Dropout) and module.p]
    for name in zeroed:
        model.get_submodule(name).p = 0.0
    if zeroed:
        built["dropout_modules_zeroed"] = zeroed
    return model, built


class _Stage(Exception):
    """A subject's failure and the stage it failed at."""

    def __init__(self, stage: str, cause: BaseException) -> None:
        super().__init__(stage)
        self.stage, self.cause = stage, cause


def _train(model: Any, family: str, seed: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """Train ``model`` with the real Trainer on ``family``'s rows, audited; the audit's ``to_dict()`` and what
    was read of the run (whether the Trainer passed the loss keywords)."""
    from transformers import Trainer, TrainingArguments

    from equiv.auditing.trainers import transformers_callback

    rows = family_rows(family, seed)
    try:
        loss, reading = matching_loss(model, family, rows)
    except Exception as exc:
        raise _Stage("checking the declared loss", exc) from exc
    callback = transformers_callback(loss=loss, every=_EVERY, say=None, **reading)
    with tempfile.TemporaryDirectory(prefix="equiv-sweep-") as folder:
        args = TrainingArguments(output_dir=folder, **TRAINER_ARGUMENTS)
        trainer = Trainer(model=model, args=args, train_dataset=rows, callbacks=[callback])
        try:
            with contextlib.redirect_stdout(io.StringIO()):  # the Trainer's end-of-training metrics line
                trainer.train()
        except BaseException as exc:
            # training ended without on_train_end: end the audit here, so its hooks (on torch's functional
            # losses among them) do not outlive this class and judge the next one's calls
            if callback.audit is not None:
                callback.audit.__exit__(type(exc), exc, exc.__traceback__)
            raise
    if callback.audit is None:
        raise RuntimeError("the Trainer never began training (the audit was not started)")
    return callback.audit.to_dict(), {
        "model_accepts_loss_kwargs": bool(trainer.model_accepts_loss_kwargs),
        "loss": repr(loss),
        "callback": audit_keywords(family, repr(loss)),
    }


def run_subject(subject: str, options: dict[str, Any]) -> SweepRow:
    """One model class built tiny, trained and audited: its row (never raises for the class's own failure)."""
    seed = int(options.get("seed", 0))
    family = options.get("family") or dict(subjects({"only": [subject]}))[subject]
    setup: dict[str, Any] = {"seed": seed, "trainer_arguments": dict(TRAINER_ARGUMENTS)}
    try:
        _quiet()
        model, built = _build(subject, family, seed)
        setup.update(built)
        audit, read = _train(model, family, seed)
    except _Stage as failed:
        return SweepRow(subject, family, reason=_reason(failed.stage, failed.cause), setup=setup)
    except Exception as exc:  # the Trainer's own, or the audit's refusal of what it recorded
        return SweepRow(subject, family, reason=_reason("training", exc), setup=setup)
    return SweepRow(subject, family, audit=audit, setup={**setup, **read})


def _quiet() -> None:
    """transformers' warnings (a tiny config's, a Trainer's on CPU) off the sweep's stderr; no download."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()

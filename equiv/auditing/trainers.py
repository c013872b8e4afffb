"""The audit hooked into the trainers people run, as callbacks: nothing in the
training code changes but the callback list.

* transformers: ``Trainer(..., callbacks=[equiv.auditing.transformers_callback(loss=...)])``: the
  micro-batches are the calls the Trainer makes to the model (``labels`` among them); the clip norm
  is read from the ``TrainingArguments`` (``max_grad_norm``, 1.0 by default);
* Lightning: ``pl.Trainer(..., callbacks=[equiv.auditing.lightning_callback(loss=...)])``: the
  micro-batches are the training batches (``on_train_batch_start``), since a ``training_step``
  usually computes its loss outside ``forward``; replayed as ``module(x)`` against ``y`` for a
  batch ``(x, y)`` unless ``call_model=`` / ``targets=`` say otherwise; the clipping is read from
  the ``pl.Trainer`` (``gradient_clip_val``, by norm or by value);
* a plain loop or Accelerate's ``accumulate()`` loop: ``with equiv.audit(model, optimizer, loss=...)``.

Each starts :func:`equiv.audit` on the model and the torch optimizer when
training begins (under a wrapper such as Accelerate's ``AcceleratedOptimizer``
or Lightning's ``LightningOptimizer``: the torch optimizer inside, whose
``step`` is the one that updates the weights) and ends it when training ends;
the audit is then in ``.audit`` (``.audit.summary()``).  What a callback read from
the trainer's settings is said in one line when training begins (``say=``, ``print`` by
default) and kept in ``.audit.read``; a callback's own ``max_grad_norm=`` overrides it.  transformers and
Lightning are imported only when a callback is made (extra ``peers``).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from equiv.auditing.replay import Call
from equiv.auditing.settings import clip_setting
from equiv.auditing.watch import Audit, audit
from equiv.results.witness import Witness

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


def _start(
    model: nn.Module | None,
    optimizer: Any,
    settings: dict[str, Any],
    read: tuple[dict[str, Any], dict[str, Any]],
    source: str,
    say: Callable[[str], None] | None,
) -> Audit:
    """The audit of a trainer's run, told what ``read`` took from the trainer's own settings (the
    settings shown, and the audit's keywords they give; the callback's ``settings`` win), the line
    saying so kept in ``audit.read`` and handed to ``say``."""
    if model is None or optimizer is None:
        raise RuntimeError(
            "the trainer began training without handing its model and optimizer to callbacks: "
            f"got model={type(model).__name__}, optimizer={type(optimizer).__name__}"
        )
    shown, told = read
    started = audit(model, torch_optimizer(optimizer), **{**told, **settings})
    replayed = [f"{key}={value}" for key, value in told.items() if value is not None and key not in shown]
    overridden = [f"{key}={settings[key]}" for key in told if key in settings]
    started.read = (
        f"equiv audit: read from {source}: "
        + ", ".join(f"{key}={value}{_meaning(key, value)}" for key, value in shown.items())
        + (f"; replayed with {', '.join(replayed)}" if replayed else "")
        + (f"; the callback's own {', '.join(overridden)} used instead" if overridden else "")
        + ("" if started.deepspeed is None else f"; {started.deepspeed.said()}")
    )
    if say is not None:
        say(started.read)
    return started.__enter__()


def _meaning(key: str, value: Any) -> str:
    """What a setting read means to the audit, when it is not plain."""
    if key in ("max_grad_norm", "gradient_clip_val") and clip_setting(key, value) is None:
        return " (no clipping)"
    if key == "model_accepts_loss_kwargs" and value is False:
        return (
            " (the Trainer divides each micro-batch's mean loss by gradient_accumulation_steps: a window of "
            "unequal token counts is not its full-batch step, transformers #37766)"
        )
    if key == "loss_is_scaled_for_ga":
        return (
            " (set by the trainer: the Trainer divides each micro-batch's loss by gradient_accumulation_steps)"
            if value is False
            else " (set by the trainer: each micro-batch's loss used as is)"
        )
    if key == "label_smoothing_factor":
        return " (the Trainer's loss is label-smoothed: loss= must name the same objective)"
    return ""


def transformers_callback(*, say: Callable[[str], None] | None = print, **settings: Any) -> Any:
    """A ``transformers.TrainerCallback`` auditing the Trainer's optimizer steps;
    ``settings``: those of :func:`equiv.audit` (``loss=`` at least).  The clip norm is read from
    the ``TrainingArguments`` (``max_grad_norm``, 1.0 by default; 0 or None: none), and what was
    read (accumulation steps, precision, whether the model takes the Trainer's loss keywords) is
    handed to ``say`` in one line when training begins (``say=None``: kept in ``audit.read`` only).

    Args:
        say: hears the one line saying what was read from the ``TrainingArguments``, when training
            begins (``print`` by default; None: kept in ``audit.read`` only).
        **settings: the keywords of :func:`equiv.audit` (``loss=`` at least); ``max_grad_norm=``
            here overrides the one read from the ``TrainingArguments``.

    Returns:
        The callback (a ``transformers.TrainerCallback``), for ``Trainer(..., callbacks=[...])``;
        once training has begun, its ``.audit`` is the :class:`~equiv.auditing.Audit`
        (``.audit.summary()``).
    """
    from transformers import TrainerCallback

    class _TransformersAudit(TrainerCallback):  # type: ignore[misc,unused-ignore]
        def __init__(self) -> None:
            self.audit: Audit | None = None

        def on_train_begin(
            self,
            args: Any,
            state: Any,
            control: Any,
            model: nn.Module | None = None,
            optimizer: Any = None,
            **kwargs: Any,
        ) -> None:
            trainer = _calling_trainer()
            read = _read_training_arguments(args, model, trainer)
            self.audit = _start(model, optimizer, settings, read, "TrainingArguments", say)
            name = "Trainer" if trainer is None else type(trainer).__name__
            self.audit.setting_at_fault = _transformers_setting_at_fault(read[0], name)

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if self.audit is not None:  # the epoch as a fraction (the Trainer's own count)
                self.audit.position = f"epoch {state.epoch:.2f}" if state.epoch is not None else None

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if self.audit is not None:
                self.audit.__exit__(None, None, None)

    return _TransformersAudit()


def _calling_trainer() -> Any:
    """The ``transformers.Trainer`` whose callback handler is calling: the Trainer does not hand itself to its
    callbacks, yet what it decides about the loss's scaling lives on it (``loss_is_scaled_for_ga``, set by
    subclasses such as TRL's DPO, KTO and Reward trainers, transformers 5.19+; ``model_accepts_loss_kwargs``;
    ``compute_loss_func``).  Found as ``self`` of a calling frame (``Trainer._inner_training_loop`` calls
    ``callback_handler.on_train_begin``); None when no Trainer is among the nearest callers."""
    from transformers import Trainer

    frame = inspect.currentframe()
    try:
        for _ in range(16):  # on_train_begin <- call_event <- on_train_begin (handler) <- the training loop
            frame = frame.f_back if frame is not None else None
            if frame is None:
                return None
            candidate = frame.f_locals.get("self")
            if isinstance(candidate, Trainer):
                return candidate
        return None
    finally:
        del frame  # a frame held in a local keeps every caller's locals alive


def _read_training_arguments(
    args: Any, model: nn.Module | None, trainer: Any = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """What the Trainer does to the step, from its arguments (and the Trainer itself, when found): the clip
    norm it applies once per step (``max_grad_norm > 0``), its accumulation, its mixed precision, and
    whether it divides each micro-batch's loss by the accumulation steps: it does unless the loss counts as
    scaled (``loss_is_scaled_for_ga`` when a subclass sets it; else the model takes the loss keywords,
    ``num_items_in_batch``: the window's token count, or a ``compute_loss_func`` is passed; transformers
    #37766)."""
    norm = getattr(args, "max_grad_norm", None)
    accepts = getattr(trainer, "model_accepts_loss_kwargs", None)
    shown = {
        "max_grad_norm": norm,
        "gradient_accumulation_steps": getattr(args, "gradient_accumulation_steps", 1),
        "bf16": bool(getattr(args, "bf16", False)),
        "fp16": bool(getattr(args, "fp16", False)),
        "model_accepts_loss_kwargs": accepts if isinstance(accepts, bool) else _accepts_loss_kwargs(model),
    }
    scaled = getattr(trainer, "loss_is_scaled_for_ga", None)
    if isinstance(scaled, bool):  # it replaces the rule above (transformers 5.19+)
        del shown["model_accepts_loss_kwargs"]
        shown["loss_is_scaled_for_ga"] = scaled
    shifts = getattr(trainer, "_loss_shifts_labels", None)  # transformers 5.x: count labels[..., 1:] or labels
    if shifts is False:
        shown["loss_type"] = getattr(getattr(trainer, "model", None), "loss_type", None)
    if getattr(trainer, "compute_loss_func", None) is not None:
        shown["compute_loss_func"] = getattr(
            trainer.compute_loss_func, "__name__", type(trainer.compute_loss_func).__name__
        )
    if getattr(args, "label_smoothing_factor", 0):
        shown["label_smoothing_factor"] = args.label_smoothing_factor
    return shown, {"max_grad_norm": clip_setting("max_grad_norm", norm)}


#: The witness's name of weights 1/(N + rows): the items counted on labels before a causal LM's shift.
_OFF_BY_ONE = "count off by one per row"
#: The witness's names of a window whose micro-batch means were summed or averaged, not weighted by their items.
_MEANS_SUMMED = ("sum without division", "mean of means", "tail divided by N")


def _transformers_setting_at_fault(shown: dict[str, Any], trainer: str = "Trainer") -> Callable[[Witness], str | None]:
    """The Trainer's setting a failing window's witness points at, from what was read: a subclass's
    ``loss_is_scaled_for_ga`` decides first (``False``: each micro-batch's loss divided by the accumulation
    steps, trl PR #5710; ``True``: used as is, so its loss had to divide by the window's items itself); else
    with the loss keywords passed (``model_accepts_loss_kwargs=True``) the Trainer neither divides by the
    accumulation steps nor normalises itself, so micro-batch means summed are the model's loss ignoring
    ``num_items_in_batch`` (transformers #47688); without them the Trainer divides each micro-batch's mean by
    ``gradient_accumulation_steps`` (transformers #37766)."""
    accepts = shown.get("model_accepts_loss_kwargs")
    scaled = shown.get("loss_is_scaled_for_ga")
    steps = shown.get("gradient_accumulation_steps")

    def at_fault(witness: Witness) -> str | None:
        named = set(witness.normaliser.split(" or "))
        if _OFF_BY_ONE in named and "loss_type" in shown:
            return (
                f"the model's loss_type={shown['loss_type']!r} is not ForCausalLM, so the Trainer counted "
                "num_items_in_batch over labels, not labels[..., 1:], though the model's loss shifts them: one "
                "item too many per row (set the model's loss_type to 'ForCausalLM')"
            )
        if not named & set(_MEANS_SUMMED):
            return None
        if scaled is False:
            return (
                f"{trainer}.loss_is_scaled_for_ga=False: the Trainer divides each micro-batch's mean loss by "
                f"gradient_accumulation_steps={steps}, a mean of micro-batch means, not the window's mean where its "
                "micro-batches hold unequal items (trl PR #5710)"
            )
        if scaled is True:
            return (
                f"{trainer}.loss_is_scaled_for_ga=True but its loss was not divided by the window's items "
                "(num_items_in_batch): the Trainer uses each micro-batch's loss as is"
            )
        if "compute_loss_func" in shown:
            return (
                f"compute_loss_func={shown['compute_loss_func']} ignored num_items_in_batch (the Trainer passes it "
                "and leaves the normalising to the function)"
            )
        if accepts is True:
            return (
                "model_accepts_loss_kwargs=True but the model's loss ignored num_items_in_batch (the Trainer "
                "passes it and leaves the normalising to the model, transformers #47688: have its loss divide "
                "the summed item losses by num_items_in_batch)"
            )
        if accepts is False:
            return (
                f"model_accepts_loss_kwargs=False: the Trainer divides each micro-batch's mean loss by "
                f"gradient_accumulation_steps={steps} (transformers #37766: a forward taking **kwargs lets it "
                "pass num_items_in_batch)"
            )
        return None

    return at_fault


def _accepts_loss_kwargs(model: nn.Module | None) -> bool | None:
    """As the Trainer decides it: the model's ``accepts_loss_kwargs``, else a ``**kwargs`` in its ``forward``."""
    if model is None:
        return None
    declared = getattr(model, "accepts_loss_kwargs", None)
    if isinstance(declared, bool):
        return declared
    forward = type(model).forward  # the class's own, not a wrapper set on the instance
    return any(p.kind == inspect.Parameter.VAR_KEYWORD for p in inspect.signature(forward).parameters.values())


def lightning_callback(*, say: Callable[[str], None] | None = print, **settings: Any) -> Any:
    """A Lightning ``Callback`` auditing ``Trainer.fit``'s optimizer steps (one
    optimizer); ``settings``: those of :func:`equiv.audit` (``loss=`` at least).  The clipping
    is read from the ``pl.Trainer`` (``gradient_clip_val`` by ``gradient_clip_algorithm``: "norm"
    replayed as ``max_grad_norm``, "value" as ``max_grad_value``), and what was read (with
    ``accumulate_grad_batches`` and ``precision``) handed to ``say`` in one line.

    Args:
        say: hears the one line saying what was read from the ``pl.Trainer``, when training starts
            (``print`` by default; None: kept in ``audit.read`` only).
        **settings: the keywords of :func:`equiv.audit` (``loss=`` at least); ``max_grad_norm=`` or
            ``max_grad_value=`` here override the clipping read from the ``pl.Trainer``, and
            ``call_model=`` / ``targets=`` replace the ``module(x)`` against ``y`` replay of a batch
            ``(x, y)``.

    Returns:
        The callback (a Lightning ``Callback``), for ``pl.Trainer(..., callbacks=[...])``; once
        training has started, its ``.audit`` is the :class:`~equiv.auditing.Audit`
        (``.audit.summary()``).

    Raises:
        ValueError: when training starts, the Trainer has more than one optimizer or a
            ``gradient_clip_algorithm`` other than "norm" or "value".
    """
    import pytorch_lightning as pl

    settings = {"record_forward": False, "call_model": _lightning_call, "targets": _lightning_targets, **settings}

    class _LightningAudit(pl.Callback):  # type: ignore[misc,unused-ignore]
        def __init__(self) -> None:
            self.audit: Audit | None = None

        def on_train_start(self, trainer: Any, pl_module: nn.Module) -> None:
            if len(trainer.optimizers) != 1:
                raise ValueError(f"the audit follows one optimizer, the Trainer has {len(trainer.optimizers)}")
            self.audit = _start(
                pl_module, trainer.optimizers[0], settings, _read_lightning(trainer, pl_module), "pl.Trainer", say
            )

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


def _read_lightning(trainer: Any, module: nn.Module) -> tuple[dict[str, Any], dict[str, Any]]:
    """Lightning's clipping (applied once per optimizer step, under automatic optimization), its
    accumulation (each ``training_step``'s loss divided by ``accumulate_grad_batches``) and precision."""
    value = getattr(trainer, "gradient_clip_val", None)
    algorithm = getattr(trainer, "gradient_clip_algorithm", None)
    algorithm = str(getattr(algorithm, "value", algorithm) or "norm").lower()
    if algorithm not in ("norm", "value"):
        raise ValueError(f"the audit replays Lightning's gradient_clip_algorithm 'norm' or 'value', got {algorithm!r}")
    clip = clip_setting("gradient_clip_val", value)
    if clip is not None and not getattr(module, "automatic_optimization", True):
        clip = None  # under manual optimization the Trainer's clip settings are not applied by it
    return {
        "gradient_clip_val": value,
        "gradient_clip_algorithm": algorithm,
        "accumulate_grad_batches": getattr(trainer, "accumulate_grad_batches", 1),
        "precision": getattr(trainer, "precision", None),
    }, {
        "max_grad_norm": clip if algorithm == "norm" else None,
        "max_grad_value": clip if algorithm == "value" else None,
    }


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
        raise ValueError(
            f"the audit takes a Lightning batch as (inputs, targets), got {type(batch).__name__}: pass "
            "call_model=lambda module, call: ... and targets=lambda call: ... (the batch is call[0][0])"
        )
    return batch[1]

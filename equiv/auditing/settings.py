"""The options of :func:`equiv.audit`, written once: :class:`AuditSettings` (its fields are the
keywords ``equiv.audit`` takes, documented there), validated when made, and the defaults that
read a recorded call (its targets, the output the loss takes, how it is replayed)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn
from torch.optim.swa_utils import AveragedModel

from equiv.auditing.averaged import ExponentialAverage
from equiv.auditing.replay import Call
from equiv.losses import LossOptions, disagreement, loss_of, options_of_criterion
from equiv.results.audit import WindowAudit

__all__ = ["TARGET_KEYWORDS", "AuditSettings", "clip_setting", "default_call", "default_output", "default_targets"]


#: Keywords a model's ``forward`` takes its targets by, first match wins: transformers'
#: ``labels``; ``targets`` as nanoGPT's ``GPT.forward(idx, targets=None)`` is called by keyword.
TARGET_KEYWORDS = ("labels", "targets", "target")


def default_targets(call: Call) -> Tensor:
    """The targets of a recorded forward call: a keyword of :data:`TARGET_KEYWORDS`
    (``labels=`` for transformers, ``targets=``), else the second positional
    argument (``model(x, y)``, nanoGPT)."""
    args, kwargs = call
    for keyword in TARGET_KEYWORDS:
        if isinstance(kwargs.get(keyword), Tensor):
            return kwargs[keyword]
    if len(args) >= 2 and isinstance(args[1], Tensor):
        return args[1]
    raise ValueError(
        f"the audit cannot find the targets in the model's forward call (no keyword of {list(TARGET_KEYWORDS)}, no "
        f"second positional tensor; got {len(args)} positional arguments and keywords {sorted(kwargs)}). For a "
        "loop that computes loss = criterion(model(x), y), hand the audit criterion=<that nn.Module loss>, or call "
        "the loss function through audit.wrap(loss_fn); else pass targets=lambda call: ... mapping (args, kwargs) "
        "to the targets tensor"
    )


def _where_targets_were_found(call: Call) -> str:
    """Where :func:`default_targets` took a call's targets from, in words."""
    kwargs = call[1]
    keyword = next((k for k in TARGET_KEYWORDS if isinstance(kwargs.get(k), Tensor)), None)
    return (
        f"the {keyword}= keyword of the model's call"
        if keyword
        else "the second positional argument of the model's call"
    )


def default_call(model: nn.Module, call: Call) -> Any:
    """Replay a recorded forward call as it was made."""
    args, kwargs = call
    return model(*args, **kwargs)


def default_output(output: Any) -> Tensor:
    """What the loss takes from the model's output: ``.logits``, a tuple's first element, or the output."""
    logits = getattr(output, "logits", None)
    if isinstance(logits, Tensor):
        return logits
    if isinstance(output, (tuple, list)):
        return output[0]
    if isinstance(output, Tensor):
        return output
    raise ValueError(
        f"the audit cannot take a tensor from the model's output of type {type(output).__name__}: "
        "pass output=lambda out: ..."
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class AuditSettings:
    """The options of one audit, as it applies them: every keyword of :func:`equiv.audit` (where
    each is documented), validated when made, one line naming a value that is not what the audit
    can take.  ``loss`` is the objective judged by (derived from ``criterion`` when left out, checked
    against it when both are given); a clip of None, 0 or inf is None (no clipping)."""

    loss: Any = None
    every: int = 1
    targets: Callable[[Call], Tensor] = default_targets
    output: Callable[[Any], Tensor] = default_output
    max_grad_norm: float | None = None
    stop_at_first_failure: bool = False
    on_window: Callable[[WindowAudit], None] | None = None
    call_model: Callable[[nn.Module, Call], Any] = default_call
    record_forward: bool = True
    allow_nothing_judged: bool = False
    criterion: nn.Module | None = None
    max_grad_value: float | None = None
    averaged: AveragedModel | ExponentialAverage | None = None

    def __post_init__(self) -> None:
        criterion = self.criterion
        if criterion is not None and not isinstance(criterion, nn.Module):
            raise TypeError(
                f"criterion must be a torch.nn.Module the loop calls as criterion(output, target), got "
                f"{criterion!r}: for a loss function, call the one audit.wrap(loss_fn) returns"
            )
        loss = _loss_with_criterion(self.loss, criterion)
        if not (hasattr(loss, "sum") and hasattr(loss, "count")):
            raise TypeError(
                f"loss must offer sum(output, targets) and count(targets) (an equiv.Loss such as "
                f"equiv.NextTokenCrossEntropy()), got {loss!r}"
            )
        every = self.every
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be a positive int (audit one window in every), got {every!r}")
        # frozen: the values as applied are set once, here
        object.__setattr__(self, "loss", loss)
        object.__setattr__(self, "max_grad_norm", clip_setting("max_grad_norm", self.max_grad_norm))
        object.__setattr__(self, "max_grad_value", clip_setting("max_grad_value", self.max_grad_value))


def clip_setting(name: str, value: float | None) -> float | None:
    """A clip setting as the replay applies it: None for no clipping (None, 0 or inf, as the
    trainers mean them), else the positive float; anything else refused, naming the value."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or value < 0:
        raise ValueError(f"{name} must be a positive number, or None / 0 / inf for no clipping, got {value!r}")
    return None if value == 0 or math.isinf(value) else float(value)


def _loss_with_criterion(loss: Any, criterion: nn.Module | None) -> Any:
    """The loss the audit judges by: ``loss``, checked against what ``criterion`` computes (its
    options read: label smoothing, class weights, ignore_index), or derived from the criterion
    when ``loss`` is not given; a disagreement, or a criterion equiv cannot express, one line."""
    options = options_of_criterion(criterion) if criterion is not None else None
    if loss is None:
        if criterion is None:
            raise TypeError(
                "equiv.audit needs loss= (an equiv.Loss such as equiv.CrossEntropy()) or criterion= (the "
                "nn.Module loss the loop calls, whose loss the audit derives)"
            )
        if options is None:
            raise ValueError(
                f"criterion={type(criterion).__name__}() is not one of torch's losses the audit can read; "
                "pass loss=<an equiv.Loss offering sum(output, targets) and count(targets)>"
            )
        return loss_of(options)
    if options is not None:
        agree(loss, options, "criterion=")
    return loss


def agree(loss: Any, options: LossOptions, whose: str) -> None:
    """Refuse a run whose own loss computes another objective than ``loss`` (a correct run would be flagged)."""
    differ = disagreement(loss, options)
    if differ is not None:
        written = f"criterion={options.written}" if whose == "criterion=" else f"{whose} {options.written}"
        raise ValueError(
            f"loss={loss!r} and {written} disagree ({differ}): the audit would judge the run by another objective "
            "than the one it trains; pass the loss= that matches (equiv.CrossEntropy / TokenCrossEntropy take "
            "weight=, ignore_index=, label_smoothing=), or, with criterion=, leave loss= out to derive it"
        )

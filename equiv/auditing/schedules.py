"""The learning-rate schedule of an audited run, counted per optimizer step.

The audit replays each window with the hyperparameters the optimizer had when it
stepped, so a schedule that runs too fast still passes every window's update.  The
slip is common under gradient accumulation: ``scheduler.step()`` called once per
*micro-batch* (starVLA PR #210) runs the schedule N times too fast: the warm-up
ends N times early, the decay reaches its floor at 1/N of the run.  The full-batch
run steps its scheduler once per optimizer step.

What the audit counts: while an audit is open, the ``step`` of every scheduler class
of ``torch.optim.lr_scheduler`` that defines one (``LRScheduler`` and so every
subclass that keeps its ``step``, ``ReduceLROnPlateau``, ``SequentialLR``,
``ChainedScheduler``, ``CosineAnnealingWarmRestarts``) and of Accelerate's
``AcceleratedScheduler`` is wrapped; a call counts once for the *outermost* scheduler
stepped (a ``SequentialLR`` or ``ChainedScheduler`` stepping its children is one
advance) whose optimizer is the audited one (through its wrappers), and only when a
torch scheduler did step inside it: Accelerate's wrapper, stepped by the loop on every
micro-batch, steps the schedule only when the optimizer did (and then ``num_processes``
times by design when ``split_batches=False``: one advance).  A scheduler's first step,
made by its constructor, is not counted.

The rule, per audited window (the calls between the optimizer step before and its own):
none or one advance is the full-batch run's.  More than one, and the steps after the
first changed a hyperparameter of the optimizer (the learning rate, OneCycleLR's momentum
or betas): the window is NOT equivalent, its line naming the scheduler, the count and the
learning rate it moved through.  More than one that changed nothing (a constant schedule,
or a stretch of one): the update is the full-batch run's, so the window is judged on it, and
its line carries a note that the loop steps the scheduler per micro-batch (harmless in this
window, the schedule's step count still N times ahead: a schedule that changes later runs N
times too fast there).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from typing import Any, ClassVar, Protocol

import torch
from torch import Tensor

__all__ = ["Advance", "ScheduleWatch", "schedule_verdict"]


class _Watching(Protocol):
    """What the watch needs of an open audit: its optimizer and where to count an advance."""

    optimizer: torch.optim.Optimizer

    def _schedule_advanced(self, advance: Advance) -> None: ...


@dataclasses.dataclass(frozen=True, slots=True)
class Advance:
    """One advance of a schedule: the scheduler stepped, and the optimizer's hyperparameters around it."""

    scheduler: str
    before: tuple[dict[str, Any], ...]
    after: tuple[dict[str, Any], ...]

    @property
    def changed(self) -> bool:
        return self.before != self.after


def _hyperparameters(optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], ...]:
    """Every param group's settings but its parameters, tensors as plain numbers (comparable)."""

    def plain(value: Any) -> Any:
        if isinstance(value, Tensor):
            return tuple(value.detach().flatten().tolist())
        if isinstance(value, (tuple, list)):
            return tuple(plain(item) for item in value)
        return value

    return tuple(
        {key: plain(value) for key, value in group.items() if key != "params"} for group in optimizer.param_groups
    )


def _optimizers_of(scheduler: Any) -> list[Any]:
    """The optimizers a scheduler steps (Accelerate's wrapper: its scheduler's and its own list),
    each with every wrapper of it (``.optimizer`` repeatedly)."""
    found: list[Any] = []
    for holder in (scheduler, getattr(scheduler, "scheduler", None)):
        if holder is None:
            continue
        candidates = [getattr(holder, "optimizer", None), *(getattr(holder, "optimizers", None) or ())]
        for candidate in candidates:
            for _ in range(8):
                if candidate is None or any(candidate is seen for seen in found):
                    break
                found.append(candidate)
                candidate = getattr(candidate, "optimizer", None)
    return found


class ScheduleWatch:
    """The schedulers' ``step`` methods while an audit is open (one wrapper however many audits are
    open, restored when the last closes): each outermost step that advanced a torch schedule is
    told to the audits whose optimizer it schedules."""

    audits: ClassVar[list[_Watching]] = []
    originals: ClassVar[dict[type, Callable[..., Any]]] = {}
    #: scheduler steps now running (a SequentialLR's, an AcceleratedScheduler's children are inside one)
    depth: ClassVar[int] = 0
    #: torch schedulers stepped inside the outermost step now running
    stepped: ClassVar[int] = 0

    @classmethod
    def classes(cls) -> list[type]:
        """The scheduler classes that define their own ``step``: torch's, and Accelerate's when imported."""
        from torch.optim import lr_scheduler

        found = [
            scheduler_class
            for scheduler_class in vars(lr_scheduler).values()
            if isinstance(scheduler_class, type)
            and issubclass(scheduler_class, lr_scheduler.LRScheduler)
            and "step" in vars(scheduler_class)
        ]
        accelerate = sys.modules.get("accelerate.scheduler")
        wrapper = getattr(accelerate, "AcceleratedScheduler", None)
        if isinstance(wrapper, type) and "step" in vars(wrapper):
            found.append(wrapper)
        return found

    @classmethod
    def open(cls, audit: _Watching) -> None:
        if not cls.audits:
            for scheduler_class in cls.classes():
                cls.originals[scheduler_class] = vars(scheduler_class)["step"]
                setattr(scheduler_class, "step", cls.watching(scheduler_class, vars(scheduler_class)["step"]))  # noqa: B010
        cls.audits.append(audit)

    @classmethod
    def close(cls, audit: _Watching) -> None:
        if audit in cls.audits:
            cls.audits.remove(audit)
        if not cls.audits:
            for scheduler_class, original in cls.originals.items():
                setattr(scheduler_class, "step", original)  # noqa: B010
            cls.originals.clear()

    @classmethod
    def watching(cls, scheduler_class: type, original: Callable[..., Any]) -> Callable[..., Any]:
        from torch.optim.lr_scheduler import LRScheduler

        def step(scheduler: Any, *args: Any, **kwargs: Any) -> Any:
            # a torch scheduler's step advances its schedule, unless it is its constructor's first
            advances = isinstance(scheduler, LRScheduler) and not getattr(scheduler, "_is_initial", False)
            if cls.depth:  # inside another scheduler's step: one advance of that one, counted there
                cls.stepped += advances
                return original(scheduler, *args, **kwargs)
            watching = [
                audit
                for audit in cls.audits
                if any(optimizer is audit.optimizer for optimizer in _optimizers_of(scheduler))
            ]
            before = [_hyperparameters(audit.optimizer) for audit in watching]
            cls.depth, cls.stepped = 1, int(advances)
            try:
                return original(scheduler, *args, **kwargs)
            finally:
                advanced, cls.depth, cls.stepped = cls.stepped > 0, 0, 0
                if advanced:
                    for audit, hyper in zip(watching, before, strict=True):
                        audit._schedule_advanced(Advance(_named(scheduler), hyper, _hyperparameters(audit.optimizer)))

        step.__name__ = step.__qualname__ = "step"
        step.__wrapped__ = original  # type: ignore[attr-defined]
        return step


def _named(scheduler: Any) -> str:
    """A scheduler by its class; a wrapper's (Accelerate's) with the scheduler inside it."""
    inner = getattr(scheduler, "scheduler", None)
    return (
        f"{type(inner).__name__} (in an {type(scheduler).__name__})" if inner is not None else type(scheduler).__name__
    )


def _learning_rates(advances: list[Advance]) -> str:
    """The first param group's learning rate through the window's advances: ``0.001 -> 0.0008 -> 0.0006``."""
    rates = [
        advances[0].before[0].get("lr") if advances[0].before else None,
        *(advance.after[0].get("lr") if advance.after else None for advance in advances),
    ]
    shown = [
        f"{rate[0] if isinstance(rate, tuple) and len(rate) == 1 else rate:.4g}"
        for rate in rates
        if isinstance(rate, (int, float)) or (isinstance(rate, tuple) and len(rate) == 1)
    ]
    return " -> ".join(shown)


def schedule_verdict(advances: list[Advance]) -> tuple[str | None, str | None]:
    """What a window's schedule advances make of it: (why it is NOT equivalent, or None; a note, or None)."""
    if len(advances) <= 1:
        return None, None
    names = sorted({advance.scheduler for advance in advances})
    who = "the LR scheduler " + " and ".join(names)
    times = f"stepped {len(advances)} times in this window"
    fix = (
        "the full-batch run steps it once per optimizer step: call scheduler.step() after optimizer.step(), "
        "not per micro-batch"
    )
    if any(advance.changed for advance in advances[1:]):
        rates = _learning_rates(advances)
        through = f": the learning rate went {rates}" if rates.count("->") >= 1 else ""
        return (
            f"{who} {times}{through}, so this step took a learning rate (or another scheduled hyperparameter) "
            f"that the full-batch run's step does not; {fix}"
        ), None
    return None, (
        f"{who} {times} without changing the optimizer's hyperparameters, so this step is the full-batch "
        f"one, but the schedule advances {len(advances)} times per optimizer step and will run that much "
        f"too fast wherever it changes; {fix}"
    )

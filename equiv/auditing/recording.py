"""What the audit's hooks see of a run, and what one window saw (:class:`WindowRecord`).

The hooks, each told to the open audit (a :class:`Watcher`):

* :class:`WatchedForward`, the model's ``forward`` while an audit is open: each training-mode
  call recorded once (``model(x)``, ``model.forward(x)``, ``torch.compile``, Accelerate);
* :class:`ClipWatch`, torch's ``clip_grad_norm_`` / ``clip_grad_value_`` and
  ``GradScaler.step``: what the run clips to, and a step the scaler skipped;
* :class:`FunctionalLossMode`, a ``TorchFunctionMode`` on during audited windows only: the
  loop's own ``F.cross_entropy`` (or the ``F`` loss ``loss=`` maps onto) and its target.

The audit (:class:`equiv.auditing.watch.Audit`) opens a :class:`WindowRecord` when an audited
window begins and hands it to its judging (:mod:`equiv.auditing.judging`) when the step ends.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from equiv.auditing.averaged import AveragedWeights
from equiv.auditing.deepspeed import ZeroOptimizer
from equiv.auditing.ranks import local
from equiv.auditing.replay import Autocast, Call, RecordedWindow
from equiv.auditing.schedules import Advance
from equiv.judging.autocast import autocast_of
from equiv.judging.clip_calls import LIMIT_KEYWORDS, ClipCalls
from equiv.judging.inherent import generator_states
from equiv.losses import FUNCTIONAL, MSE, CrossEntropy, NextTokenCrossEntropy, TokenCrossEntropy

__all__ = [
    "CLIPS",
    "ClipWatch",
    "FunctionalLossMode",
    "Replaying",
    "WatchedForward",
    "Watcher",
    "WindowRecord",
    "detached",
    "first_not_finite",
    "functional_losses",
    "loss_target",
    "pop_mode",
]

#: What a recorded forward call's output hands the loss: its shape and dtype (None: not read).
OutputSpec = tuple[tuple[int, ...], torch.dtype]


class Watcher(Protocol):
    """What the hooks tell an open audit (:class:`equiv.auditing.watch.Audit`)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    #: optimizer steps taken so far
    steps: int
    #: the window being recorded (None: not audited)
    _window: WindowRecord | None
    #: calls of watched forwards now running
    _depth: int
    #: inside ``GradScaler.step``
    _in_scaler_step: bool
    #: the ``torch.nn.functional`` losses whose calls are seen
    _functional: frozenset[Callable[..., Tensor]]

    def _record_forward(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool: ...

    def _saw_output(self, output: Any) -> None: ...

    def _saw_functional(
        self, function: Callable[..., Tensor], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None: ...

    def _clipped(self, name: str, parameters: list[Tensor], limit: float) -> None: ...

    def _skipped(self) -> None: ...


@dataclass(slots=True)
class WindowRecord:
    """What the hooks saw of one audited window, from its start to its optimizer step."""

    #: the model's parameters and floating buffers when the window began (detached copies)
    params: dict[str, Tensor]
    buffers: dict[str, Tensor]
    #: ``optimizer.state_dict()`` when the window began (an FSDP2 rank's own shards)
    optimizer: dict[str, Any]
    #: every training-mode forward call of the window (detached copies), in order
    calls: list[Call] = field(default_factory=list)
    #: per call, the ``torch.autocast`` it ran under, or None
    autocast: list[Autocast | None] = field(default_factory=list)
    #: the clip calls on the model's parameters: (torch's function, its limit)
    clips: list[tuple[str, float]] = field(default_factory=list)
    #: per clip call, the forward calls recorded before it (fewer than the window's: it ran between micro-batches)
    clipped_after: list[int] = field(default_factory=list)
    #: per recorded forward call, the shape and dtype of what the loss takes, when it could be read
    outputs: list[OutputSpec | None] = field(default_factory=list)
    #: the targets a criterion / wrapped loss received, one per its call
    seen_targets: list[Tensor] = field(default_factory=list)
    #: the targets of the loop's ``torch.nn.functional`` loss calls (no wrap)
    functional_targets: list[Tensor] = field(default_factory=list)
    #: the advances of the optimizer's LR schedule in the window (set when the step ends)
    schedule: list[Advance] = field(default_factory=list)
    #: the gradient the step took, named if it is not finite (set when the step begins)
    not_finite: str | None = None
    #: the averaged model's weights when the window began (None: none kept, or the first window)
    averaged: dict[str, Tensor] | None = None
    #: what the optimizer steps when the window began, where that is not the model's parameters (DeepSpeed ZeRO's
    #: fp32 partitions, by name); None: the parameters
    held: dict[str, Tensor] | None = None
    #: whether a recorded forward call drew a random number (torch's generator advanced across it)
    drew_random: bool = False

    @classmethod
    def begin(
        cls, model: nn.Module, optimizer: torch.optim.Optimizer, averaged: AveragedWeights | None, steps: int
    ) -> WindowRecord:
        """What a window starts from, copied: the weights, the optimizer's state, the average's."""
        return cls(
            params={name: p.detach().clone() for name, p in model.named_parameters()},
            buffers={name: b.detach().clone() for name, b in model.named_buffers() if b.is_floating_point()},
            # an FSDP2 rank's state is DTensors: its own shards kept (its replica steps them)
            optimizer=copy.deepcopy(local_state(optimizer.state_dict())),
            # after a step, its update of the average is yet to come
            averaged=averaged.capture() if averaged is not None and steps else None,
            held=(
                {name: tensor.detach().clone() for name, tensor in optimizer.held().items()}
                if isinstance(optimizer, ZeroOptimizer)
                else None
            ),
        )

    def recorded(self, step: int, hyperparameters: tuple[dict[str, Any], ...]) -> RecordedWindow:
        """The window as the replay takes it."""
        return RecordedWindow(
            step=step,
            start_params=self.params,
            start_buffers=self.buffers,
            start_optimizer=self.optimizer,
            calls=tuple(self.calls),
            hyperparameters=hyperparameters,
            autocast=tuple(self.autocast),
            start_held=self.held,
            drew_random=self.drew_random,
        )


def detached(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.detach().clone()
    if isinstance(value, (list, tuple)):
        return type(value)(detached(item) for item in value)
    if isinstance(value, dict):
        return {key: detached(item) for key, item in value.items()}
    return value


def local_state(state: Any) -> Any:
    """An optimizer ``state_dict()`` with every DTensor replaced by this rank's shard of it."""
    if isinstance(state, Tensor):
        return local(state)
    if isinstance(state, dict):
        return {key: local_state(value) for key, value in state.items()}
    if isinstance(state, list):
        return [local_state(value) for value in state]
    return state


def first_not_finite(named: Iterable[tuple[str, Tensor | None]], what: str, *, step: int) -> str | None:
    """The first tensor of ``named`` holding a NaN or inf, named with its counts and first index, or None
    (of what this rank holds, in a sharded run)."""
    for name, tensor in named:
        if tensor is None or not tensor.is_floating_point():
            continue
        tensor = local(tensor)
        bad = torch.logical_not(torch.isfinite(tensor))
        if not bool(bad.any()):
            continue
        nans = int(torch.isnan(tensor).sum())
        infs = int(bad.sum()) - nans
        first = int(bad.flatten().to(torch.uint8).argmax())
        index = tuple(int(i) for i in torch.unravel_index(torch.tensor(first), tensor.shape)) if tensor.dim() else ()
        found = " and ".join(f"{n} {value}" for n, value in ((nans, "NaN"), (infs, "inf")) if n)
        return f"the {what} of '{name}' at step {step} is not finite ({found}), the first at index {index}"
    return None


def loss_target(args: tuple[Any, ...], kwargs: dict[str, Any], what: str) -> Tensor:
    """The target of a loss call ``loss(output, target)`` (or ``target=`` / ``targets=`` / ``labels=``)."""
    for keyword in ("target", "targets", "labels"):
        if isinstance(kwargs.get(keyword), Tensor):
            return kwargs[keyword]
    if len(args) >= 2 and isinstance(args[1], Tensor):
        return args[1]
    raise ValueError(
        f"the audit takes {what}'s target as its second positional argument or its target= keyword, "
        f"got {len(args)} positional arguments and keywords {sorted(kwargs)}"
    )


def functional_losses(loss: Any) -> frozenset[Callable[..., Tensor]]:
    """The ``torch.nn.functional`` losses whose calls compute ``loss`` (a shipped cross-entropy or MSE), else none."""
    families = {
        MSE: "mse",
        CrossEntropy: "cross_entropy",
        TokenCrossEntropy: "cross_entropy",
        NextTokenCrossEntropy: "cross_entropy",
    }
    family = families.get(type(loss))
    return frozenset(function for function, mapped in FUNCTIONAL.items() if family is not None and mapped == family)


class Replaying:
    """While any audit judges a window: its replay's loss calls are no audit's to record (another
    audit open on the same run included)."""

    now: ClassVar[int] = 0

    def __enter__(self) -> None:
        Replaying.now += 1

    def __exit__(self, *exc: object) -> None:
        Replaying.now -= 1


class FunctionalLossMode(TorchFunctionMode):
    """Sees the loop's ``F.cross_entropy(model(x), y)`` (or the ``F`` loss its ``loss=`` maps onto) while an
    audited window is open; every other function passes straight through."""

    def __init__(self, watcher: Watcher) -> None:
        super().__init__()
        self.audit, self.inert = watcher, False

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if not self.inert and func in self.audit._functional:
            _see_functional_eagerly(self.audit, func, args, kwargs)
        return func(*args, **kwargs)


@torch.compiler.disable  # type: ignore[misc,unused-ignore]
def _see_functional_eagerly(
    watcher: Watcher, func: Callable[..., Tensor], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    watcher._saw_functional(func, args, kwargs)


class WatchedForward:
    """The model's ``forward`` while an audit is open, set on the instance: ``model(x)`` (whose
    ``__call__`` looks ``forward`` up on the instance), ``model.forward(x)``, a ``torch.compile``d
    model and an Accelerate-prepared one (whose own instance ``forward`` it wraps) all pass
    through it, each call recorded once (a call inside one being recorded is not: a compiled
    module's call of its model).  Copies and pickles of the model made meanwhile get the forward it had.

    The record is made outside any ``torch.compile`` graph (a graph break where the model is
    compiled and called inside it); handed the compiled module itself, the audit records before
    its graph, so ``fullgraph=True`` holds."""

    def __init__(self, watcher: Watcher, module: nn.Module) -> None:
        self.audit, self.module, self.removed = watcher, module, False
        self.previous = module.__dict__.get("forward")
        self.inner = self.previous if self.previous is not None else module.forward
        with contextlib.suppress(TypeError, ValueError):  # what inspect.signature(model.forward) says stays true
            self.__signature__ = inspect.signature(self.inner)

    @classmethod
    def install(cls, watcher: Watcher, module: nn.Module) -> WatchedForward:
        watched = cls(watcher, module)
        module.forward = watched
        return watched

    def remove(self) -> None:
        """Off the model; under another audit's (closed in another order), a pass-through until that one goes."""
        self.removed = True
        if self.module.__dict__.get("forward") is self:
            restored = self.previous
            while isinstance(restored, WatchedForward) and restored.removed:
                restored = restored.previous
            if restored is None:
                del self.module.__dict__["forward"]
            else:
                self.module.forward = restored

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.removed or self.audit._depth:  # closed, or inside a call being recorded (a compiled module's own)
            return self.inner(*args, **kwargs)
        recorded = _record_eagerly(self.audit, args, kwargs)
        # A forward someone set on the instance before the audit (Accelerate's mixed precision) may enter an
        # autocast inside it: the call's autocast is read again at the first submodule call within.
        inside = (
            _probe_autocast_eagerly(self.audit)
            if recorded and self.previous is not None and self.module is self.audit.model
            else None
        )
        random = _generator_states_eagerly(self.module) if recorded else None
        self.audit._depth += 1
        try:
            output = self.inner(*args, **kwargs)
        finally:
            self.audit._depth -= 1
            if inside is not None:
                inside.remove()
        if recorded:
            _see_output_eagerly(self.audit, output)
            window = self.audit._window
            if random is not None and window is not None and _generators_moved(self.module, random):
                window.drew_random = True  # the replay asks whether those numbers reach the output
        return output

    def __reduce__(self) -> tuple[Any, ...]:
        return _unwatched, (self.module, self.previous)


def _unwatched(module: nn.Module, previous: Any) -> Any:
    """The forward a copy (or an unpickled model) gets: the one the model had before the audit."""
    return previous if previous is not None else types.MethodType(type(module).forward, module)


@torch.compiler.disable  # type: ignore[misc,unused-ignore]
def _generator_states_eagerly(module: nn.Module) -> tuple[Tensor, ...]:
    """torch's random generators' states (the CPU's, the module's CUDA device's), read outside any graph."""
    return generator_states(_device_of(module))


@torch.compiler.disable  # type: ignore[misc,unused-ignore]
def _generators_moved(module: nn.Module, before: tuple[Tensor, ...]) -> bool:
    """Whether a random number was drawn since ``before`` was read (a state advanced)."""
    return any(not torch.equal(a, b) for a, b in zip(before, generator_states(_device_of(module)), strict=True))


def _device_of(module: nn.Module) -> torch.device:
    param = next(module.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


@torch.compiler.disable  # type: ignore[misc,unused-ignore]
def _record_eagerly(watcher: Watcher, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Record outside any ``torch.compile`` graph (a graph break), so the copies are real."""
    return watcher._record_forward(args, kwargs)


@torch.compiler.disable  # type: ignore[misc,unused-ignore]
def _probe_autocast_eagerly(watcher: Watcher) -> RemovableHandle:
    """A global forward pre-hook, once: the autocast in force at the first submodule call inside the
    model's forward replaces the one read when its call was recorded."""

    def probe(module: nn.Module, args: Any) -> None:
        handle.remove()
        window = watcher._window
        if window is not None and window.autocast:
            window.autocast[-1] = autocast_of(watcher.model)

    handle = torch.nn.modules.module.register_module_forward_pre_hook(probe)
    return handle


@torch.compiler.disable  # type: ignore[misc,unused-ignore]
def _see_output_eagerly(watcher: Watcher, output: Any) -> None:
    watcher._saw_output(output)


#: torch's clip functions the audit watches: the keyword of the limit, the audit's setting that
#: replays it, and what a run does with it, in words.
CLIPS = {
    "clip_grad_norm_": (LIMIT_KEYWORDS["clip_grad_norm_"], "max_grad_norm", "clipped its gradients to "),
    "clip_grad_value_": (LIMIT_KEYWORDS["clip_grad_value_"], "max_grad_value", "clamped its gradients to ±"),
}


class ClipWatch:
    """Every ``torch.nn.utils.clip_grad_norm_`` and ``clip_grad_value_`` call made while an audit
    is open, told to the open audits (one wrapper however many audits are open: they may close in
    any order).  What a run clips to is then seen, not guessed.  So is a
    ``torch.amp.GradScaler.step`` that skips ``optimizer.step()`` (inf or NaN gradients): the
    audit counts it and starts its window again."""

    audits: ClassVar[list[Watcher]] = []
    #: the functions replaced, by where they live: ``torch.nn.utils`` and ``torch.nn.utils.clip_grad``
    originals: ClassVar[dict[str, Any]] = {}

    @classmethod
    def open(cls, audit: Watcher) -> None:
        if not cls.audits:
            ClipCalls.listen(ClipWatch.told)  # the clip functions, watched as equiv check's witness watches them
            cls.originals["GradScaler.step"] = torch.amp.GradScaler.step
            setattr(torch.amp.GradScaler, "step", cls.scaler_step)  # noqa: B010
        cls.audits.append(audit)

    @classmethod
    def close(cls, audit: Watcher) -> None:
        if audit in cls.audits:
            cls.audits.remove(audit)
        if not cls.audits and cls.originals:
            ClipCalls.stop(ClipWatch.told)
            setattr(torch.amp.GradScaler, "step", cls.originals.pop("GradScaler.step"))  # noqa: B010

    @staticmethod
    def told(name: str, parameters: list[Tensor], limit: float) -> None:
        """A clip call, told to every open audit."""
        for audit in ClipWatch.audits:
            audit._clipped(name, parameters, limit)

    @staticmethod
    def scaler_step(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        watching = [audit for audit in ClipWatch.audits if audit.optimizer is optimizer]
        stepped = {id(audit): audit.steps for audit in watching}
        for audit in watching:
            audit._in_scaler_step = True
        try:
            result = ClipWatch.originals["GradScaler.step"](scaler, optimizer, *args, **kwargs)
        finally:
            for audit in watching:
                audit._in_scaler_step = False
        for audit in ClipWatch.audits:
            if id(audit) in stepped and audit.steps == stepped[id(audit)]:
                audit._skipped()
        return result


def pop_mode(mode: FunctionalLossMode) -> None:
    """``mode`` taken off torch's function-mode stack, made inert; modes pushed above it since (the
    user's, another audit's) are put back as they were, so none is left behind however the audits close."""
    mode.inert = True
    stack = torch.overrides._get_current_function_mode_stack()
    if not any(entry is mode for entry in stack):
        return
    above = []
    while torch.overrides._get_current_function_mode() is not mode:
        above.append(torch.overrides._pop_mode())
    torch.overrides._pop_mode()
    for entry in reversed(above):
        torch.overrides._push_mode(entry)

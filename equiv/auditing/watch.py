"""Watch a real training run through hooks and audit sampled optimizer steps.

::

    with equiv.audit(model, optimizer, loss=equiv.NextTokenCrossEntropy(), every=50) as audit:
        train()                      # the user's loop, unmodified
    print(audit.summary())

What the hooks see (no adapter, no change to the loop):

* the model's ``forward``, wrapped on entering (restored on exit), records every
  training-mode call made with gradients enabled since the last optimizer step
  (detached copies of its arguments), for the windows that will be audited only:
  ``model(x)``, ``model.forward(x)``, a ``torch.compile``d model and an
  Accelerate-prepared one alike, each call once;
* when an audited window begins (on entering, and after each optimizer step)
  the model's weights and the optimizer's ``state_dict()`` are copied;
* an optimizer step pre-hook records the hyperparameters the step uses (so a
  scheduler's learning rate is the one replayed); the post-hook judges the
  update the user's code just applied against the full-batch step of the same
  window (:func:`equiv.auditing.replay.judge_window`), before the run goes on.

The reference loss is the user's named sum + count loss (``loss.sum(output,
targets)``, ``loss.count(targets)``: any :class:`equiv.Loss`), computed on what
the model's forward received: ``targets`` maps a recorded call to its targets
(by default the ``labels`` keyword, as transformers models take them, else the
second positional argument); ``output`` maps the model's output to what the
loss takes (by default ``.logits``, else the first element of a tuple, else the
output itself).  Targets that never reach ``forward`` (``criterion(model(x), y)``)
are seen where the loss sees them: ``criterion=`` hooks the ``nn.Module`` loss the
loop calls (its options read: label smoothing, class weights, ignore_index), :meth:`Audit.wrap`
wraps a loss function, and with a shipped ``loss`` the loop's own ``torch.nn.functional`` loss
call is seen by a ``TorchFunctionMode`` pushed for the audited windows only; each call's target
is paired with the model's call before it.  A target that does not fit the loss (a diffusion
model's timestep taken for it) is an error naming what was found, before any replay.

Cost: one copy of the model (the replay's template, made on entering); per
audited window its inputs, its start weights and optimizer state, and during
the replay one float64 model and optimizer plus one working-dtype replica at a
time; unaudited windows record nothing.

Scope: one process, or every rank of a multi-process run whose ranks each hold
the whole model (torchrun with DDP, or gradients reduced by the loop): each
rank enters the audit, records its own micro-batches, and the truth is the
global full-batch step of the window, computed across the ranks
(:mod:`equiv.auditing.ranks`).  A model sharded across the ranks (FSDP2,
tensor parallelism) is refused on entry, naming ``equiv.check_distributed``.
A ``torch.amp.GradScaler``
that skips a step (an overflow) calls no ``optimizer.step``: the audit sees
``scaler.step`` return without one, counts the step skipped (not judged) and
starts its window again; an optimizer that takes the scaler's ``found_inf``
itself (``fused=True``) is called and skips inside: the audit reads the
``found_inf`` the scaler hands it and counts that step skipped too."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import json
import math
import types
import warnings
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor, nn
from torch.optim.swa_utils import AveragedModel
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from equiv.auditing.averaged import ExponentialAverage, averaged_weights
from equiv.auditing.optimizers import audited_optimizer, closure_required
from equiv.auditing.ranks import Ranks, local, plain_copy, ranks_of_run, unwrapped
from equiv.auditing.replay import (
    AuditFailure,
    Call,
    RecordedWindow,
    WindowAudit,
    WindowReplay,
    inherent_advice,
    judge_window,
    model_at,
)
from equiv.auditing.schedules import Advance, ScheduleWatch, schedule_verdict
from equiv.judging.autocast import autocast_of as _autocast_of
from equiv.losses import (
    FUNCTIONAL,
    MSE,
    CrossEntropy,
    LossOptions,
    NextTokenCrossEntropy,
    TokenCrossEntropy,
    disagreement,
    loss_of,
    options_of_call,
    options_of_criterion,
)
from equiv.outcomes import Outcome
from equiv.results.protocol import ResultBase, headed

__all__ = ["Audit", "AuditFailure", "audit"]


def _detached(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.detach().clone()
    if isinstance(value, (list, tuple)):
        return type(value)(_detached(item) for item in value)
    if isinstance(value, dict):
        return {key: _detached(item) for key, item in value.items()}
    return value


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
        "to the targets tensor")


def _where_targets_were_found(call: Call) -> str:
    """Where :func:`default_targets` took a call's targets from, in words."""
    kwargs = call[1]
    keyword = next((k for k in TARGET_KEYWORDS if isinstance(kwargs.get(k), Tensor)), None)
    return f"the {keyword}= keyword of the model's call" if keyword else "the second positional argument of the model's call"


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
    raise ValueError(f"the audit cannot take a tensor from the model's output of type {type(output).__name__}: "
                     "pass output=lambda out: ...")


class Audit(ResultBase):
    """The audit of one run (see the module's docstring); use :func:`audit`.  A
    :class:`~equiv.results.protocol.Result`: truthy when every audited window
    was equivalent (and at least one was judged).  Every optimizer step is
    counted (:meth:`counts`): judged equivalent or not, or not judged and why
    (inherently not equivalent, a full-batch step that is not finite, not
    sampled by ``every``); an audit that judged nothing says why, and its
    :meth:`assert_ok` fails unless ``allow_nothing_judged``."""

    KIND = "audit"

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | Any, *, loss: Any = None, every: int = 1,
                 targets: Callable[[Call], Tensor] = default_targets,
                 output: Callable[[Any], Tensor] = default_output,
                 max_grad_norm: float | None = None, stop_at_first_failure: bool = False,
                 on_window: Callable[[WindowAudit], None] | None = None,
                 call_model: Callable[[nn.Module, Call], Any] = default_call, record_forward: bool = True,
                 allow_nothing_judged: bool = False, criterion: nn.Module | None = None,
                 max_grad_value: float | None = None,
                 averaged: AveragedModel | ExponentialAverage | None = None) -> None:
        #: what the loop calls, when the audit was handed a ``torch.compile``d module (watched too, outside its graph)
        self._compiled = model if _compiled_from(model) is not model else None
        model = unwrapped(_compiled_from(model))  # DDP's module: DDP's forward calls it, its calls are recorded
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        optimizer = audited_optimizer(optimizer)  # the torch optimizer inside Accelerate's / Lightning's wrapper
        refused = closure_required(optimizer)
        if refused is not None:
            raise ValueError(f"equiv.audit does not support optimizer {type(optimizer).__name__}: {refused}, so there "
                             "is no full-batch step to compare with (equiv check refuses it too)")
        if criterion is not None and not isinstance(criterion, nn.Module):
            raise TypeError(f"criterion must be a torch.nn.Module the loop calls as criterion(output, target), got "
                            f"{criterion!r}: for a loss function, call the one audit.wrap(loss_fn) returns")
        loss = _loss_with_criterion(loss, criterion)
        if not (hasattr(loss, "sum") and hasattr(loss, "count")):
            raise TypeError(f"loss must offer sum(output, targets) and count(targets) (an equiv.Loss such as "
                            f"equiv.NextTokenCrossEntropy()), got {loss!r}")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be a positive int (audit one window in every), got {every!r}")
        _refuse_a_foreign_optimizer(model, optimizer)
        #: the averaged copy of the weights the run keeps (an EMA, SWA), checked once per audited window
        self.averaged = averaged_weights(averaged, model)
        self.allow_nothing_judged = allow_nothing_judged
        self.model, self.optimizer, self.loss, self.every = model, optimizer, loss, every
        #: the clip the replay applies once per window (None: none; 0 and inf mean none too)
        self.max_grad_norm = clip_setting("max_grad_norm", max_grad_norm)
        self.max_grad_value = clip_setting("max_grad_value", max_grad_value)
        self.targets, self.output, self.criterion = targets, output, criterion
        self.stop_at_first_failure, self.on_window = stop_at_first_failure, on_window
        self.call_model, self.record_forward = call_model, record_forward
        #: every audited window's verdict, in order
        self.windows: list[WindowAudit] = []
        #: optimizer steps seen inside the audit
        self.steps = 0
        #: where the run is, as a trainer's callback (or the loop) sets it: "epoch 1, batch 6";
        #: each audited window keeps the value it had when its step was taken
        self.position: str | None = None
        #: what a trainer's callback read from the trainer's settings, one line (None: not started by one)
        self.read: str | None = None
        self._handles: list[RemovableHandle] = []
        self._watched: list[_WatchedForward] = []
        #: calls of watched forwards now running (a compiled module's call of its model is not recorded again)
        self._depth = 0
        self._template: nn.Module | None = None
        self._window: dict[str, Any] | None = None
        self._hyper: tuple[dict[str, Any], ...] = ()
        self._window_sizes: Counter[int] = Counter()
        #: training-mode forward calls the hook saw (to say why nothing was judged)
        self._forward_calls = 0
        #: steps a ``torch.amp.GradScaler`` skipped (inf or NaN gradients: no ``optimizer.step()``)
        self.skipped = 0
        self.ranks: Ranks | None = None
        #: inside ``GradScaler.step``; and whether the optimizer step now running skips itself (fused, found_inf)
        self._in_scaler_step = False
        self._skips_inside = False
        #: the optimizer step now running was called with a closure (its gradient is the closure's)
        self._closure_step = False
        #: the advances of the optimizer's LR schedule since the last optimizer step (equiv.auditing.schedules)
        self._advances: list[Advance] = []
        #: inside a criterion's or a wrapped loss's call: a functional loss called there is that one,
        #: recorded once (an audit's replay is kept out by ``_Judging``)
        self._in_loss = 0
        #: the torch.nn.functional losses whose targets are recorded (those ``loss`` maps onto; none with
        #: a criterion, which records its own), and the mode that sees them, on during audited windows only
        self._functional = _functional_losses(loss) if criterion is None else frozenset()
        self._mode: _FunctionalLosses | None = None

    # -- the hooks ---------------------------------------------------------

    def __enter__(self) -> Audit:
        #: the ranks of a multi-process run (None: one process), on a process group of the audit's own
        self.ranks = ranks_of_run(self.model)
        if self.averaged is not None and self.ranks is not None and self.ranks.sharded:
            raise ValueError("equiv.audit checks an averaged model (averaged=) in one process or under DDP; under "
                             "FSDP2 its replay would need the whole model on a rank: audit without averaged=, or "
                             "check the average in a DDP or single-process run of the same loop")
        self._template = plain_copy(self.model)  # before our hooks are on it; an FSDP2 model's whole
        self._handles = [
            self.optimizer.register_step_pre_hook(self._on_step_begin),
            self.optimizer.register_step_post_hook(self._on_step_end),
        ]
        if self.criterion is not None:
            self._handles.append(self.criterion.register_forward_pre_hook(self._on_criterion, with_kwargs=True))
            self._handles.append(self.criterion.register_forward_hook(self._after_criterion, always_call=True))
        if self.record_forward:
            called = [self.model] if self._compiled is None else [self.model, self._compiled]
            self._watched = [_WatchedForward.install(self, module) for module in called]
        _ClipWatch.open(self)
        ScheduleWatch.open(self)
        self._begin_window()
        return self

    def __exit__(self, *exc: object) -> None:
        self._functional_off()
        _ClipWatch.close(self)
        ScheduleWatch.close(self)
        for watched in self._watched:
            watched.remove()
        for handle in self._handles:
            handle.remove()
        self._handles, self._window, self._template, self._watched = [], None, None, []

    def _begin_window(self) -> None:
        """Copy what the next window starts from, if it will be audited."""
        self._advances = []  # the schedule's advances are counted per window, audited or not
        if self.steps % self.every:
            self._window = None
            self._functional_off()
            return
        self._window = {
            "params": {name: p.detach().clone() for name, p in self.model.named_parameters()},
            "buffers": {name: b.detach().clone() for name, b in self.model.named_buffers() if b.is_floating_point()},
            # an FSDP2 rank's state is DTensors: its own shards kept (its replica steps them)
            "optimizer": copy.deepcopy(_local_state(self.optimizer.state_dict())),
            "calls": [],
            "autocast": [],
            "clips": [],
            "outputs": [],  # per recorded forward call, (shape, dtype) of what the loss takes, when it could be read
            "seen_targets": [],  # the targets a criterion / wrapped loss received, one per its call
            "functional_targets": [],  # the targets of the loop's torch.nn.functional loss calls (no wrap)
        }
        self._functional_on()
        if self.averaged is not None and self.steps:  # after a step: its update of the average is yet to come
            self._window["averaged"] = self.averaged.capture()

    def _record_forward(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """A call of the model's forward: recorded when training with gradients (True then)."""
        if not (self.model.training and torch.is_grad_enabled()):
            return False
        self._forward_calls += 1  # counted to say what a run that never steps did
        if self._window is None:
            return False
        self.record(*args, **kwargs)
        return True

    def _saw_output(self, output: Any) -> None:
        """The output of the call just recorded: its shape and dtype, to check the targets fit the loss.
        With the user's own ``call_model`` the replay's loss takes what that returns, not this forward's
        output (a model computing its own loss returns losses): nothing read here, the replay says."""
        if self._window is None:
            return
        if self.call_model is not default_call:
            self._window["outputs"].append(None)
            return
        try:
            taken = self.output(output)
            spec: tuple[tuple[int, ...], torch.dtype] | None = (tuple(taken.shape), taken.dtype)
        except Exception:  # an output the mapping cannot read now is named at the replay
            spec = None
        self._window["outputs"].append(spec)

    def record(self, *args: Any, **kwargs: Any) -> None:
        """Record one micro-batch of the current window by hand, as ``call_model``
        will replay it (for trainers whose targets never reach ``forward``: a
        Lightning callback records each training batch)."""
        if self._window is not None:
            self._window["calls"].append((_detached(args), _detached(kwargs)))
            self._window["autocast"].append(_autocast_of(self.model))

    def _on_criterion(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self._in_loss += 1
        self._saw_target(_loss_target(args, kwargs, "criterion"))

    def _after_criterion(self, module: nn.Module, args: Any, output: Any) -> None:
        self._in_loss = max(0, self._in_loss - 1)

    # -- torch.nn.functional losses, seen without a wrap -----------------------

    def _functional_on(self) -> None:
        """The mode that sees the loop's functional loss calls, pushed for an audited window."""
        if self._functional and self._mode is None:
            self._mode = _FunctionalLosses(self)
            self._mode.__enter__()

    def _functional_off(self) -> None:
        """The mode taken off the stack; modes pushed above it since (the user's, another audit's)
        are put back as they were, so none is left behind however the audits close."""
        mode, self._mode = self._mode, None
        if mode is None:
            return
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

    def _saw_functional(self, function: Callable[..., Tensor], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """A ``torch.nn.functional`` loss the loop called on the model's output (not inside the model's
        forward, a criterion, a wrapped loss or the audit's judging; not a metric on a detached output):
        its options checked against ``loss`` and its target recorded, paired with the model's call before."""
        if self._depth or self._in_loss or self._window is None or _Judging.now:
            return
        if not (self.model.training and torch.is_grad_enabled()):
            return
        given = args[0] if args else kwargs.get("input")
        if not (isinstance(given, Tensor) and given.requires_grad):
            return
        options = options_of_call(function, args, kwargs)
        _agree(self.loss, options, "the loop's")
        self._window["functional_targets"].append(_loss_target(args, kwargs, options.written).detach().clone())

    def _saw_target(self, target: Tensor) -> None:
        if self._window is not None and self.model.training and torch.is_grad_enabled():
            self._window["seen_targets"].append(target.detach().clone())

    def wrap(self, loss_fn: Callable[..., Tensor]) -> Callable[..., Tensor]:
        """``loss_fn`` recording the target of each call, for the audit's replay: the loop calls
        ``audit.wrap(F.cross_entropy)(model(x), y)``; the targets (the second positional argument,
        or the ``target=`` / ``targets=`` / ``labels=`` keyword) are paired with the model's calls."""

        def recorded(*args: Any, **kwargs: Any) -> Tensor:
            self._saw_target(_loss_target(args, kwargs, getattr(loss_fn, "__name__", "the wrapped loss")))
            if loss_fn in FUNCTIONAL and self._window is not None:  # its options are the criterion's question
                _agree(self.loss, options_of_call(loss_fn, args, kwargs), "the wrapped")
            self._in_loss += 1  # the functional loss it calls is this one, recorded once
            try:
                return loss_fn(*args, **kwargs)
            finally:
                self._in_loss -= 1

        return recorded

    def _clipped(self, name: str, parameters: list[Tensor], limit: float) -> None:
        """A ``clip_grad_norm_`` / ``clip_grad_value_`` call on (some of) the audited model's parameters, in this window."""
        if clip_setting(name, limit) is None:  # clip_grad_norm_(..., inf): a norm measured, nothing clipped
            return
        own = {id(param) for param in self.model.parameters()}
        if self._window is not None and any(id(param) in own for param in parameters):
            self._window["clips"].append((name, limit))

    def _on_step_begin(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        # A fused optimizer stepped by a GradScaler is handed the scaler's found_inf and skips inside.
        found_inf = getattr(optimizer, "found_inf", None)
        self._skips_inside = (self._in_scaler_step and getattr(optimizer, "_step_supports_amp_scaling", False)
                              and isinstance(found_inf, Tensor) and bool(found_inf.item()))
        self._hyper = tuple({key: value for key, value in group.items() if key != "params"}
                            for group in optimizer.param_groups)
        # A step called with a closure (SGD.step(closure)) runs it inside the step: the forward calls it makes
        # join the window (recorded as any others), and the gradient the step takes is read after it.
        self._closure_step = bool(args and args[0] is not None) or kwargs.get("closure") is not None
        if self._window is not None and not self._closure_step:
            self._window["not_finite"] = self._gradient_not_finite(optimizer)

    def _gradient_not_finite(self, optimizer: torch.optim.Optimizer) -> str | None:
        """The gradient this step takes, named if it is not finite."""
        names = {id(param): name for name, param in self.model.named_parameters()}
        return _first_not_finite(
            ((names.get(id(p), "?"), p.grad) for group in optimizer.param_groups for p in group["params"]),
            "gradient", step=self.steps)

    def _on_step_end(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._skips_inside:  # no update: GradScaler.step's wrapper counts it skipped, as a skipped call
            self._skips_inside = False
            return
        self._functional_off()  # the replay's own loss calls are not the loop's (and run at full speed)
        window, step = self._window, self.steps
        if window is not None and self._closure_step:  # the closure's gradient (optimizers leave .grad as it is)
            window["not_finite"] = self._gradient_not_finite(optimizer)
        if window is not None:
            window["schedule"] = self._advances
        self.steps += 1
        try:
            if window is not None:
                with _Judging():
                    self._judge(window, step)
        finally:
            self._begin_window()

    def _judge(self, window: dict[str, Any], step: int) -> None:
        calls: list[Call] = window["calls"]
        if not calls:
            raise RuntimeError(
                f"optimizer step {step} of the audit saw no training-mode forward call of the audited model since "
                "the step before: is the model the audit watches the one the loop calls (not a copy of it), and in train mode "
                "with gradients enabled? (calls through model(...), model.forward(...), torch.compile and Accelerate "
                "are all recorded)")
        targets_of = self._targets_of(window, step)
        self._window_sizes[len(calls)] += 1
        usual = self._window_sizes.most_common(1)[0][0]
        recorded = RecordedWindow(step=step, start_params=window["params"], start_buffers=window["buffers"],
                                  start_optimizer=window["optimizer"], calls=tuple(calls), hyperparameters=self._hyper,
                                  autocast=tuple(window["autocast"]))
        assert self._template is not None
        replay = WindowReplay(template=self._template, model=self.model, optimizer=self.optimizer, loss=self.loss,
                              output_of=self.output, targets_of=targets_of, call_model=self.call_model,
                              max_grad_norm=self.max_grad_norm, max_grad_value=self.max_grad_value,
                              ranks=self.ranks)
        verdict = judge_window(recorded, replay, usual_micro_batches=usual)
        verdict = dataclasses.replace(verdict, position=self.position,
                                      hint=_clipping_hint(self, window) if verdict.mismatches else verdict.hint)
        schedule, note = schedule_verdict(window.get("schedule", []))
        if schedule is not None or note is not None:
            verdict = dataclasses.replace(verdict, schedule=schedule, note=note)
        if "averaged" in window and verdict.judged:
            verdict = self._judge_averaged(verdict, window["averaged"], recorded)
        verdict = self._finite(verdict, window.get("not_finite"))
        self.windows.append(verdict)
        if self.on_window is not None:
            self.on_window(verdict)
        if self.stop_at_first_failure and verdict.status is Outcome.NOT_EQUIVALENT:
            raise AuditFailure(verdict)

    def _judge_averaged(self, verdict: WindowAudit, start: dict[str, Tensor], recorded: RecordedWindow) -> WindowAudit:
        """``verdict`` with the averaged model's rows: moved once, by its rule, towards the window-start weights."""
        assert self.averaged is not None and self._template is not None
        template = self._template
        rows, moved = self.averaged.judge(start, lambda dtype: model_at(template, recorded, dtype))
        worst = max([*rows, *([verdict.worst] if verdict.worst is not None else [])], key=lambda row: row.ratio,
                    default=None)
        failing = tuple(row for row in rows if not row.ok)
        hint = "; ".join(part for part in (verdict.hint, moved) if part) or None
        return dataclasses.replace(verdict, mismatches=(*verdict.mismatches, *failing), worst=worst, hint=hint)

    def _finite(self, verdict: WindowAudit, gradient: str | None) -> WindowAudit:
        """``verdict`` with a NaN or inf named: the run's gradient (``gradient``, seen before the
        step), else its parameters or optimizer state after it; when the run's are finite and
        the engine's rows still hold a non-finite value, the full-batch step's own."""
        step = verdict.step
        named = gradient or _first_not_finite(self.model.named_parameters(), "parameter after the step", step=step)
        if named is None:
            names = {id(param): name for name, param in self.model.named_parameters()}
            named = _first_not_finite(
                ((f"{names.get(id(param), '?')}'s {key}", value) for param, values in self.optimizer.state.items()
                 for key, value in values.items() if isinstance(value, Tensor)), "optimizer state", step=step)
        if named is not None:
            return dataclasses.replace(verdict, not_finite=named)
        rows = [*verdict.mismatches, *([verdict.worst] if verdict.worst is not None else [])]
        full_batch = next((row for row in rows if row.nan_count or row.inf_count or not math.isfinite(row.allowed)),
                          None)
        if full_batch is None:
            return verdict
        where = f", first at index {full_batch.first_not_finite}" if full_batch.first_not_finite else ""
        text = (f"{full_batch.label} of the full-batch step is not finite{where}, while the run's step "
                f"(step {step}) is: the window's own data makes the loss over its {sum(verdict.items)} items not finite "
                "(NaN or inf inputs or targets, or no item to count); not judged")
        return dataclasses.replace(verdict, not_finite=text, full_batch_not_finite=True, mismatches=())

    def _schedule_advanced(self, advance: Advance) -> None:
        """A scheduler of this audit's optimizer advanced its schedule (counted for the window now open)."""
        self._advances.append(advance)

    def _skipped(self) -> None:
        """A GradScaler skipped the step (inf or NaN gradients): the micro-batches recorded
        since the last step took no step, and the next window starts again from here."""
        self.skipped += 1
        self._begin_window()

    def _targets_of(self, window: dict[str, Any], step: int) -> Callable[[Call], Tensor]:
        """How the window's calls map to their targets: what a criterion / wrapped loss received
        (one per call, in order), else ``targets``; checked against the loss before any replay."""
        calls: list[Call] = window["calls"]
        seen: list[Tensor] = window["seen_targets"]
        functional: list[Tensor] = window.get("functional_targets", [])
        received = "the target the criterion (or wrapped loss) received"
        outputs: list[Any] = window["outputs"]
        # The loop's functional loss calls fill in where the forward calls carry no targets that fit
        # (model(x), a diffusion model's timestep): a forward's own labels= stay what they were.
        if not seen and functional and self.targets is default_targets and not _defaults_fit(self.loss, calls, outputs):
            names = sorted(f"F.{function.__name__}" for function in self._functional)
            seen = _functional_pairing(functional, calls, step, names)
            received = f"the target the loop's {' / '.join(names)} received"
        if seen and len(seen) != len(calls):
            raise ValueError(
                f"optimizer step {step} of the audit: the criterion (or wrapped loss) was called {len(seen)} times for "
                f"{len(calls)} forward call{'s' if len(calls) != 1 else ''} of the model in the window; the audit pairs "
                "one loss call with each forward call. Pass targets=lambda call: ... instead, or record each "
                "micro-batch with Audit.record (record_forward=False)")
        targets_of, where = self.targets, ("targets=" if self.targets is not default_targets else "")
        if seen:
            by_call = {id(call): target for call, target in zip(calls, seen, strict=True)}

            def seen_target(call: Call) -> Tensor:
                return by_call[id(call)]

            targets_of, where = seen_target, received
        checked: set[Any] = set()
        for call, output in zip(calls, outputs, strict=False):
            target = _target_or_none(targets_of, call)
            if output is None or target is None or (output, target.shape, target.dtype) in checked:
                continue
            checked.add((output, target.shape, target.dtype))
            _check_fits(self.loss, output, target, where or _where_targets_were_found(call))
        return targets_of

    # -- the outcome -------------------------------------------------------

    @property
    def failures(self) -> list[WindowAudit]:
        """The audited windows whose step is not the full-batch one (or is not finite)."""
        return [window for window in self.windows if window.status is Outcome.NOT_EQUIVALENT]

    def counts(self) -> dict[str, int]:
        """Every optimizer step of the audit, counted once: judged (``equivalent``,
        ``not_equivalent``) or not judged (``inherent``: not replayed; ``full_batch_not_finite``;
        ``not_sampled``: between the windows ``every`` audits); ``skipped``: steps a GradScaler
        skipped (no ``optimizer.step()``, so not among the optimizer steps)."""
        statuses = Counter(window.status for window in self.windows)
        return {"equivalent": statuses[Outcome.EQUIVALENT], "not_equivalent": statuses[Outcome.NOT_EQUIVALENT],
                "inherent": statuses[Outcome.INHERENTLY_NON_EQUIVALENT],
                "full_batch_not_finite": statuses[Outcome.NOT_APPLICABLE],
                "not_sampled": self.steps - len(self.windows), "skipped": self.skipped}

    @property
    def judged(self) -> int:
        """Windows judged (equivalent or not)."""
        counts = self.counts()
        return counts["equivalent"] + counts["not_equivalent"]

    def nothing_judged(self) -> str | None:
        """Why no window was judged, in words, or None when one was."""
        if self.judged:
            return None
        if not self.steps:
            if self.skipped:
                return (f"the GradScaler skipped every step ({self.skipped}): the gradients were inf or NaN each "
                        "time, so no optimizer step was taken")
            if self._forward_calls:
                return (f"the model made {self._forward_calls} training-mode forward call"
                        f"{'s' if self._forward_calls != 1 else ''} but optimizer.step() was never called inside "
                        "the audit (is the optimizer the one the loop steps, or does a GradScaler skip every step?)")
            return ("no optimizer step was taken inside the audit and the model made no training-mode forward call "
                    "(an empty loader, the loop outside the with block, or the model in eval mode?)")
        counts = self.counts()
        if counts["inherent"]:
            return f"every audited window is inherently not equivalent (not replayed); {inherent_advice(self.model)}"
        if counts["full_batch_not_finite"]:
            return "the full-batch step of every audited window is not finite (the windows' own data)"
        return f"no window sampled (every {self.every}, {self.steps} steps)"

    def __bool__(self) -> bool:
        """Every audited window equivalent (none inherently not, none failing), and at least one."""
        return bool(self.windows) and all(window.equivalent for window in self.windows)

    @property
    def status(self) -> Outcome:
        """NOT_EQUIVALENT when a window failed, else INHERENTLY_NON_EQUIVALENT when one
        could not be replayed, NOT_APPLICABLE when one was not judged otherwise (none
        audited, a full-batch step not finite), else EQUIVALENT."""
        if self.failures:
            return Outcome.NOT_EQUIVALENT
        if any(window.inherent for window in self.windows):
            return Outcome.INHERENTLY_NON_EQUIVALENT
        return Outcome.EQUIVALENT if self else Outcome.NOT_APPLICABLE

    def assert_ok(self) -> None:
        """Raise unless every audited window was equivalent and one was judged; with
        ``allow_nothing_judged``, an audit that judged nothing and flagged nothing passes."""
        __tracebackhide__ = True
        if self.allow_nothing_judged and not self.judged and not self.failures:
            return
        super().assert_ok()

    def message(self) -> str:
        return self.summary()

    def _counted(self) -> str:
        counts = self.counts()
        not_judged = [f"{counts['inherent']} inherently not equivalent (not replayed)" if counts["inherent"] else "",
                      f"{counts['full_batch_not_finite']} whose full-batch step is not finite"
                      if counts["full_batch_not_finite"] else "",
                      f"{counts['not_sampled']} not sampled" if counts["not_sampled"] else ""]
        reasons = ", ".join(part for part in not_judged if part)
        text = (f"{len(self.windows)} of {self.steps} optimizer steps audited (every {self.every}): {self.judged} "
                f"judged ({counts['equivalent']} equivalent, {counts['not_equivalent']} not equivalent), "
                f"{self.steps - self.judged} not judged" + (f" ({reasons})" if reasons else ""))
        if self.skipped:
            text += (f"; {self.skipped} step{' was' if self.skipped == 1 else 's were'} skipped by the GradScaler "
                     "(inf or NaN gradients, no update: not judged)")
        why = self.nothing_judged()
        return text + (f"; nothing judged: {why}" if why else "")

    def line(self) -> str:
        """One line: the outcome, every step counted, why nothing was judged, the first that failed."""
        first = self.failures[0].line() if self.failures else None
        return headed(self.status, self._counted() + (f"; first: {first}" if first else ""))

    def _failure(self) -> AssertionError:
        return AuditFailure(self.failures[0]) if self.failures else super()._failure()

    def _fields(self) -> dict[str, Any]:
        counts = self.counts()
        return {"steps": self.steps, "every": self.every, "audited": len(self.windows),
                "failures": len(self.failures), "judged": self.judged, "inherent": counts["inherent"],
                "full_batch_not_finite": counts["full_batch_not_finite"], "not_sampled": counts["not_sampled"],
                "skipped": self.skipped,
                "nothing_judged": self.nothing_judged(), "windows": [window.to_dict() for window in self.windows]}

    def summary(self) -> str:
        """Every step counted, then every audited window, one line each."""
        return "\n".join([f"equiv audit: {self._counted()}", *(f"  {window.line()}" for window in self.windows)])

    def write_jsonl(self, path: str | Path) -> Path:
        """Write each audited window's ``to_dict()`` (the schema's ``window_audit``) as one JSON line
        of ``path`` (replaced); returns the path.  :func:`equiv.auditing.writers.jsonl_writer` appends
        them as they come."""
        path = Path(path)
        with path.open("w", encoding="utf-8") as out:
            for window in self.windows:
                out.write(json.dumps(window.to_dict()) + "\n")
        return path


def _local_state(state: Any) -> Any:
    """An optimizer ``state_dict()`` with every DTensor replaced by this rank's shard of it."""
    if isinstance(state, Tensor):
        return local(state)
    if isinstance(state, dict):
        return {key: _local_state(value) for key, value in state.items()}
    if isinstance(state, list):
        return [_local_state(value) for value in state]
    return state


def _first_not_finite(named: Iterable[tuple[str, Tensor | None]], what: str, *, step: int) -> str | None:
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
        found = " and ".join(f"{n} {kind}" for n, kind in ((nans, "NaN"), (infs, "inf")) if n)
        return f"the {what} of '{name}' at step {step} is not finite ({found}), the first at index {index}"
    return None


def _refuse_a_foreign_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """The optimizer must step the model's own parameters (some of them: frozen ones are fine)."""
    own = {id(param) for param in model.parameters()}
    foreign = [param for group in optimizer.param_groups for param in group["params"] if id(param) not in own]
    if foreign:
        raise ValueError(
            f"the optimizer holds {len(foreign)} parameter tensor{'s' if len(foreign) != 1 else ''} that "
            f"{'are' if len(foreign) != 1 else 'is'} not the model's parameters (first: shape "
            f"{tuple(foreign[0].shape)}; the model, a {type(model).__name__}, has {len(own)} parameter tensors): "
            "build the optimizer from model.parameters() of the model the audit watches")


def clip_setting(name: str, value: float | None) -> float | None:
    """A clip setting as the replay applies it: None for no clipping (None, 0 or inf, as the
    trainers mean them), else the positive float; anything else refused, naming the value."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or value < 0:
        raise ValueError(f"{name} must be a positive number, or None / 0 / inf for no clipping, got {value!r}")
    return None if value == 0 or math.isinf(value) else float(value)


def _compiled_from(model: Any) -> Any:
    """The module a ``torch.compile``d one runs (its parameters are the optimizer's, by their own names)."""
    original = getattr(model, "_orig_mod", None)
    return original if isinstance(model, nn.Module) and isinstance(original, nn.Module) else model


def _loss_target(args: tuple[Any, ...], kwargs: dict[str, Any], what: str) -> Tensor:
    """The target of a loss call ``loss(output, target)`` (or ``target=`` / ``targets=`` / ``labels=``)."""
    for keyword in ("target", "targets", "labels"):
        if isinstance(kwargs.get(keyword), Tensor):
            return kwargs[keyword]
    if len(args) >= 2 and isinstance(args[1], Tensor):
        return args[1]
    raise ValueError(f"the audit takes {what}'s target as its second positional argument or its target= keyword, "
                     f"got {len(args)} positional arguments and keywords {sorted(kwargs)}")


def _loss_with_criterion(loss: Any, criterion: nn.Module | None) -> Any:
    """The loss the audit judges by: ``loss``, checked against what ``criterion`` computes (its
    options read: label smoothing, class weights, ignore_index), or derived from the criterion
    when ``loss`` is not given; a disagreement, or a criterion equiv cannot express, one line."""
    options = options_of_criterion(criterion) if criterion is not None else None
    if loss is None:
        if criterion is None:
            raise TypeError("equiv.audit needs loss= (an equiv.Loss such as equiv.CrossEntropy()) or criterion= (the "
                            "nn.Module loss the loop calls, whose loss the audit derives)")
        if options is None:
            raise ValueError(f"criterion={type(criterion).__name__}() is not one of torch's losses the audit can read; "
                             "pass loss=<an equiv.Loss offering sum(output, targets) and count(targets)>")
        return loss_of(options)
    if options is not None:
        _agree(loss, options, "criterion=")
    return loss


def _agree(loss: Any, options: LossOptions, whose: str) -> None:
    """Refuse a run whose own loss computes another objective than ``loss`` (a correct run would be flagged)."""
    differ = disagreement(loss, options)
    if differ is not None:
        written = f"criterion={options.written}" if whose == "criterion=" else f"{whose} {options.written}"
        raise ValueError(
            f"loss={loss!r} and {written} disagree ({differ}): the audit would judge the run by another objective "
            "than the one it trains; pass the loss= that matches (equiv.CrossEntropy / TokenCrossEntropy take "
            "weight=, ignore_index=, label_smoothing=), or, with criterion=, leave loss= out to derive it")


def _functional_losses(loss: Any) -> frozenset[Callable[..., Tensor]]:
    """The ``torch.nn.functional`` losses whose calls compute ``loss`` (a shipped cross-entropy or MSE), else none."""
    kinds = {MSE: "mse", CrossEntropy: "cross_entropy", TokenCrossEntropy: "cross_entropy",
             NextTokenCrossEntropy: "cross_entropy"}
    kind = kinds.get(type(loss))
    return frozenset(function for function, mapped in FUNCTIONAL.items() if kind is not None and mapped == kind)


class _Judging:
    """While any audit judges a window: its replay's loss calls are no audit's to record (another
    audit open on the same run included)."""

    now: ClassVar[int] = 0

    def __enter__(self) -> None:
        _Judging.now += 1

    def __exit__(self, *exc: object) -> None:
        _Judging.now -= 1


class _FunctionalLosses(TorchFunctionMode):
    """Sees the loop's ``F.cross_entropy(model(x), y)`` (or the ``F`` loss its ``loss=`` maps onto) while an
    audited window is open; every other function passes straight through."""

    def __init__(self, watcher: Audit) -> None:
        super().__init__()
        self.audit, self.inert = watcher, False

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if not self.inert and func in self.audit._functional:
            _see_functional_eagerly(self.audit, func, args, kwargs)
        return func(*args, **kwargs)


@torch.compiler.disable  # type: ignore[misc,unused-ignore]
def _see_functional_eagerly(watcher: Audit, func: Callable[..., Tensor], args: tuple[Any, ...],
                            kwargs: dict[str, Any]) -> None:
    watcher._saw_functional(func, args, kwargs)


def _functional_pairing(functional: list[Tensor], calls: list[Call], step: int, names: list[str]) -> list[Tensor]:
    """The functional loss calls' targets, one per forward call, or one line saying what was seen."""
    if len(functional) == len(calls):
        return functional
    raise ValueError(
        f"optimizer step {step} of the audit: the loop called {' / '.join(names)} {len(functional)} time"
        f"{'s' if len(functional) != 1 else ''} with gradients for {len(calls)} forward call"
        f"{'s' if len(calls) != 1 else ''} of the model in the window; the audit pairs one loss call with each "
        "forward call: call the training loss through audit.wrap(loss_fn), or pass targets=lambda call: ...")


def _defaults_fit(loss: Any, calls: list[Call], outputs: list[Any]) -> bool:
    """Every forward call carries targets (a ``labels=`` keyword, a second positional tensor) that fit ``loss``."""
    targets = [_target_or_none(default_targets, call) for call in calls]
    if any(target is None for target in targets):
        return False
    for target, output in zip(targets, outputs, strict=False):
        if output is not None and target is not None:
            try:
                _check_fits(loss, output, target, "")
            except ValueError:
                return False
    return True


def _target_or_none(targets_of: Callable[[Call], Tensor], call: Call) -> Tensor | None:
    try:
        return targets_of(call)
    except (ValueError, KeyError, IndexError, TypeError):  # named where the replay asks for them
        return None


def _described(shape: tuple[int, ...], dtype: torch.dtype) -> str:
    return f"shape {tuple(shape)} {str(dtype).removeprefix('torch.')}"


#: Outputs up to this many elements are probed with real zeros, larger ones on the meta device.
_PROBE_ELEMENTS = 1 << 22


def _check_fits(loss: Any, output: tuple[tuple[int, ...], torch.dtype], target: Tensor, where: str) -> None:
    """The loss takes an output of the recorded call's shape and dtype with ``target``, or a
    clear error saying what was found and how to tell the audit (never a crash in the replay)."""
    shape, dtype = output
    # Zeros of the output's shape on the CPU (a value out of range is caught: a class index), or on the
    # meta device past a size (a large vocabulary's logits: shapes only); in float32 as the replay
    # lifts a half-precision output, and a loss's warning (a broadcast target) taken as a failure.
    device = "cpu" if math.prod(shape) <= _PROBE_ELEMENTS else "meta"
    probe = torch.zeros(shape, dtype=torch.float32 if dtype.is_floating_point else dtype, device=device)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            loss.sum(probe, target.detach().to(device))
            loss.count(target.detach())
    except NotImplementedError:  # the meta device cannot run this loss: the shapes go unchecked
        return
    except Exception as error:  # any failure of the loss on these is the same mistake
        raise ValueError(
            f"the targets the audit took ({where}: a tensor of {_described(tuple(target.shape), target.dtype)}) do "
            f"not fit the loss: {loss!r} on the model's output of {_described(shape, dtype)} raised "
            f"{type(error).__name__}: {str(error).rstrip('.')}. Tell the audit where the targets are: criterion=<the nn.Module loss "
            "the loop calls>, audit.wrap(loss_fn) for a loss function, targets=lambda call: ... (call = (args, "
            "kwargs) of the model's forward), or record each micro-batch with Audit.record (record_forward=False)"
        ) from error


class _WatchedForward:
    """The model's ``forward`` while an audit is open, set on the instance: ``model(x)`` (whose
    ``__call__`` looks ``forward`` up on the instance), ``model.forward(x)``, a ``torch.compile``d
    model and an Accelerate-prepared one (whose own instance ``forward`` it wraps) all pass
    through it, each call recorded once (a call inside one being recorded is not: a compiled
    module's call of its model).  Copies and pickles of the model made meanwhile get the forward it had.

    The record is made outside any ``torch.compile`` graph (a graph break where the model is
    compiled and called inside it); handed the compiled module itself, the audit records before
    its graph, so ``fullgraph=True`` holds."""

    def __init__(self, watcher: Audit, module: nn.Module) -> None:
        self.audit, self.module, self.removed = watcher, module, False
        self.previous = module.__dict__.get("forward")
        self.inner = self.previous if self.previous is not None else module.forward
        with contextlib.suppress(TypeError, ValueError):  # what inspect.signature(model.forward) says stays true
            self.__signature__ = inspect.signature(self.inner)

    @classmethod
    def install(cls, watcher: Audit, module: nn.Module) -> _WatchedForward:
        watched = cls(watcher, module)
        module.forward = watched
        return watched

    def remove(self) -> None:
        """Off the model; under another audit's (closed in another order), a pass-through until that one goes."""
        self.removed = True
        if self.module.__dict__.get("forward") is self:
            restored = self.previous
            while isinstance(restored, _WatchedForward) and restored.removed:
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
        inside = (_probe_autocast_eagerly(self.audit)
                  if recorded and self.previous is not None and self.module is self.audit.model else None)
        self.audit._depth += 1
        try:
            output = self.inner(*args, **kwargs)
        finally:
            self.audit._depth -= 1
            if inside is not None:
                inside.remove()
        if recorded:
            _see_output_eagerly(self.audit, output)
        return output

    def __reduce__(self) -> tuple[Any, ...]:
        return _unwatched, (self.module, self.previous)


def _unwatched(module: nn.Module, previous: Any) -> Any:
    """The forward a copy (or an unpickled model) gets: the one the model had before the audit."""
    return previous if previous is not None else types.MethodType(type(module).forward, module)


@torch.compiler.disable  # type: ignore[misc,unused-ignore]
def _record_eagerly(watcher: Audit, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Record outside any ``torch.compile`` graph (a graph break), so the copies are real."""
    return watcher._record_forward(args, kwargs)


@torch.compiler.disable  # type: ignore[misc,unused-ignore]
def _probe_autocast_eagerly(watcher: Audit) -> RemovableHandle:
    """A global forward pre-hook, once: the autocast in force at the first submodule call inside the
    model's forward replaces the one read when its call was recorded."""
    def probe(module: nn.Module, args: Any) -> None:
        handle.remove()
        if watcher._window is not None and watcher._window["autocast"]:
            watcher._window["autocast"][-1] = _autocast_of(watcher.model)

    handle = torch.nn.modules.module.register_module_forward_pre_hook(probe)
    return handle


@torch.compiler.disable  # type: ignore[misc,unused-ignore]
def _see_output_eagerly(watcher: Audit, output: Any) -> None:
    watcher._saw_output(output)


#: torch's clip functions the audit watches: the keyword of the limit, the audit's setting that
#: replays it, and what a run does with it, in words.
_CLIPS = {"clip_grad_norm_": ("max_norm", "max_grad_norm", "clipped its gradients to "),
          "clip_grad_value_": ("clip_value", "max_grad_value", "clamped its gradients to ±")}


class _ClipWatch:
    """Every ``torch.nn.utils.clip_grad_norm_`` and ``clip_grad_value_`` call made while an audit
    is open, told to the open audits (one wrapper however many audits are open: they may close in
    any order).  What a run clips to is then seen, not guessed.  So is a
    ``torch.amp.GradScaler.step`` that skips ``optimizer.step()`` (inf or NaN gradients): the
    audit counts it and starts its window again."""

    audits: ClassVar[list[Audit]] = []
    #: the functions replaced, by where they live: ``torch.nn.utils`` and ``torch.nn.utils.clip_grad``
    originals: ClassVar[dict[str, Any]] = {}

    @classmethod
    def open(cls, audit: Audit) -> None:
        if not cls.audits:
            for module in (torch.nn.utils, torch.nn.utils.clip_grad):
                for name in _CLIPS:
                    cls.originals[f"{module.__name__}.{name}"] = getattr(module, name)
                    setattr(module, name, cls.watching(name))
            cls.originals["GradScaler.step"] = torch.amp.GradScaler.step
            setattr(torch.amp.GradScaler, "step", cls.scaler_step)  # noqa: B010
        cls.audits.append(audit)

    @classmethod
    def close(cls, audit: Audit) -> None:
        if audit in cls.audits:
            cls.audits.remove(audit)
        if not cls.audits and cls.originals:
            for module in (torch.nn.utils, torch.nn.utils.clip_grad):
                for name in _CLIPS:
                    setattr(module, name, cls.originals.pop(f"{module.__name__}.{name}"))
            setattr(torch.amp.GradScaler, "step", cls.originals.pop("GradScaler.step"))  # noqa: B010

    @staticmethod
    def watching(name: str) -> Callable[..., Any]:
        keyword = _CLIPS[name][0]

        def clip(parameters: Any, *args: Any, **kwargs: Any) -> Any:
            parameters = [parameters] if isinstance(parameters, Tensor) else list(parameters)
            limit = args[0] if args else kwargs.get(keyword)
            if limit is not None and limit == limit and limit >= 0:  # what torch refuses is torch's to say
                for audit in _ClipWatch.audits:
                    audit._clipped(name, parameters, float(limit))
            return _ClipWatch.originals[f"torch.nn.utils.clip_grad.{name}"](parameters, *args, **kwargs)

        clip.__name__ = clip.__qualname__ = name
        return clip

    @staticmethod
    def scaler_step(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        watching = [audit for audit in _ClipWatch.audits if audit.optimizer is optimizer]
        stepped = {id(audit): audit.steps for audit in watching}
        for audit in watching:
            audit._in_scaler_step = True
        try:
            result = _ClipWatch.originals["GradScaler.step"](scaler, optimizer, *args, **kwargs)
        finally:
            for audit in watching:
                audit._in_scaler_step = False
        for audit in _ClipWatch.audits:
            if id(audit) in stepped and audit.steps == stepped[id(audit)]:
                audit._skipped()
        return result


def _clipping_hint(audit: Audit, window: dict[str, Any]) -> str | None:
    """What a failing window's run clipped to when the audit was not told (``max_grad_norm``,
    ``max_grad_value``): the clip calls it saw in the window, and the setting that replays them."""
    hints = []
    for name, (_, setting, did) in _CLIPS.items():
        limits = [limit for seen, limit in window.get("clips", []) if seen == name]
        if not limits or getattr(audit, setting) is not None:
            continue
        values = sorted(set(limits))
        calls = f"{len(limits)} {name} call{'s' if len(limits) != 1 else ''} in the window"
        if len(values) == 1:
            hints.append(f"the run {did}{values[0]:g} ({calls}) and the audit was not told: audit with "
                         f"{setting}={values[0]:g}")
        else:
            hints.append(f"the run {did}{', '.join(f'{v:g}' for v in values)} ({calls}); the audit was not told")
    return "; ".join(hints) or None


def audit(model: nn.Module, optimizer: torch.optim.Optimizer | Any, *, loss: Any = None, every: int = 1,
          targets: Callable[[Call], Tensor] = default_targets, output: Callable[[Any], Tensor] = default_output,
          max_grad_norm: float | None = None, stop_at_first_failure: bool = False,
          on_window: Callable[[WindowAudit], None] | None = None,
          call_model: Callable[[nn.Module, Call], Any] = default_call, record_forward: bool = True,
          allow_nothing_judged: bool = False, criterion: nn.Module | None = None,
          max_grad_value: float | None = None, averaged: AveragedModel | ExponentialAverage | None = None) -> Audit:
    """Audit the optimizer steps of the run made inside ``with`` (see :mod:`equiv.auditing.watch`).

    Args:
        model, optimizer: the run's own (the optimizer must hold the model's parameters); a
            ``torch.compile``d model or an Accelerate-prepared one is watched as itself, and calls
            through ``model(...)`` and ``model.forward(...)`` are both recorded.  The optimizer may be
            the wrapper the loop holds (Accelerate's ``AcceleratedOptimizer``, Lightning's
            ``LightningOptimizer``, any object keeping it as ``.optimizer``): the torch optimizer
            inside is hooked, said once in a ``UserWarning``.  One whose ``step`` needs a closure
            (``LBFGS``) is refused; a step given an optional closure (``SGD.step(closure)``) is judged
            on every micro-batch of its window, the closure's included.  The optimizer's LR schedulers
            are followed (:mod:`equiv.auditing.schedules`): one stepped more than once in a window,
            changing the learning rate the step took, fails it (``WindowAudit.schedule``); changing
            nothing, it is said in the window's ``note``.
        loss: the objective the run means, as a sum + count loss (``equiv.NextTokenCrossEntropy()``
            for a causal LM's ``labels``, ``equiv.CrossEntropy()`` for classification, ``equiv.MSE()``;
            ``CrossEntropy`` / ``TokenCrossEntropy`` take torch's ``weight=``, ``ignore_index=`` and
            ``label_smoothing=``: with class weights an item counts its class's weight, as torch's
            weighted mean divides). Left out with ``criterion=`` given, it is derived from the criterion.
            A shipped cross-entropy or MSE also has the loop's own ``F.cross_entropy`` /
            ``F.nll_loss`` / ``F.mse_loss`` call seen during audited windows (its targets recorded, its
            options read as a criterion's), so ``loss = F.cross_entropy(model(x), y)`` needs no wrap.
        every: audit one optimizer step in every ``every`` (the first one included).
        targets, output: read a recorded call's targets and the model's output the loss takes (by
            default the ``labels`` / ``targets`` / ``target`` keyword, else the second positional
            argument; a guess that does not fit ``loss`` is an error naming the shapes found).
        criterion: the ``nn.Module`` loss the loop calls as ``criterion(output, target)``
            (``loss = criterion(model(x), y)``): its targets are recorded where it sees them, each
            paired with the model's call before it, with no change to the loop. Its options are read
            (``label_smoothing``, ``weight``, ``ignore_index`` of ``CrossEntropyLoss`` / ``NLLLoss``;
            ``MSELoss``; ``reduction`` is how the loop reduces, not the objective): a ``loss=`` that
            disagrees is one line naming both, a torch loss equiv ships nothing for (``L1Loss``,
            ``BCEWithLogitsLoss``) is refused by name unless ``loss=`` says what it computes. For a
            loss function, ``audit.wrap(loss_fn)`` (:meth:`Audit.wrap`) records its targets too.
        max_grad_norm: the norm the run clips to, once per step (None, 0 or inf: it does not clip).
        max_grad_value: the value the run clamps each gradient element to (``clip_grad_value_``), once
            per step (None, 0 or inf: it does not).
        stop_at_first_failure: raise :class:`AuditFailure` from the step that is not equivalent.
        on_window: called with each audited window's verdict as it is made.
        call_model, record_forward: each recorded micro-batch is replayed as ``call_model(model,
            (args, kwargs))`` (a model whose forward computes its own loss: ``call_model`` hands the loss
            the logits; the targets are then checked on what ``call_model`` / ``output`` return, never on
            the run's own forward output); with ``record_forward=False``, micro-batches are recorded with
            :meth:`Audit.record` instead of by the watched ``forward``.
        averaged: the averaged copy of the weights the run keeps: a
            ``torch.optim.swa_utils.AveragedModel`` (an EMA by ``get_ema_multi_avg_fn``, SWA), or
            ``equiv.ExponentialAverage(ema_model, decay)`` for a hand-written EMA. Each audited window
            after the first checks it moved once per optimizer step, by its rule, towards the weights
            of the step before (:mod:`equiv.auditing.averaged`): updated per micro-batch, it fails.
        allow_nothing_judged: let :meth:`Audit.assert_ok` pass an audit that judged no window and
            flagged none (by default it fails, saying why: the optimizer never stepped, an empty
            loader, every window inherently not equivalent (dropout), or none sampled).

    Returns:
        The :class:`Audit`, a context manager: its ``windows`` hold each audited step's
        :class:`~equiv.auditing.replay.WindowAudit` (the shared result protocol).

    Raises:
        TypeError, ValueError: an argument is not what the audit can take (named, with the value given:
            an optimizer that is neither a torch optimizer nor a wrapper of one, one whose step needs a
            closure), or the optimizer holds parameters that are not the model's, or ``loss`` disagrees with
            the criterion (or the loop's functional loss call) it is handed; ValueError from a step whose
            recorded targets do not fit ``loss`` (the shapes found named).
    """
    return Audit(model, optimizer, loss=loss, every=every, targets=targets, output=output,
                 max_grad_norm=max_grad_norm, stop_at_first_failure=stop_at_first_failure, on_window=on_window,
                 call_model=call_model, record_forward=record_forward, allow_nothing_judged=allow_nothing_judged,
                 criterion=criterion, max_grad_value=max_grad_value, averaged=averaged)

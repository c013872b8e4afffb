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

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any, Concatenate, ParamSpec

import torch
from torch import Tensor, nn

from equiv.auditing.averaged import averaged_weights
from equiv.auditing.deepspeed import ZeroOptimizer, deepspeed_setting_at_fault, zero_view
from equiv.auditing.judging import WindowJudge
from equiv.auditing.optimizers import audited_optimizer, closure_required
from equiv.auditing.ranks import Ranks, plain_copy, ranks_of_run, unwrapped
from equiv.auditing.recording import (
    ClipWatch,
    FunctionalLossMode,
    OutputSpec,
    Replaying,
    WatchedForward,
    WindowRecord,
    detached,
    first_not_finite,
    functional_losses,
    loss_target,
    pop_mode,
)
from equiv.auditing.schedules import Advance, ScheduleWatch
from equiv.auditing.settings import (
    AuditSettings,
    agree,
    clip_setting,
    default_call,
    default_targets,
)
from equiv.distributed.deepspeed import EngineSettings, engine_of, engine_settings, is_deepspeed_engine
from equiv.judging.autocast import autocast_of
from equiv.losses import FUNCTIONAL, options_of_call
from equiv.outcomes import Outcome
from equiv.results.audit import AuditFailure, AuditResult
from equiv.results.witness import Witness

# AuditSettings, clip_setting and default_targets are named here as before the parts were split (issue 43).
__all__ = ["Audit", "AuditFailure", "AuditSettings", "audit", "clip_setting", "default_targets"]


class Audit(AuditResult):
    """The audit of one run (see the module's docstring); use :func:`audit`.  The hooks on a
    run and the result they fill: an :class:`~equiv.results.audit.AuditResult` (``windows``,
    :meth:`counts`, :meth:`summary`, ``to_dict()``, :meth:`assert_ok`), truthy when every audited
    window was equivalent (and at least one was judged).  Every optimizer step is counted: judged
    equivalent or not, or not judged and why (inherently not equivalent, a full-batch step that is
    not finite, not sampled by ``every``); an audit that judged nothing says why, and its
    :meth:`assert_ok` fails unless ``allow_nothing_judged``."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | Any, settings: AuditSettings) -> None:
        super().__init__(every=settings.every, allow_nothing_judged=settings.allow_nothing_judged)
        #: the options the audit applies (:class:`~equiv.auditing.settings.AuditSettings`)
        self.settings = settings
        #: what the loop calls, when the audit was handed a ``torch.compile``d module (watched too, outside its graph)
        self._compiled = model if _compiled_from(model) is not model else None
        model = unwrapped(_compiled_from(model))  # DDP's module: DDP's forward calls it, its calls are recorded
        if is_deepspeed_engine(model):  # the engine's forward calls its module: that is what is watched
            optimizer = model.optimizer if optimizer is None else optimizer
            model = getattr(model, "module")  # noqa: B009 (an engine, typed as the module it passed for)
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if optimizer is None:
            raise TypeError(
                "equiv.audit(model, optimizer, ...) needs the run's optimizer (left out only for a DeepSpeed engine, "
                "whose own is taken)"
            )
        #: DeepSpeed's settings where a DeepSpeed engine trains the model (None: none does)
        self.deepspeed = _deepspeed_settings(model, optimizer)
        settings = self.settings = _with_engine_clip(settings, self.deepspeed)
        zero = zero_view(optimizer, model)  # DeepSpeed ZeRO 1/2: its partitions are what its optimizer steps
        optimizer = zero if zero is not None else audited_optimizer(optimizer)  # inside Accelerate's / Lightning's
        refused = closure_required(optimizer)
        if refused is not None:
            raise ValueError(
                f"equiv.audit does not support optimizer {type(optimizer).__name__}: {refused}, so there "
                "is no full-batch step to compare with (equiv check refuses it too)"
            )
        if zero is None:  # a ZeRO optimizer steps flat partitions of the model's parameters, its layout checked
            _refuse_a_foreign_optimizer(model, optimizer)
        #: the averaged copy of the weights the run keeps (an EMA, SWA), checked once per audited window
        self.averaged = averaged_weights(settings.averaged, model)
        self.model, self.optimizer = model, optimizer
        #: the objective judged by, and the clips the replay applies once per window (None: none)
        self.loss, self.max_grad_norm, self.max_grad_value = (
            settings.loss,
            settings.max_grad_norm,
            settings.max_grad_value,
        )
        #: where the run is, as a trainer's callback (or the loop) sets it: "epoch 1, batch 6";
        #: each audited window keeps the value it had when its step was taken
        self.position: str | None = None
        #: what a trainer's callback read from the trainer's settings, one line (None: not started by one); a
        #: DeepSpeed engine's config, read and said when the audit starts
        self.read: str | None = None if self.deepspeed is None else f"equiv audit: {self.deepspeed.said()}"
        #: the trainer's setting a failing window's witness points at, in words (a trainer's callback sets it; a
        #: DeepSpeed engine's, its own)
        self.setting_at_fault: Callable[[Witness], str | None] | None = (
            None if self.deepspeed is None else deepspeed_setting_at_fault(self.deepspeed)
        )
        #: the ranks of a multi-process run (None: one process), set on entering
        self.ranks: Ranks | None = None
        self._open_state(settings)

    def _open_state(self, settings: AuditSettings) -> None:
        """What the hooks keep while the audit is open (none of it the result)."""
        self._handles: list[Any] = []
        self._watched: list[WatchedForward] = []
        #: calls of watched forwards now running (a compiled module's call of its model is not recorded again)
        self._depth = 0
        #: how the windows are judged, set on entering (with the model's copy the replay starts from)
        self._judging: WindowJudge | None = None
        #: what the window now open saw (None: this window is not audited)
        self._window: WindowRecord | None = None
        self._hyper: tuple[dict[str, Any], ...] = ()
        #: inside ``GradScaler.step``; and whether the optimizer step now running skips itself (fused, found_inf)
        self._in_scaler_step = False
        self._skips_inside = False
        #: the optimizer step now running was called with a closure (its gradient is the closure's)
        self._closure_step = False
        #: the advances of the optimizer's LR schedule since the last optimizer step (equiv.auditing.schedules)
        self._advances: list[Advance] = []
        #: inside a criterion's or a wrapped loss's call: a functional loss called there is that one,
        #: recorded once (an audit's replay is kept out by ``Replaying``)
        self._in_loss = 0
        #: the torch.nn.functional losses whose targets are recorded (those ``loss`` maps onto; none with
        #: a criterion, which records its own), and the mode that sees them, on during audited windows only
        self._functional = functional_losses(settings.loss) if settings.criterion is None else frozenset()
        self._mode: FunctionalLossMode | None = None

    # -- the hooks ---------------------------------------------------------

    def __enter__(self) -> Audit:
        self.ranks = ranks_of_run(self.model)
        if self.deepspeed is not None and self.read is not None and (self.ranks is None or self.ranks.rank == 0):
            print(self.read, flush=True)  # said once, as a trainer's callback says what it read
        if self.averaged is not None and self.ranks is not None and self.ranks.sharded:
            raise ValueError(
                "equiv.audit checks an averaged model (averaged=) in one process or under DDP; under "
                "FSDP2 its replay would need the whole model on a rank: audit without averaged=, or "
                "check the average in a DDP or single-process run of the same loop"
            )
        template = plain_copy(self.model)  # before our hooks are on it; an FSDP2 model's whole
        self._judging = WindowJudge(
            settings=self.settings,
            template=template,
            model=self.model,
            optimizer=self.optimizer,
            ranks=self.ranks,
            averaged=self.averaged,
            functional=self._functional,
            engine_steps=None if self.deepspeed is None else self.deepspeed.gradient_accumulation_steps,
        )
        self._handles = [
            self.optimizer.register_step_pre_hook(self._on_step_begin),
            self.optimizer.register_step_post_hook(self._on_step_end),
        ]
        criterion = self.settings.criterion
        if criterion is not None:
            self._handles.append(criterion.register_forward_pre_hook(self._on_criterion, with_kwargs=True))
            self._handles.append(criterion.register_forward_hook(self._after_criterion, always_call=True))
        if self.settings.record_forward:
            called = [self.model] if self._compiled is None else [self.model, self._compiled]
            self._watched = [WatchedForward.install(self, module) for module in called]
        ClipWatch.open(self)
        ScheduleWatch.open(self)
        self._begin_window()
        return self

    def __exit__(self, *exc: object) -> None:
        self._functional_off()
        ClipWatch.close(self)
        ScheduleWatch.close(self)
        for watched in self._watched:
            watched.remove()
        for handle in self._handles:
            handle.remove()
        self._handles, self._window, self._judging, self._watched = [], None, None, []

    def _begin_window(self) -> None:
        """Copy what the next window starts from, if it will be audited."""
        self._advances = []  # the schedule's advances are counted per window, audited or not
        if self.steps % self.every:
            self._window = None
            self._functional_off()
            if isinstance(self.optimizer, ZeroOptimizer):
                self.optimizer.capturing = False
            return
        self._window = WindowRecord.begin(self.model, self.optimizer, self.averaged, self.steps)
        if isinstance(self.optimizer, ZeroOptimizer):  # DeepSpeed's gradient partitions, kept for a witness
            self.optimizer.capturing = True
        self._functional_on()

    def _record_forward(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """A call of the model's forward: recorded when training with gradients (True then)."""
        if not (self.model.training and torch.is_grad_enabled()):
            return False
        self.forward_calls += 1  # counted to say what a run that never steps did
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
        if self.settings.call_model is not default_call:
            self._window.outputs.append(None)
            return
        try:
            taken = self.settings.output(output)
            spec: OutputSpec | None = (tuple(taken.shape), taken.dtype)
        except Exception:  # an output the mapping cannot read now is named at the replay
            spec = None
        self._window.outputs.append(spec)

    def record(self, *args: Any, **kwargs: Any) -> None:
        """Record one micro-batch of the current window by hand, as ``call_model``
        will replay it (for trainers whose targets never reach ``forward``: a
        Lightning callback records each training batch)."""
        if self._window is not None:
            self._window.calls.append((detached(args), detached(kwargs)))
            self._window.autocast.append(autocast_of(self.model))

    def _on_criterion(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self._in_loss += 1
        self._saw_target(loss_target(args, kwargs, "criterion"))

    def _after_criterion(self, module: nn.Module, args: Any, output: Any) -> None:
        self._in_loss = max(0, self._in_loss - 1)

    # -- torch.nn.functional losses, seen without a wrap -----------------------

    # -- torch.nn.functional losses, seen without a wrap -----------------------

    def _functional_on(self) -> None:
        """The mode that sees the loop's functional loss calls, pushed for an audited window."""
        if self._functional and self._mode is None:
            self._mode = FunctionalLossMode(self)
            self._mode.__enter__()

    def _functional_off(self) -> None:
        """The mode that sees the loop's functional loss calls taken off (:func:`~equiv.auditing.recording.pop_mode`)."""
        mode, self._mode = self._mode, None
        if mode is not None:
            pop_mode(mode)

    def _saw_functional(self, function: Callable[..., Tensor], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """A ``torch.nn.functional`` loss the loop called on the model's output (not inside the model's
        forward, a criterion, a wrapped loss or the audit's judging; not a metric on a detached output):
        its options checked against ``loss`` and its target recorded, paired with the model's call before."""
        if self._depth or self._in_loss or self._window is None or Replaying.now:
            return
        if not (self.model.training and torch.is_grad_enabled()):
            return
        given = args[0] if args else kwargs.get("input")
        if not (isinstance(given, Tensor) and given.requires_grad):
            return
        options = options_of_call(function, args, kwargs)
        agree(self.loss, options, "the loop's")
        self._window.functional_targets.append(loss_target(args, kwargs, options.written).detach().clone())

    def _saw_target(self, target: Tensor) -> None:
        if self._window is not None and self.model.training and torch.is_grad_enabled():
            self._window.seen_targets.append(target.detach().clone())

    def wrap(self, loss_fn: Callable[..., Tensor]) -> Callable[..., Tensor]:
        """``loss_fn`` recording the target of each call, for the audit's replay: the loop calls
        ``audit.wrap(F.cross_entropy)(model(x), y)``; the targets (the second positional argument,
        or the ``target=`` / ``targets=`` / ``labels=`` keyword) are paired with the model's calls."""

        def recorded(*args: Any, **kwargs: Any) -> Tensor:
            self._saw_target(loss_target(args, kwargs, getattr(loss_fn, "__name__", "the wrapped loss")))
            if loss_fn in FUNCTIONAL and self._window is not None:  # its options are the criterion's question
                agree(self.loss, options_of_call(loss_fn, args, kwargs), "the wrapped")
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
            self._window.clips.append((name, limit))
            self._window.clipped_after.append(len(self._window.calls))

    def _on_step_begin(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        # A fused optimizer stepped by a GradScaler is handed the scaler's found_inf and skips inside.
        found_inf = getattr(optimizer, "found_inf", None)
        self._skips_inside = (
            self._in_scaler_step
            and getattr(optimizer, "_step_supports_amp_scaling", False)
            and isinstance(found_inf, Tensor)
            and bool(found_inf.item())
        )
        self._hyper = tuple(
            {key: value for key, value in group.items() if key != "params"} for group in optimizer.param_groups
        )
        # A step called with a closure (SGD.step(closure)) runs it inside the step: the forward calls it makes
        # join the window (recorded as any others), and the gradient the step takes is read after it.
        self._closure_step = bool(args and args[0] is not None) or kwargs.get("closure") is not None
        if self._window is not None and not self._closure_step:
            self._window.not_finite = self._gradient_not_finite(optimizer)

    def _gradient_not_finite(self, optimizer: torch.optim.Optimizer) -> str | None:
        """The gradient this step takes, named if it is not finite."""
        names = {id(param): name for name, param in self.model.named_parameters()}
        return first_not_finite(
            ((names.get(id(p), "?"), p.grad) for group in optimizer.param_groups for p in group["params"]),
            "gradient",
            step=self.steps,
        )

    def _on_step_end(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._skips_inside:  # no update: GradScaler.step's wrapper counts it skipped, as a skipped call
            self._skips_inside = False
            return
        self._functional_off()  # the replay's own loss calls are not the loop's (and run at full speed)
        window, step = self._window, self.steps
        if window is not None and self._closure_step:  # the closure's gradient (optimizers leave .grad as it is)
            window.not_finite = self._gradient_not_finite(optimizer)
        if window is not None:
            window.schedule = self._advances
        self.steps += 1
        try:
            if window is not None:
                with Replaying():
                    self._judge(window, step)
        finally:
            self._begin_window()

    def _judge(self, window: WindowRecord, step: int) -> None:
        """Judge the window just stepped (its verdict kept, handed to ``on_window``, raised if asked)."""
        assert self._judging is not None
        verdict = self._judging.window_verdict(window, step, hyperparameters=self._hyper, position=self.position)
        if verdict.witness is not None and self.setting_at_fault is not None:
            verdict = dataclasses.replace(verdict, setting=self.setting_at_fault(verdict.witness))
        self.windows.append(verdict)
        if self.settings.on_window is not None:
            self.settings.on_window(verdict)
        if self.settings.stop_at_first_failure and verdict.status is Outcome.NOT_EQUIVALENT:
            raise AuditFailure(verdict)

    def _schedule_advanced(self, advance: Advance) -> None:
        """A scheduler of this audit's optimizer advanced its schedule (counted for the window now open)."""
        self._advances.append(advance)

    def _skipped(self) -> None:
        """A GradScaler skipped the step (inf or NaN gradients): the micro-batches recorded
        since the last step took no step, and the next window starts again from here."""
        self.skipped += 1
        self._begin_window()


def _refuse_a_foreign_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """The optimizer must step the model's own parameters (some of them: frozen ones are fine)."""
    own = {id(param) for param in model.parameters()}
    foreign = [param for group in optimizer.param_groups for param in group["params"] if id(param) not in own]
    if foreign:
        raise ValueError(
            f"the optimizer holds {len(foreign)} parameter tensor{'s' if len(foreign) != 1 else ''} that "
            f"{'are' if len(foreign) != 1 else 'is'} not the model's parameters (first: shape "
            f"{tuple(foreign[0].shape)}; the model, a {type(model).__name__}, has {len(own)} parameter tensors): "
            "build the optimizer from model.parameters() of the model the audit watches"
        )


def _deepspeed_settings(model: nn.Module, optimizer: Any) -> EngineSettings | None:
    """The settings of the DeepSpeed engine training ``model`` (found from the model), else None."""
    engine = engine_of(model)
    return None if engine is None else engine_settings(engine)


def _with_engine_clip(settings: AuditSettings, deepspeed: EngineSettings | None) -> AuditSettings:
    """``settings`` with the DeepSpeed config's ``gradient_clipping`` as ``max_grad_norm`` (the engine clips the
    global norm once per step, as the full batch would); a ``max_grad_norm=`` given that differs is refused."""
    if deepspeed is None or not deepspeed.gradient_clipping:
        return settings
    given = settings.max_grad_norm
    if given is None:
        return dataclasses.replace(settings, max_grad_norm=deepspeed.gradient_clipping)
    if given != deepspeed.gradient_clipping:
        raise ValueError(
            f"max_grad_norm={given:g} but the DeepSpeed engine clips to gradient_clipping="
            f"{deepspeed.gradient_clipping:g} (its config): leave max_grad_norm out, it is read from the engine"
        )
    return settings


def _compiled_from(model: Any) -> Any:
    """The module a ``torch.compile``d one runs (its parameters are the optimizer's, by their own names)."""
    original = getattr(model, "_orig_mod", None)
    return original if isinstance(model, nn.Module) and isinstance(original, nn.Module) else model


_Options = ParamSpec("_Options")


def _keywords_of(
    settings: Callable[_Options, AuditSettings],
) -> Callable[[Callable[..., Audit]], Callable[Concatenate[nn.Module, Any, _Options], Audit]]:
    """``audit``'s keywords are the fields of ``settings``, written once there: checked by mypy at
    every call (through the dataclass's ``__init__``) and shown by ``help`` / ``inspect.signature``."""

    def typed(front_door: Callable[..., Audit]) -> Callable[Concatenate[nn.Module, Any, _Options], Audit]:
        positional = list(inspect.signature(front_door).parameters.values())[:2]
        keywords = list(inspect.signature(settings).parameters.values())
        front_door.__signature__ = inspect.signature(front_door).replace(  # type: ignore[attr-defined]
            parameters=[*positional, *keywords]
        )
        return front_door

    return typed


@_keywords_of(AuditSettings)
def audit(model: nn.Module, optimizer: torch.optim.Optimizer | Any = None, **options: Any) -> Audit:
    """Audit the optimizer steps of the run made inside ``with`` (see :mod:`equiv.auditing.watch`).

    Args:
        model, optimizer: the run's own (the optimizer must hold the model's parameters); a ``torch.compile``d model or
            an Accelerate-prepared one is watched as itself, and calls through ``model(...)`` and
            ``model.forward(...)`` are both recorded.  The optimizer may be the wrapper the loop holds (Accelerate's
            ``AcceleratedOptimizer``, Lightning's ``LightningOptimizer``, any object keeping it as ``.optimizer``): the
            torch optimizer inside is hooked, said once in a ``UserWarning``.  One whose ``step`` needs a closure
            (``LBFGS``) is refused; a step given an optional closure (``SGD.step(closure)``) is judged on every
            micro-batch of its window, the closure's included.  The optimizer's LR schedulers are followed
            (:mod:`equiv.auditing.schedules`): one stepped more than once in a window, changing the learning rate the
            step took, fails it (``WindowAudit.schedule``); changing nothing, it is said in the window's ``note``.
        loss: the objective the run means, as a sum + count loss (``equiv.NextTokenCrossEntropy()`` for a causal LM's
            ``labels``, ``equiv.CrossEntropy()`` for classification, ``equiv.MSE()``; ``CrossEntropy`` /
            ``TokenCrossEntropy`` take torch's ``weight=``, ``ignore_index=`` and ``label_smoothing=``: with class
            weights an item counts its class's weight, as torch's weighted mean divides). Left out with ``criterion=``
            given, it is derived from the criterion. A shipped cross-entropy or MSE also has the loop's own
            ``F.cross_entropy`` / ``F.nll_loss`` / ``F.mse_loss`` call seen during audited windows (its targets
            recorded, its options read as a criterion's), so ``loss = F.cross_entropy(model(x), y)`` needs no wrap.
        every: audit one optimizer step in every ``every`` (the first one included).
        targets, output: read a recorded call's targets and the model's output the loss takes (by default the
            ``labels`` / ``targets`` / ``target`` keyword, else the second positional argument; a guess that does not
            fit ``loss`` is an error naming the shapes found).
        criterion: the ``nn.Module`` loss the loop calls as ``criterion(output, target)`` (``loss = criterion(model(x),
            y)``): its targets are recorded where it sees them, each paired with the model's call before it, with no
            change to the loop. Its options are read (``label_smoothing``, ``weight``, ``ignore_index`` of
            ``CrossEntropyLoss`` / ``NLLLoss``; ``MSELoss``; ``reduction`` is how the loop reduces, not the objective):
            a ``loss=`` that disagrees is one line naming both, a torch loss equiv ships nothing for (``L1Loss``,
            ``BCEWithLogitsLoss``) is refused by name unless ``loss=`` says what it computes. For a loss function,
            ``audit.wrap(loss_fn)`` (:meth:`Audit.wrap`) records its targets too.
        max_grad_norm: the norm the run clips to, once per step (None, 0 or inf: it does not clip).
        max_grad_value: the value the run clamps each gradient element to (``clip_grad_value_``), once per step (None,
            0 or inf: it does not).
        stop_at_first_failure: raise :class:`AuditFailure` from the step that is not equivalent.
        on_window: called with each audited window's verdict as it is made.
        call_model, record_forward: each recorded micro-batch is replayed as ``call_model(model, (args, kwargs))`` (a
            model whose forward computes its own loss: ``call_model`` hands the loss the logits; the targets are then
            checked on what ``call_model`` / ``output`` return, never on the run's own forward output); with
            ``record_forward=False``, micro-batches are recorded with :meth:`Audit.record` instead of by the watched
            ``forward``.
        averaged: the averaged copy of the weights the run keeps: a ``torch.optim.swa_utils.AveragedModel`` (an EMA by
            ``get_ema_multi_avg_fn``, SWA), or ``equiv.ExponentialAverage(ema_model, decay)`` for a hand-written EMA.
            Each audited window after the first checks it moved once per optimizer step, by its rule, towards the
            weights of the step before (:mod:`equiv.auditing.averaged`): updated per micro-batch, it fails.
        allow_nothing_judged: let :meth:`Audit.assert_ok` pass an audit that judged no window and flagged none (by
            default it fails, saying why: the optimizer never stepped, an empty loader, every window inherently not
            equivalent (dropout), or none sampled).

    Returns:
        The :class:`Audit`, a context manager: its ``windows`` hold each audited step's :class:`WindowAudit`.

    Raises:
        TypeError, ValueError: an unknown keyword (these are the fields of :class:`~equiv.auditing.AuditSettings`), an
            argument the audit cannot take (named, with the value given: an optimizer that is neither a torch optimizer
            nor a wrapper of one, one whose step needs a closure), an optimizer holding parameters not the model's, or
            ``loss`` disagreeing with the criterion (or the loop's functional loss call) it is handed; ValueError from
            a step whose recorded targets do not fit ``loss`` (the shapes found named).
    """
    return Audit(model, optimizer, AuditSettings(**options))

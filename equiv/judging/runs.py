"""Run a case's steps with one step function and record what changed.

A trajectory is the parameters, buffers and optimizer state after every
optimizer step, copied to float64 on the CPU.  The reference step (one step on
the concatenated batch, mean loss over all items) and the user's candidate are
run by the same loop on identical copies; the candidate is called once per
optimizer step on the same model and optimizer, with no clean-up in between,
so gradients it leaks into the next step change the next update.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os
import threading
import time
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, TypedDict

import torch
from torch import Tensor, nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.overrides import TorchFunctionMode
from typing_extensions import Unpack  # typing's from Python 3.11; equiv supports 3.10

from equiv.batches import Batch, split_batch
from equiv.cases.case import Case
from equiv.cases.models import ModelBundle
from equiv.judging.contract import BoundCandidate, CandidateError, CandidateTimeout, bind
from equiv.judging.deadline import CheckTimeout, counting_interrupts, interrupts_received
from equiv.losses import Loss

__all__ = [
    "NonFiniteLossError",
    "Snapshot",
    "autocast_wrapped",
    "full_batch_step",
    "lifted_low_precision",
    "run_candidate",
    "run_reference",
    "snapshot_of",
    "state_snapshot",
]


class NonFiniteLossError(ValueError):
    """The full-batch reference produced a non-finite loss: the case itself is bad."""


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Named tensors of one moment of a run, on the run's device (so a CUDA
    case is compared on the GPU, without per-tensor host round-trips): float64
    copies, or the run's own tensors in its own dtype, lent to a consumer
    that reads them at once (a streamed run)."""

    params: dict[str, Tensor]
    buffers: dict[str, Tensor]
    #: "<param name>:<state key>" -> tensor (scalars as 0-d tensors)
    optimizer_state: dict[str, Tensor]


def snapshot_of(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    grad_scaler: torch.amp.GradScaler | None = None,
    *,
    copy_tensors: bool = True,
) -> Snapshot:
    """Float64 copies of the run's state; with ``copy_tensors=False`` the run's
    own tensors, in its dtype (no copy, no conversion: for a consumer that
    reads them at once and computes in float64, which promotes them exactly)."""
    return state_snapshot(
        dict(model.named_parameters()),
        {name: b for name, b in model.named_buffers() if b.is_floating_point()},
        optimizer,
        grad_scaler,
        copy_tensors=copy_tensors,
    )


def state_snapshot(
    params: Mapping[str, Tensor],
    buffers: Mapping[str, Tensor],
    optimizer: torch.optim.Optimizer,
    grad_scaler: torch.amp.GradScaler | None = None,
    *,
    copy_tensors: bool = True,
    state: Mapping[Tensor, Mapping[str, Any]] | None = None,
) -> Snapshot:
    """:func:`snapshot_of` of named tensors that are not one module's (a rank's shards of them).

    Args:
        params: the parameters the optimizer steps, by name (its state is named after them).
        buffers: the floating buffers, by name.
        optimizer: the optimizer over ``params``.
        grad_scaler: the run's loss scaler, whose scale is part of its state (or None).
        copy_tensors: float64 copies (True), or the tensors themselves, lent (False).
        state: the optimizer's per-parameter state as its replay keeps it, where that differs from
            ``optimizer.state`` (DeepSpeed's Adams count steps per group); None: ``optimizer.state``.

    Returns:
        The snapshot.
    """

    def copy(tensor: Tensor) -> Tensor:
        return tensor.detach().to(dtype=torch.float64, copy=True) if copy_tensors else tensor.detach()

    names = {id(p): name for name, p in params.items()}
    kept: dict[str, Tensor] = {}
    for param, param_state in (optimizer.state if state is None else state).items():
        for key, value in param_state.items():
            label = f"{names.get(id(param), '?')}:{key}"
            kept[label] = copy(value) if isinstance(value, Tensor) else torch.tensor(float(value), dtype=torch.float64)
    if grad_scaler is not None:
        # The scale must move exactly as the full-batch step's: backed off once
        # per overflowing window, never per micro-batch.
        kept["grad_scaler:scale"] = torch.tensor(grad_scaler.get_scale(), dtype=torch.float64)
    return Snapshot(
        params={name: copy(p) for name, p in params.items()},
        buffers={name: copy(b) for name, b in buffers.items()},
        optimizer_state=kept,
    )


def full_batch_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Batch,
    loss_fn: Loss,
    *,
    max_grad_norm: float | None = None,
    scheduler: Any | None = None,
    grad_scaler: torch.amp.GradScaler | None = None,
    normalise_after_backward: bool = False,
) -> Tensor:
    """The reference: one step on the whole batch with the mean loss over all
    of its items, clipped once if asked.

    Args:
        model, optimizer: what to step (the gradients are set to None first).
        batch: ``(inputs, targets)``, the whole batch.
        loss_fn: an :class:`equiv.Loss` (its mean; its ``sum`` and ``count`` when
            ``normalise_after_backward``).
        max_grad_norm: clip the total gradient norm to this once (None: no clipping).
        scheduler: stepped after the optimizer (not when the step is skipped).
        grad_scaler: the loss is scaled, and the step skipped when the gradient
            overflows (the scheduler with it, as :class:`equiv.Accumulator` and
            Accelerate do).
        normalise_after_backward: back-propagate the summed loss and divide the
            gradients by the item count afterwards: the same mathematics rounded
            the way an accumulator rounds (a floor sample, not a bug).

    Returns:
        The loss (the mean over the batch's items), detached; not checked for NaN
        here (a check's reference runs raise :class:`NonFiniteLossError` for one).
    """
    optimizer.zero_grad(set_to_none=True)
    loss = _full_batch_backward(model, batch, loss_fn, grad_scaler, normalise_after_backward)
    stepped = _clipped_step(model, optimizer, max_grad_norm, grad_scaler)
    if scheduler is not None and stepped:
        scheduler.step()
    return loss.detach()


def _full_batch_backward(
    model: nn.Module,
    batch: Batch,
    loss_fn: Loss,
    grad_scaler: torch.amp.GradScaler | None,
    normalise_after_backward: bool,
) -> Tensor:
    """The whole batch's mean loss, back-propagated (scaled, under a loss scaler)."""
    inputs, targets = batch
    if normalise_after_backward:
        # The same mathematics rounded the other legitimate way: back-propagate
        # the SUM over items and divide the gradient by the count afterwards
        # (the rounding pattern an accumulator has); a floor sample, not a bug.
        output = model(inputs)
        loss = loss_fn.sum(output, targets)
        count = loss_fn.count(targets)
        (grad_scaler.scale(loss) if grad_scaler is not None else loss).backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        torch._foreach_div_(grads, count.to(grads[0].dtype) if isinstance(count, Tensor) else float(count))
        return loss / count
    loss = loss_fn(model(inputs), targets)
    (grad_scaler.scale(loss) if grad_scaler is not None else loss).backward()
    return loss


def _clipped_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    max_grad_norm: float | None,
    grad_scaler: torch.amp.GradScaler | None,
) -> bool:
    """The optimizer step, clipped once if asked (after unscaling, under a loss scaler);
    whether it stepped (a loss scaler skips the step of an overflowing gradient)."""
    if grad_scaler is None:
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm, foreach=True)
        optimizer.step()
        return True
    grad_scaler.unscale_(optimizer)
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm, foreach=True)
    scale_before = grad_scaler.get_scale()
    grad_scaler.step(optimizer)
    grad_scaler.update()
    return grad_scaler.get_scale() >= scale_before


StepRunner = Callable[[nn.Module, torch.optim.Optimizer, Batch, "RunExtras", int], None]


@dataclass(frozen=True, slots=True)
class RunExtras:
    """Objects a step needs besides model and optimizer, fresh for each run."""

    scheduler: Any | None
    grad_scaler: torch.amp.GradScaler | None


class RankOptions(TypedDict, total=False):
    """How one rank of a distributed run runs the candidate: :func:`run_candidate`'s
    keywords for it (a single-process run gives none)."""

    #: wraps the model the step sees (DistributedDataParallel, FSDP); snapshots read the unwrapped one
    wrap_model: Callable[[nn.Module], nn.Module]
    #: wraps the wrapped model and its optimizer together (DeepSpeed's ``initialize``): what the step is handed
    #: (the engine and its optimizer) and the optimizer whose state snapshots read, keyed by the model's parameters
    wrap_optimizer: Callable[[nn.Module, torch.optim.Optimizer], tuple[nn.Module, Any, Any]]
    #: keeps the rank's part of every batch (with a tuple, further dimensions too: a
    #: context-parallel rank's slice of every sequence's positions)
    batch_slice: slice | tuple[slice, ...]
    #: cut the rank's part into these micro-batches (default: the case's)
    micro_batch_sizes: Sequence[int]
    #: hears each step start (progress for fault reports)
    on_step: Callable[[int], None]
    #: ``os._exit`` called by the step raises (a raised step) instead of ending this process
    #: (default True); False where the process is a spawned rank, whose death is reported
    catch_os_exit: bool


def _run(
    case: Case,
    dtype: torch.dtype,
    run_step: StepRunner,
    permutation_seed: int | None = None,
    *,
    rank: RankOptions | None = None,
    on_snapshot: Callable[[int, Snapshot], None] | None = None,
    initial: ModelBundle | None = None,
    on_note: Callable[[str], None] | None = None,
) -> list[Snapshot]:
    """Snapshots before the first step and after each step, computing in ``dtype``.

    ``rank``: one rank's model wrapper and part of every batch
    (:class:`RankOptions`; its other keys are :func:`run_candidate`'s).  ``initial``: the case's model as
    ``case.build_model()`` makes it, built once for many runs (a copy is
    trained; initialising a large model costs more than copying it).
    """
    device = torch.device(case.device)
    bundle = copy.deepcopy(initial) if initial is not None else case.build_model()
    model = bundle.module.to(device=device, dtype=dtype)
    batches = case.batches(bundle)
    stepped_model = autocast_wrapped(model, case.autocast)
    rank = rank or {}
    wrap_model, batch_slice = rank.get("wrap_model"), rank.get("batch_slice")
    if wrap_model is not None:
        stepped_model = wrap_model(stepped_model)
    optimizer = case.build_optimizer(stepped_model)
    if dtype == torch.float64 and case.optimizer in _LOWERS_IN_STEP:
        _lift_in_step(optimizer, dtype)
    extras = RunExtras(scheduler=case.build_scheduler(optimizer), grad_scaler=case.build_grad_scaler())
    stepped_optimizer: Any = optimizer
    if (wrap_optimizer := rank.get("wrap_optimizer")) is not None:  # DeepSpeed: the engine and its optimizer
        stepped_model, stepped_optimizer, optimizer = wrap_optimizer(stepped_model, optimizer)
    snapshots: list[Snapshot] = []

    def record(step: int) -> None:
        # Streamed snapshots are read at once and dropped: the run lends its own tensors.
        snapshot = snapshot_of(model, optimizer, extras.grad_scaler, copy_tensors=on_snapshot is None)
        if on_snapshot is None:
            snapshots.append(snapshot)
        else:  # streamed: compared (or folded into floor errors) at once, not kept
            on_snapshot(step, snapshot)

    record(0)
    with _seeded(device, case.seed):
        for step, (inputs, targets) in enumerate(batches):
            if permutation_seed is not None:
                order = torch.randperm(len(inputs), generator=torch.Generator().manual_seed(permutation_seed + step))
                inputs, targets = inputs[order], targets[order]
            if batch_slice is not None:
                inputs, targets = inputs[batch_slice], targets[batch_slice]
            batch = (_to(inputs, device, dtype), _to(targets, device, dtype))
            run_step(stepped_model, stepped_optimizer, batch, extras, step)
            if on_note is not None:
                for note in _what_the_step_changed(model, optimizer, dtype):
                    on_note(note)
            record(step + 1)
    return snapshots


#: torch's optimizers whose step computes below its parameters' dtype: torch.optim.Muon orthogonalises in
#: bfloat16 (``_zeropower_via_newtonschulz``).  In a float64 run their own low precision is lifted to float64
#: (in the truth, its floor samples and the candidate alike), as torch.autocast leaves float64 alone: the
#: float64 tier judges the mathematics, and bfloat16 sums of a sharded matrix's partial products (FSDP2, tensor
#: parallelism) are another rounding of Muon's own, not of the step's.  Runs in the working dtype keep it; the
#: float32 floor samples that also feed the float64 tier's floor (equiv.judging.floors) keep it too, which lifts
#: that allowance from ~1e-15 to ~1e-11 of the update (measured, bias-free MLP under FSDP2): still far below a
#: weighting bug's O(1/N).
_LOWERS_IN_STEP: frozenset[str] = frozenset({"Muon"})


def _lift_in_step(optimizer: torch.optim.Optimizer, dtype: torch.dtype) -> None:
    """``optimizer.step`` run with the bfloat16 and float16 it asks for lifted to ``dtype``
    (on the instance: whatever steps it, a GradScaler or a scheduler's counter, steps this).
    A bound method, as an optimizer's own: an LR scheduler re-wraps ``step.__func__``."""
    step = optimizer.step.__func__  # type: ignore[attr-defined]

    @functools.wraps(step)
    def lifted(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        with _PromoteLowPrecision(dtype, spare_optimizers=False):
            return step(self, *args, **kwargs)

    optimizer.step = types.MethodType(lifted, optimizer)  # type: ignore[method-assign]


@contextlib.contextmanager
def _seeded(device: torch.device, seed: int) -> Iterator[None]:
    """The global RNG seeded with ``seed`` for the block, and as it was after: dropout
    draws from it, so every run of a case is repeatable."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        # The CPU generator alone unless on CUDA: torch.manual_seed also queues
        # seeding of every accelerator backend, a measurable cost per run.
        if device.type == "cuda":
            torch.manual_seed(seed)
        else:
            torch.default_generator.manual_seed(seed)
        yield


def _what_the_step_changed(model: nn.Module, optimizer: torch.optim.Optimizer, dtype: torch.dtype) -> list[str]:
    """What a step did to the model besides training it, in words: a parameter the
    optimizer no longer holds (replaced by a new tensor), or one cast to another dtype."""
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    notes = []
    for name, param in model.named_parameters():
        if id(param) not in held:
            notes.append(
                f"the step replaced parameter '{name}' with a new tensor: the optimizer no longer holds it, "
                "so no optimizer step can update it"
            )
        if param.dtype != dtype:
            notes.append(
                f"the step changed the dtype of '{name}' from {str(dtype).removeprefix('torch.')} to "
                f"{str(param.dtype).removeprefix('torch.')}"
            )
    return notes


class _Autocast(nn.Module):
    """Runs the wrapped model's forward under ``torch.autocast`` (AMP).

    Its parameters are the wrapped model's own, so optimizers and snapshots
    see the same tensors.  Autocast never lowers float64, so float64 runs of an
    autocast case stay exact.
    """

    def __init__(self, model: nn.Module, dtype_name: str) -> None:
        super().__init__()
        self.model = model
        self.dtype = getattr(torch, dtype_name)

    def forward(self, inputs: Tensor) -> Tensor:
        with torch.autocast(device_type=inputs.device.type, dtype=self.dtype):
            output: Tensor = self.model(inputs)
        return output.float() if output.dtype in (torch.float16, torch.bfloat16) else output


def autocast_wrapped(model: nn.Module, autocast: str | None) -> nn.Module:
    """``model`` as a run steps it: under ``torch.autocast`` to the dtype named by ``autocast`` (a case's), or
    itself where that is None (a replica built so has the run's parameter names and FSDP2 units)."""
    return _Autocast(model, autocast) if autocast is not None else model


def _to(tensor: Tensor, device: torch.device, dtype: torch.dtype) -> Tensor:
    return tensor.to(device=device, dtype=dtype if tensor.is_floating_point() else tensor.dtype)


def run_reference(
    case: Case,
    dtype: torch.dtype,
    *,
    permutation_seed: int | None = None,
    normalise_after_backward: bool = False,
    on_snapshot: Callable[[int, Snapshot], None] | None = None,
    initial: ModelBundle | None = None,
) -> list[Snapshot]:
    """The full-batch trajectory.  With ``permutation_seed`` each batch is
    shuffled first, and with ``normalise_after_backward`` the gradient of the
    summed loss is divided by the item count after backward: the same
    mathematics rounded another way, which measures the dtype's own noise
    floor for this case."""
    loss_fn = case.build_loss()

    def run_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Any, extras: RunExtras, step: int) -> None:
        loss = full_batch_step(
            model,
            optimizer,
            batch,
            loss_fn,
            max_grad_norm=case.max_grad_norm,
            scheduler=extras.scheduler,
            grad_scaler=extras.grad_scaler,
            normalise_after_backward=normalise_after_backward,
        )
        # Under dynamic loss scaling a non-finite loss is an overflow to skip, not an error.
        if extras.grad_scaler is None and not torch.isfinite(loss):
            raise NonFiniteLossError(
                f"the full-batch reference loss is {loss.item()} at step {step} in {dtype}; "
                f"the case cannot be checked: {case!r}"
            )

    return _run(case, dtype, run_step, permutation_seed, on_snapshot=on_snapshot, initial=initial)


def _keywords_for(candidate: BoundCandidate, case: Case) -> Callable[[RunExtras], dict[str, Any]]:
    """The optional keywords to pass at each step: those the candidate accepts
    (:attr:`~equiv.judging.contract.BoundCandidate.keywords`) and the case sets."""
    reasons = candidate.not_applicable_reasons(case)
    if reasons:  # check() reports such a case as not applicable before running anything
        raise ValueError(f"the case does not apply to the candidate: {'; '.join(reasons)}")
    accepted = candidate.keywords

    def keywords(extras: RunExtras) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if "max_grad_norm" in accepted and case.max_grad_norm is not None:
            out["max_grad_norm"] = case.max_grad_norm
        if "scheduler" in accepted and extras.scheduler is not None:
            out["scheduler"] = extras.scheduler
        if "grad_scaler" in accepted and extras.grad_scaler is not None:
            out["grad_scaler"] = extras.grad_scaler
        return out

    return keywords


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype | None) -> Iterator[None]:
    """torch's default dtype set to ``dtype`` for the block (None: unchanged)."""
    if dtype is None:
        yield
        return
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


class _PromoteLowPrecision(TorchFunctionMode):
    """bfloat16 and float16 asked for by the code it wraps (``dtype=``, ``.to()``,
    ``.bfloat16()``, ``.half()``) given ``to`` instead: a step's own low-precision
    arithmetic (an accumulation buffer) lifted to the run's dtype.

    Not inside a ``torch.optim`` optimizer's ``step()``: the optimizer is the case's, run
    alike by the full-batch reference, so its own low precision is part of the truth, not
    the step's.  ``torch.optim.Muon`` orthogonalises in bfloat16 whatever the parameters'
    dtype (``_zeropower_via_newtonschulz``); lifted in the candidate alone, a bfloat16 buffer
    rerun under Muon would differ from the truth by Muon's own rounding and never be told
    from a mismatch."""

    _LOW = (torch.bfloat16, torch.float16)

    def __init__(self, to: torch.dtype, *, spare_optimizers: bool = True) -> None:
        super().__init__()
        self.to = to
        #: whether optimizer steps are left alone (False: the optimizer's own step is what is lifted)
        self.spare_optimizers = spare_optimizers
        #: optimizer steps running now (their arithmetic is left as the optimizer wrote it)
        self._in_optimizer = 0
        self._hooks: list[Any] = []

    def __enter__(self) -> _PromoteLowPrecision:
        # Global hooks: the step may make its own optimizer, or a wrapper's (DeepSpeed's ZeRO) steps the case's inside.
        self._in_optimizer = 0
        if self.spare_optimizers:
            self._hooks = [
                register_optimizer_step_pre_hook(self._optimizer_starts),
                register_optimizer_step_post_hook(self._optimizer_ends),
            ]
        super().__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def _optimizer_starts(self, *_: Any) -> None:
        self._in_optimizer += 1

    def _optimizer_ends(self, *_: Any) -> None:
        self._in_optimizer -= 1

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self._in_optimizer > 0:
            return func(*args, **(kwargs or {}))
        if func in (torch.Tensor.bfloat16, torch.Tensor.half):
            return args[0].to(self.to)
        args = tuple(self.to if isinstance(a, torch.dtype) and a in self._LOW else a for a in args)
        kwargs = dict(kwargs or {})
        if kwargs.get("dtype") in self._LOW:
            kwargs["dtype"] = self.to
        return func(*args, **kwargs)


def lifted_low_precision(function: Callable[..., Any], dtype: torch.dtype) -> Callable[..., Any]:
    """``function`` run with the bfloat16 and float16 it asks for lifted to ``dtype``, as
    :func:`run_candidate`'s ``promote_low_precision`` runs a candidate: for code that
    torch calls from the autograd engine (a DDP comm hook such as ``bf16_compress_hook``),
    which the candidate's own lift does not reach (autograd runs hooks without the
    caller's torch function modes).

    Args:
        function: what to lift (a DDP comm hook: its signature is kept, as DDP inspects it).
        dtype: the run's dtype, which bfloat16 and float16 become.

    Returns:
        ``function``, lifted.
    """

    @functools.wraps(function)
    def lifted(*args: Any, **kwargs: Any) -> Any:
        with _PromoteLowPrecision(dtype):
            return function(*args, **kwargs)

    return lifted


class _OsExitCalled(SystemExit):
    """The step called ``os._exit(code)`` in the checking process itself, on the thread running it."""


#: ``os._exit`` as Python defines it, and the (process, thread) pairs whose step is running now.
_real_os_exit = os._exit
_steps_running: set[tuple[int, int]] = set()
_steps_lock = threading.Lock()


def _guarded_os_exit(status: int) -> NoReturn:
    if (os.getpid(), threading.get_ident()) in _steps_running:
        raise _OsExitCalled(status)
    _real_os_exit(status)


@contextlib.contextmanager
def _os_exit_raises() -> Iterator[None]:
    """``os._exit`` called by the step on the thread that runs it, in this process, raises
    :class:`_OsExitCalled` instead of ending the process with the step's code (``os._exit(0)``
    would end ``equiv check`` with exit code 0 and nothing judged: a silent pass).  Elsewhere
    (a forked child such as a DataLoader worker, another thread) it is the real one.  Steps run
    on several threads at once share one guard, installed while any runs."""
    key = (os.getpid(), threading.get_ident())
    with _steps_lock:
        _steps_running.add(key)
        os._exit = _guarded_os_exit
    try:
        yield
    finally:
        with _steps_lock:
            _steps_running.discard(key)
            if not _steps_running:
                os._exit = _real_os_exit


def _what_ended(exc: SystemExit | KeyboardInterrupt) -> str:
    """What a step that ended itself did, in words: "called sys.exit(0)"."""
    if isinstance(exc, _OsExitCalled):
        return f"called os._exit({exc.code!r})"
    if isinstance(exc, SystemExit):
        return f"called sys.exit({exc.code!r}) (raised SystemExit)"
    return "raised KeyboardInterrupt itself (no Ctrl-C was received)"


def run_candidate(
    case: Case,
    candidate: Callable[..., Any] | BoundCandidate,
    dtype: torch.dtype,
    *,
    default_dtype: torch.dtype | None = None,
    on_snapshot: Callable[[int, Snapshot], None] | None = None,
    initial: ModelBundle | None = None,
    on_note: Callable[[str], None] | None = None,
    promote_low_precision: bool = False,
    **rank: Unpack[RankOptions],
) -> list[Snapshot]:
    """The candidate's trajectory: called once per step on the same model and
    optimizer, with the step's batch cut into ``case.micro_batch_sizes``.

    For one rank of a distributed run, ``rank``'s keywords (:class:`RankOptions`):
    ``wrap_model`` wraps the model in DDP, ``batch_slice`` selects the rank's shard
    (with a tuple, its positions too), ``micro_batch_sizes`` cuts it, ``on_step`` hears
    each step start (progress for fault reports), and ``catch_os_exit=False`` lets
    ``os._exit`` called by the step end the process (a spawned rank's death is reported;
    by default it raises, a raised step).
    ``default_dtype`` sets torch's default dtype while the candidate runs
    (how :func:`equiv.check` tells a precision finding from a mismatch);
    ``promote_low_precision`` runs it with the bfloat16 and float16 it asks for
    lifted to ``dtype`` (how it tells a low-precision buffer from a mismatch).
    """
    loss_fn = case.build_loss()
    candidate = bind(candidate)
    keywords = _keywords_for(candidate, case)
    dtype_name = str(dtype).removeprefix("torch.")
    cut = rank.get("micro_batch_sizes")
    sizes = case.micro_batch_sizes if cut is None else tuple(cut)
    on_step = rank.get("on_step")
    promoted = functools.partial(_PromoteLowPrecision, dtype) if promote_low_precision else contextlib.nullcontext
    os_exit = _os_exit_raises if rank.get("catch_os_exit", True) else contextlib.nullcontext

    def run_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Any, extras: RunExtras, step: int) -> None:
        if on_step is not None:
            on_step(step)
        micro_batches = split_batch(batch, sizes, copy=True)  # copies: a step may write into its inputs
        started, interrupts_before = time.monotonic(), interrupts_received()
        try:
            with counting_interrupts(), os_exit(), _default_dtype(default_dtype), promoted():
                candidate(model, optimizer, micro_batches, loss_fn, **keywords(extras))
        except (SystemExit, KeyboardInterrupt, Exception) as exc:
            # BaseExceptions too, which `except Exception` lets through: a step's sys.exit(0) would
            # otherwise end the check, and the command, with nothing judged and exit code 0.
            error = _step_error(exc, candidate.name, case, step, dtype_name, time.monotonic() - started)
            # A KeyboardInterrupt is the user's Ctrl-C (propagated) only when a SIGINT came.
            if isinstance(exc, KeyboardInterrupt) and interrupts_received() != interrupts_before:
                raise
            raise error from (None if isinstance(exc, CheckTimeout) else exc)

    return _run(case, dtype, run_step, rank=rank, on_snapshot=on_snapshot, initial=initial, on_note=on_note)


def _step_error(exc: BaseException, name: str, case: Case, step: int, dtype_name: str, ran_s: float) -> CandidateError:
    """What the candidate ``name``'s step raised (``exc``, after ``ran_s`` seconds), as the
    :class:`~equiv.judging.contract.CandidateError` naming the case, step and dtype
    (:class:`~equiv.judging.contract.CandidateTimeout` past the check's limit)."""
    if isinstance(exc, CheckTimeout):
        return CandidateTimeout(
            f"candidate {name} did not finish step {step} in {dtype_name} within the "
            f"check's limit of {exc.seconds:g} s (it ran {ran_s:.1f} s of it; it hangs, "
            f"or needs a longer timeout); reproduce with {case!r}",
            case=case,
            step=step,
            dtype=dtype_name,
        )
    if isinstance(exc, (SystemExit, KeyboardInterrupt)):
        return CandidateError(
            f"candidate {name} {_what_ended(exc)} at step {step} in {dtype_name}, so nothing was "
            f"judged there; reproduce with {case!r}",
            case=case,
            step=step,
            dtype=dtype_name,
        )
    return CandidateError(
        f"candidate {name} raised {type(exc).__name__}: {exc} at step {step} in {dtype_name}; reproduce with {case!r}",
        case=case,
        step=step,
        dtype=dtype_name,
    )

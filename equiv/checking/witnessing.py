"""The witness of a failing ``equiv.check`` step: the weight the step gave each micro-batch's loss (issue 44).

Run only after a verdict fails in the exact (float64) tier, so that a passing
check pays nothing.  The candidate runs once more in float64 up to the first
failing step: at that step's start equiv copies the model and the micro-batches
it is given, and at its optimizer's pre-step (``register_step_pre_hook``) reads
``G``, the gradient the step accumulated; the run stops there.  ``g_i`` is the
float64 gradient of micro-batch i's loss SUM (the case's loss) at the
parameters the step started from, on the copy.  Then
:func:`equiv.judging.witness.recover_weights` solves ``G ≈ Σ w_i g_i`` and
:func:`equiv.judging.witness.witness` names ``w``.

A check has no configured N (every window of a case has the case's
micro-batches), so a step that divides by an N of its own ("tail divided by N"
on a window shorter than it) is recognised from the weights themselves: when no
normaliser explains them and they are ``1/(N n_i)`` for a whole N larger than
the window, that N is the one the step divided by (:func:`implied_n`).

What the witness says beside the weights is decided as the audit's is
(:func:`equiv.judging.witness.explained`), from the step's own evidence: the
clip calls the captured step made on the model's parameters
(:mod:`equiv.judging.clip_calls`, the audit's watch of them), each with the
backward passes before it (a clip followed by another backward clipped between
micro-batches), and, only past the residual tolerance, a refit of ``G`` on every
row's gradient of the case's loss at the step's start.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call

from equiv.cases.case import Case
from equiv.distributed.deepspeed import is_zero_optimizer
from equiv.judging.clip_calls import clip_calls
from equiv.judging.contract import BoundCandidate, CandidateError
from equiv.judging.runs import RankOptions, run_candidate
from equiv.judging.witness import (
    MAX_ROWS,
    NAMING_TOLERANCE,
    Evidence,
    explained,
    recover_weights,
    row_gradients,
    row_residual,
    witness,
)
from equiv.results.witness import NOT_A_REWEIGHTING, UNEXPLAINED, Witness

__all__ = ["CapturedStep", "capture", "finite", "implied_n", "step_witness", "sum_gradients"]


class _Captured(BaseException):
    """Ends the witness's run at the first failing step's optimizer step, once ``G`` is read.

    A BaseException that is neither an Exception, SystemExit nor KeyboardInterrupt: the run's own
    handlers (which turn what a step raises into a CandidateError) let it through, as a step's
    ``except Exception`` does."""


@dataclasses.dataclass
class CapturedStep:
    """What the witness reads of one step: the micro-batches, a copy of the model at the step's start
    and the gradient its optimizer saw."""

    micro_batches: list[tuple[Any, Any]]
    replica: nn.Module
    names: list[str]
    accumulated: list[Tensor | None] | None = None
    #: each clip call on the model's parameters before the optimizer step: (torch's function, the backward
    #: passes before it); None where clip calls were not watched (a run on several processes)
    clips: tuple[tuple[str, int], ...] | None = None
    #: the backward passes that reached the model's parameters before the optimizer step
    backwards: int = 0


def _cloned(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, Tensor) else copy.deepcopy(value)


def _hookless(model: nn.Module) -> nn.Module:
    """A copy of ``model`` without the forward and backward hooks the step registered on it (a hook that counts
    calls or writes into the step's state must not see the witness's replay)."""
    replica = copy.deepcopy(model)
    for module in replica.modules():
        for hooks in (
            module._forward_hooks,
            module._forward_pre_hooks,
            module._backward_hooks,
            module._backward_pre_hooks,
        ):
            hooks.clear()
    return replica


def capture(
    candidate: BoundCandidate,
    case: Case,
    step: int,
    rank: RankOptions | None = None,
    *,
    on_start: Callable[[nn.Module], None] | None = None,
) -> CapturedStep | None:
    """The candidate run in float64 up to ``step``'s (0-based) optimizer step: what the witness reads there (None:
    the step never stepped its optimizer).  ``rank``: one rank's options (:class:`~equiv.judging.runs.RankOptions`);
    the replica is then the model before its engine wrapped it (DDP's parameters are the model's own).
    ``on_start``: given that model at the step's start instead of copying it (the replica is then the model
    itself): a sharded engine's parameters are DTensors, which the caller gathers (a collective) and rebuilds."""
    rank = rank or {}
    seen: list[CapturedStep] = []
    calls = [0]
    unwrapped: list[nn.Module] = []
    wrap_model = rank.get("wrap_model")
    if wrap_model is not None:
        engine = wrap_model

        def remembered(model: nn.Module) -> nn.Module:
            unwrapped.append(model)
            return engine(model)

        rank = {**rank, "wrap_model": remembered}

    def watched(model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: Any, *args: Any, **kw: Any) -> Any:
        index, calls[0] = calls[0], calls[0] + 1
        if index != step:
            return candidate.step(model, optimizer, micro_batches, *args, **kw)
        plain = unwrapped[-1] if unwrapped else model
        named = list(plain.named_parameters())
        if on_start is not None:
            on_start(plain)
        window = CapturedStep(
            [(_cloned(x), _cloned(y)) for x, y in micro_batches],
            plain if on_start is not None else _hookless(plain),
            [n for n, _ in named],
        )
        seen.append(window)

        def pre_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            # The first optimizer step of the window: what the step accumulated, after any unscaling and clipping.
            window.accumulated = [
                None if p.grad is None else p.grad.detach().to(torch.float64, copy=True) for _, p in named
            ]
            raise _Captured

        zero = is_zero_optimizer(optimizer)
        handle = zero_gradient_hook(optimizer, plain, window) if zero else optimizer.register_step_pre_hook(pre_step)
        try:
            if wrap_model is not None:  # clips and backwards counted in a single process only
                return candidate.step(model, optimizer, micro_batches, *args, **kw)
            with _clips_counted(window, model):
                return candidate.step(model, optimizer, micro_batches, *args, **kw)
        finally:
            handle.remove()

    try:
        run_candidate(
            case, dataclasses.replace(candidate, step=watched), torch.float64, on_snapshot=lambda *_: None, **rank
        )
    except _Captured:
        pass
    return seen[0] if seen and seen[0].accumulated is not None else None


def zero_gradient_hook(zero: Any, model: nn.Module, window: CapturedStep) -> Any:
    """Under DeepSpeed ZeRO 1/2 (its optimizer not a torch one): the gradient the step accumulated, read where the
    inner torch optimizer is about to step each group's flat partition (averaged over the ranks, clipped), gathered
    from every rank (a collective: every rank is at the same group) and cut back into ``model``'s parameters by
    DeepSpeed's own layout, once the last group's is in; the run then stops as at a torch optimizer's step."""
    import torch.distributed as dist

    from equiv.distributed.deepspeed import ZeroLayout

    layout = ZeroLayout(zero, model)
    partitions = {id(tensor): index for index, tensor in enumerate(zero.single_partition_of_fp32_groups)}
    flats: dict[int, Tensor] = {}

    def pre_step(inner: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for group in inner.param_groups:  # DeepSpeed hands its inner optimizer one group at a time
            for param in group["params"]:
                index = partitions.get(id(param))
                if index is None or param.grad is None:
                    continue
                mine = param.grad.detach().to(torch.float64).reshape(-1).contiguous()
                whole = torch.empty(mine.numel() * dist.get_world_size(), dtype=torch.float64, device=mine.device)
                dist.all_gather_into_tensor(whole, mine)  # the partitions in rank order: the whole flat buffer
                flats[index] = whole
        if len(flats) < len(layout.groups):
            return
        values: dict[str, Tensor] = {}
        for index, placed in enumerate(layout.groups):
            for name, offset, shape in placed.params:
                values[name] = flats[index][offset : offset + shape.numel()].view(shape).clone()
        window.accumulated = [values.get(name) for name, _ in model.named_parameters()]
        raise _Captured

    return zero.optimizer.register_step_pre_hook(pre_step)


@contextlib.contextmanager
def _clips_counted(window: CapturedStep, model: nn.Module) -> Iterator[None]:
    """``window.clips`` and ``window.backwards`` kept while the step runs: every clip call on (some of) the model's
    parameters, with the backward passes that reached them before it (one hook firing once per backward)."""
    own = {id(param) for param in model.parameters()}
    trained = [param for param in model.parameters() if param.requires_grad]
    clips: list[tuple[str, int]] = []
    window.clips = ()

    def counted(_: Any) -> None:
        window.backwards += 1

    def clipped(name: str, parameters: list[Tensor], limit: float) -> None:
        if math.isfinite(limit) and any(id(param) in own for param in parameters):  # inf: a norm measured
            clips.append((name, window.backwards))
            window.clips = tuple(clips)

    handle = torch.autograd.graph.register_multi_grad_hook(trained, counted, mode="any") if trained else None
    try:
        with clip_calls(clipped):
            yield
    finally:
        if handle is not None:
            handle.remove()


def sum_gradients(window: CapturedStep, case: Case) -> tuple[list[list[Tensor | None]], list[float]]:
    """Each micro-batch's float64 gradient of its loss SUM at the step's starting parameters, and its items."""
    loss_fn = case.build_loss()
    replica = window.replica
    params = dict(replica.named_parameters())
    gradients: list[list[Tensor | None]] = []
    items: list[float] = []
    with torch.random.fork_rng(devices=[]):  # dropout draws here must not move any later run's
        for inputs, targets in window.micro_batches:
            leaves = {name: p.detach().clone().requires_grad_(p.requires_grad) for name, p in params.items()}
            buffers = {name: b.detach().clone() for name, b in replica.named_buffers()}  # BatchNorm stats untouched
            output = functional_call(replica, {**leaves, **buffers}, (inputs,))
            loss = loss_fn.sum(output, targets)
            wanted = [leaves[name] for name in window.names if leaves[name].requires_grad]
            grads = iter(torch.autograd.grad(loss, wanted, allow_unused=True)) if wanted else iter(())
            gradients.append([next(grads) if leaves[name].requires_grad else None for name in window.names])
            items.append(float(loss_fn.count(targets)))
    return gradients, items


def finite(gradients: Sequence[Sequence[Tensor | None]]) -> bool:
    """Whether every gradient is finite (a least-squares fit of inf or NaN has no answer)."""
    return all(bool(torch.isfinite(g).all()) for gradient in gradients for g in gradient if g is not None)


def implied_n(weights: Sequence[float], items: Sequence[float]) -> int | None:
    """The N a step divided each micro-batch's mean by when its weights are ``1/(N n_i)`` (within the naming
    tolerance) for a whole N larger than the window's micro-batches; None otherwise."""
    inverse = [1.0 / count for count in items]
    scale = sum(w * r for w, r in zip(weights, inverse, strict=True)) / sum(r * r for r in inverse)
    if scale <= 0 or any(
        abs(w - scale * r) > NAMING_TOLERANCE * scale * r for w, r in zip(weights, inverse, strict=True)
    ):
        return None
    n = round(1.0 / scale)
    if n <= len(items) or abs(n * scale - 1.0) > NAMING_TOLERANCE:
        return None
    return n


def step_witness(candidate: BoundCandidate, case: Case, step: int) -> tuple[Witness | None, int | None]:
    """The witness of ``candidate``'s ``step`` on ``case`` (a failing step), and the N it divided by where the
    weights imply one (:func:`implied_n`).

    Returns:
        (None, None) when the step never called its optimizer's ``step()`` there (a window boundary: nothing
        accumulated to read), or raised when run again.
    """
    try:
        window = capture(candidate, case, step)
    except CandidateError:
        return None, None  # the step raised when run again: the verdict stands without a witness
    if window is None or window.accumulated is None:
        return None, None
    gradients, items = sum_gradients(window, case)
    if not finite([window.accumulated, *gradients]):
        return None, None  # an overflowing window: no weighting to read from inf or NaN
    recovered = recover_weights(gradients, window.accumulated)
    clipped = case.max_grad_norm is not None
    found = witness(recovered, items, configured_n=None, clipped=clipped)
    found = explained(found, _evidence(window, case, found))  # the audit's decision, on the check's evidence
    if found.normaliser != UNEXPLAINED or recovered.weights is None or clipped:
        return found, None
    n = implied_n(recovered.weights, items)
    if n is None:
        return found, None
    return witness(recovered, items, configured_n=n, clipped=clipped), n


def _evidence(window: CapturedStep, case: Case, found: Witness) -> Evidence:
    """What supports one explanation of the failing step: its clip calls (against its backward passes), and,
    only past the residual tolerance, the residual of G refitted on every row's gradient of the case's loss at
    the step's start (one more backward per row)."""
    if found.normaliser != NOT_A_REWEIGHTING or window.accumulated is None:
        return Evidence(window.backwards, window.clips)
    try:
        rows = _row_gradients(window, case)
    except ValueError as why:
        return Evidence(window.backwards, window.clips, rows_unmeasured=f"the rows were not split: {why}")
    residual, why_not = row_residual(rows, window.accumulated)
    return Evidence(window.backwards, window.clips, residual, f"the rows were not split: {why_not}")


def _row_gradients(window: CapturedStep, case: Case) -> list[list[Tensor | None]]:
    """Every row's float64 gradient of the case's loss sum at the step's start, micro-batch by micro-batch
    (:func:`equiv.judging.witness.row_gradients`), in the layout of ``window.accumulated``; rows with no item
    to count left out.

    Raises:
        ValueError: micro-batches whose output and targets cannot be split into rows, or more than MAX_ROWS rows.
    """
    loss_fn = case.build_loss()
    replica = window.replica
    params = dict(replica.named_parameters())
    rows: list[list[Tensor | None]] = []
    with torch.random.fork_rng(devices=[]):  # dropout draws here must not move any later run's
        for inputs, targets in window.micro_batches:
            if not isinstance(targets, Tensor):
                raise ValueError(f"targets of type {type(targets).__name__}, expected one tensor with a row dimension")
            if not float(loss_fn.count(targets)) > 0:
                continue
            if len(rows) + int(targets.shape[0] if targets.dim() else 0) > MAX_ROWS:
                raise ValueError(f"more than {MAX_ROWS} rows in the step")
            leaves = {name: p.detach().clone().requires_grad_(p.requires_grad) for name, p in params.items()}
            buffers = {name: b.detach().clone() for name, b in replica.named_buffers()}  # BatchNorm stats untouched
            output = functional_call(replica, {**leaves, **buffers}, (inputs,))
            trained = [name for name in window.names if leaves[name].requires_grad]
            for gradient, row in zip(
                row_gradients(output, targets, loss_fn, [leaves[name] for name in trained]), targets, strict=True
            ):
                if float(loss_fn.count(row.unsqueeze(0))) > 0:
                    by_name = dict(zip(trained, gradient, strict=True))
                    rows.append([by_name.get(name) for name in window.names])
    return rows

"""Judge one recorded optimizer step of a real run against the full-batch step
of the same window: the comparison and derived allowances of ``equiv.check``.

A :class:`RecordedWindow` holds what the audit's hooks saw (the weights and
optimizer state when the window began, the calls made to the model's
``forward`` in it, the optimizer's hyperparameters when it stepped).
:func:`judge_window` replays those micro-batches

* in float64 on a copy of the window-start model and optimizer: the truth,
  ``Σ item losses / Σ items`` over the whole window (the loss the user names,
  computed independently of how the user's code normalised), clipped once if
  the run clips, stepped with the learning rate the run used;
* as the engine's floor plan says (:mod:`equiv.judging.floors`), a few ways
  that round differently but mean the same (in order, in reverse, normalised
  after backward): the floor samples;

a run source of the engine's :class:`~equiv.judging.judge.Judge`, which then
compares the update the user's code actually applied (and the optimizer state
it left) with the truth.
The user's update exists only in the dtype it trained in, so a window is
judged in one tier: the noise tier of ``equiv.check`` for float32 / bfloat16 /
float16 training (the working dtype's floors), the exact tier for float64.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from equiv.auditing.deepspeed import ZeroOptimizer
from equiv.auditing.ranks import Ranks, local
from equiv.distributed.deepspeed import kernel_hyperparameters, torch_equivalent, torch_state, torch_state_dict
from equiv.judging.floors import IN_ORDER, Rounding
from equiv.judging.inherent import inherent_non_equivalences, random_forward_reason, seed_dependence
from equiv.judging.judge import Judge, OnSnapshot, RunSource
from equiv.judging.runs import Snapshot, state_snapshot
from equiv.results.audit import AuditFailure, RankVerdict, WindowAudit  # the result's; named here as before
from equiv.results.verdict import TensorDiff, Tier

__all__ = [
    "AuditFailure",
    "Autocast",
    "Call",
    "RecordedWindow",
    "WindowAudit",
    "WindowReplay",
    "inherent_advice",
    "judge_window",
    "model_at",
]

#: One call of the model's forward: (positional arguments, keyword arguments), detached copies.
Call = tuple[tuple[Any, ...], dict[str, Any]]
#: The mixed precision a call ran under: ``torch.autocast``'s device type and dtype.
Autocast = tuple[str, torch.dtype]


@dataclass(frozen=True, slots=True)
class RecordedWindow:
    """What the audit saw of one optimizer step's window."""

    #: the optimizer step's position in the audited run (0: the first step taken inside the audit)
    step: int
    #: the model's parameters and floating buffers when the window began (detached copies, the run's dtype)
    start_params: dict[str, Tensor]
    start_buffers: dict[str, Tensor]
    #: ``optimizer.state_dict()`` when the window began (tensors cloned)
    start_optimizer: dict[str, Any]
    #: every training-mode forward call of the window, in order
    calls: tuple[Call, ...]
    #: per param group, its hyperparameters when the optimizer stepped (a scheduler's LR included)
    hyperparameters: tuple[dict[str, Any], ...]
    #: per call, the ``torch.autocast`` it ran under, (device type, dtype), or None (empty: none did)
    autocast: tuple[Autocast | None, ...] = ()
    #: what the optimizer stepped when the window began where that is not the model's parameters (DeepSpeed ZeRO's
    #: fp32 partitions, by name, :mod:`equiv.auditing.zero`); None: the parameters
    start_held: dict[str, Tensor] | None = None
    #: whether a recorded forward call drew a random number (torch's generator advanced across it)
    drew_random: bool = False


Extract = Callable[[Call], Tensor]
OutputOf = Callable[[Any], Tensor]
CallModel = Callable[[nn.Module, Call], Any]


def _cast(value: Any, dtype: torch.dtype) -> Any:
    """``value`` with every floating tensor in it cast to ``dtype`` (ids and masks left alone)."""
    if isinstance(value, Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (list, tuple)):
        return type(value)(_cast(item, dtype) for item in value)
    if isinstance(value, dict):
        return {key: _cast(item, dtype) for key, item in value.items()}
    return value


@dataclass(frozen=True, kw_only=True, slots=True)
class WindowReplay:
    """How the audited run is replayed: the audit's run source for the engine.

    What stays the same from window to window of one run: the model (its
    window-start copy, ``template``, and the user's own, whose parameters the
    optimizer holds), the optimizer, the loss named as sum + count, how a call's
    output and targets are read, how the model is called, and the clip (by norm or by value)."""

    template: nn.Module
    model: nn.Module
    optimizer: torch.optim.Optimizer
    loss: Any
    output_of: OutputOf
    targets_of: Extract
    call_model: CallModel
    max_grad_norm: float | None = None
    #: the value each gradient element is clamped to (``clip_grad_value_``), or None
    max_grad_value: float | None = None
    #: the ranks of a multi-process run: the full batch is every rank's micro-batches (None: this process's)
    ranks: Ranks | None = None

    def source(self, window: RecordedWindow) -> RunSource:
        """The run source of ``window``: its full-batch step from its start, the
        micro-batches in the rounding's order (step 0: the window's start)."""
        start = _start(window)

        def replay(dtype: torch.dtype, rounding: Rounding, on_snapshot: OnSnapshot) -> None:
            order = range(len(window.calls))
            replica = self._replica(window, dtype)
            self._full_batch_gradient(
                replica,
                window,
                order=order[::-1] if rounding.order == "reversed" else order,
                after_backward=rounding.after_backward,
            )
            stepped = self._held(replica, window, dtype)
            optimizer = self._optimizer(window, stepped)
            optimizer.step()
            on_snapshot(0, start)
            on_snapshot(1, state_snapshot(stepped, _floating_buffers(replica), optimizer, copy_tensors=False))

        return replay

    def seed_dependence(self, window: RecordedWindow) -> float | None:
        """How far the window's first micro-batch forward moves with torch's random seed
        (:func:`~equiv.judging.inherent.seed_dependence`), on a float64 copy of the window-start model:
        None where it draws no random number (or the window made no call).  An FSDP2 rank's copy is
        sharded, and every rank runs both seeds' forwards together."""
        if not window.calls:
            return None
        dtype = torch.float64
        replica, call = self._replica(window, dtype), _cast(window.calls[0], dtype)
        device = next(iter(window.start_params.values())).device
        return seed_dependence(
            lambda: self.output_of(self.call_model(replica, call)).to(dtype),
            device,
            always_twice=self.ranks is not None and self.ranks.sharded,
        )

    def _replica(self, window: RecordedWindow, dtype: torch.dtype) -> nn.Module:
        """The window-start model in ``dtype``: sharded as the run shards it on an FSDP2 rank, else a copy."""
        if self.ranks is not None and self.ranks.sharded:
            return self.ranks.sharded_replica(self.template, window.start_params, window.start_buffers, dtype)
        return model_at(self.template, window, dtype)

    def _held(self, replica: nn.Module, window: RecordedWindow, dtype: torch.dtype) -> dict[str, nn.Parameter]:
        """The parameters this rank steps, by name, their gradients set: the replica's own, or, where the
        run shards its parameters across the ranks (FSDP2), this rank's shards of the replica's, or, under
        DeepSpeed ZeRO 1/2, this rank's flat partitions (from the window's start), the replica's gradient cut
        into them by DeepSpeed's layout."""
        if isinstance(self.optimizer, ZeroOptimizer):
            assert window.start_held is not None
            gradients = {name: p.grad for name, p in replica.named_parameters() if p.grad is not None}
            cut = self.optimizer.layout.partitions(gradients, dtype)
            partitions = {}
            for (name, start), gradient in zip(window.start_held.items(), cut, strict=True):
                partition = nn.Parameter(start.detach().to(dtype, copy=True))
                partition.grad = gradient
                partitions[name] = partition
            return partitions
        if self.ranks is None or not self.ranks.sharded:
            return dict(replica.named_parameters())
        held = {}
        for name, param in replica.named_parameters():
            shard = nn.Parameter(local(param.detach()), requires_grad=param.requires_grad)
            shard.grad = None if param.grad is None else local(param.grad)
            held[name] = shard
        return held

    def _optimizer(self, window: RecordedWindow, held: dict[str, nn.Parameter]) -> torch.optim.Optimizer:
        """An optimizer of the user's class over ``held``, in the same param groups, with the
        window-start state and the hyperparameters the run stepped with."""
        by_identity = {id(param): name for name, param in stepped_by_name(self.model, self.optimizer).items()}
        optimizer = self.optimizer
        inner = optimizer.inner if isinstance(optimizer, ZeroOptimizer) else optimizer
        equivalent = torch_equivalent(inner)  # DeepSpeed's own Adams: their torch equivalents, in float64
        if equivalent is not None:
            replica: torch.optim.Optimizer = equivalent[0](
                [{"params": [held[by_identity[id(p)]] for p in group["params"]]} for group in optimizer.param_groups],
                **equivalent[1],
            )
            replica.load_state_dict(torch_state_dict(copy.deepcopy(window.start_optimizer), replica))
            for group, hyper in zip(replica.param_groups, window.hyperparameters, strict=True):
                group.update(kernel_hyperparameters(hyper))
            return replica
        groups = [
            {
                **{k: v for k, v in group.items() if k != "params"},
                "params": [held[by_identity[id(p)]] for p in group["params"]],
            }
            for group in optimizer.param_groups
        ]
        # The constructor's own keywords only (defaults may hold derived ones, e.g.
        # AdamW's decoupled_weight_decay); every group carries its hyperparameters anyway.
        accepted = inspect.signature(type(inner)).parameters
        replica = type(inner)(groups, **{k: v for k, v in inner.defaults.items() if k in accepted})
        replica.load_state_dict(copy.deepcopy(window.start_optimizer))  # state cast to the replica's dtype
        for group, hyper in zip(replica.param_groups, window.hyperparameters, strict=True):
            group.update(hyper)
        return replica

    def _full_batch_gradient(
        self, model: nn.Module, window: RecordedWindow, *, order: Sequence[int], after_backward: bool
    ) -> None:
        """The full-batch gradient of the window's micro-batches as one batch: the sum of item
        losses over the window (every rank's, in a multi-process run) divided by its item count
        (each micro-batch back-propagated on its own: the same gradient, in bounded memory),
        clipped as the run clips, on the model's parameters."""
        dtype = next(model.parameters()).dtype
        targets = [_cast(self.targets_of(call), dtype) for call in window.calls]  # float targets (MSE) in dtype too
        total = sum(float(self.loss.count(target)) for target in targets)
        # A sharded replica's FSDP2 averages its reduce-scattered gradients over the ranks: the loss is
        # taken times the world so that their average is the sum.
        scale = 1.0
        if self.ranks is not None:  # every rank's items: the global count
            total = self.ranks.sum_items(total)
            scale = float(self.ranks.world_size) if self.ranks.sharded else 1.0
        counting = (
            self.ranks.counting_fsdp() if self.ranks is not None and self.ranks.sharded else contextlib.nullcontext()
        )
        with counting:
            self._backward_each(
                model, window, targets, order=order, total=total, scale=scale, after_backward=after_backward
            )
        if self.ranks is not None and not self.ranks.sharded:  # every rank's micro-batches, by the audit's all-reduce
            self.ranks.sum_gradients(model)
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        if after_backward and grads:
            torch._foreach_div_(grads, total)
        if self.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), self.max_grad_norm, foreach=True)
        if self.max_grad_value is not None:
            torch.nn.utils.clip_grad_value_(model.parameters(), self.max_grad_value, foreach=True)

    def _backward_each(
        self,
        model: nn.Module,
        window: RecordedWindow,
        targets: list[Tensor],
        *,
        order: Sequence[int],
        total: float,
        scale: float,
        after_backward: bool,
    ) -> None:
        """Each micro-batch forward and back on its own, in ``order``, its summed loss divided by the
        window's item count (or not, ``after_backward``), times ``scale``."""
        dtype = next(model.parameters()).dtype
        for position in order:
            mixed = window.autocast[position] if position < len(window.autocast) else None
            # The run's mixed precision replayed in the working dtype's runs (the floors then hold its rounding);
            # never in the float64 truth, which is the mathematics itself (autocast does not lower float64 anyway).
            context = (
                torch.autocast(device_type=mixed[0], dtype=mixed[1])
                if mixed is not None and dtype != torch.float64
                else contextlib.nullcontext()
            )
            with context:
                output = self.output_of(self.call_model(model, _cast(window.calls[position], dtype)))
            if output.dtype in (torch.float16, torch.bfloat16):
                output = output.to(dtype)  # the loss taken at the parameters' precision, as AMP recipes do
            try:
                summed = self.loss.sum(output, targets[position]) * scale
            except torch.OutOfMemoryError:
                raise
            except (RuntimeError, ValueError, IndexError, TypeError) as error:  # the user's call_model / output
                raise ValueError(
                    f"the targets (a tensor of shape {tuple(targets[position].shape)}) do not fit the loss: "
                    f"{self.loss!r} on what call_model / output returned (shape {tuple(output.shape)}) raised "
                    f"{type(error).__name__}: {str(error).rstrip('.')}. Pass the call_model=, output= and targets= "
                    "that hand the loss the model's output and its targets"
                ) from error
            (summed if after_backward else summed / total).backward()


def model_at(template: nn.Module, window: RecordedWindow, dtype: torch.dtype) -> nn.Module:
    """A copy of ``template`` in ``dtype`` holding the window-start weights and floating buffers.

    Args:
        template: a copy of the audited model (its structure; its values are replaced).
        window: the recorded window whose start is rebuilt.
        dtype: the dtype of the copy.

    Returns:
        The copy, a new module.
    """
    model = copy.deepcopy(template).to(dtype)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(window.start_params[name])
        for name, buffer in model.named_buffers():
            if name in window.start_buffers:
                buffer.copy_(window.start_buffers[name])
    return model


#: The roundings a recorded window can be replayed in (the first is the truth's own).
_ROUNDINGS = (IN_ORDER, Rounding("reversed"), Rounding(after_backward=True))


def stepped_by_name(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Tensor]:
    """What ``optimizer`` steps, by name: the model's parameters, or DeepSpeed ZeRO's partitions."""
    return optimizer.held() if isinstance(optimizer, ZeroOptimizer) else dict(model.named_parameters())


def _start(window: RecordedWindow) -> Snapshot:
    """The window's start as this rank holds it (its shards, in a sharded run; its partitions under ZeRO)."""
    held = window.start_held if window.start_held is not None else window.start_params
    return Snapshot(
        params={name: local(tensor) for name, tensor in held.items()},
        buffers=window.start_buffers,
        optimizer_state={},
    )


def _floating_buffers(model: nn.Module) -> dict[str, Tensor]:
    return {name: buffer.detach() for name, buffer in model.named_buffers() if buffer.is_floating_point()}


def judge_window(
    window: RecordedWindow,
    replay: WindowReplay,
    *,
    usual_micro_batches: int | None = None,
    random_forward: float | None = None,
) -> WindowAudit:
    """The verdict on the step the user's model and optimizer (``replay``'s) just took
    (their tensors read as they are now: call this before the run goes on).

    Args:
        window: the step's recorded window (its micro-batches' calls, the state before the step).
        replay: the window replayed as a run source, on the user's model, optimizer and loss.
        usual_micro_batches: the micro-batch count of the run's usual window, said in the verdict
            when this one's differs (None: not known).
        random_forward: how far the window's forward moves with torch's random seed, where its
            random numbers reach its output (:meth:`WindowReplay.seed_dependence`): the window is then
            inherently not equivalent (None: they do not, or it draws none).

    Returns:
        The window's :class:`WindowAudit`: within the allowance or not, the tensors past it, or
        why the window cannot equal its full batch (inherent non-equivalence).
    """
    working = next(iter(window.start_params.values())).dtype
    tier: Tier = "exact" if working == torch.float64 else "noise"
    items = tuple(int(replay.loss.count(replay.targets_of(call))) for call in window.calls)
    reasons = tuple(inherent_non_equivalences(replay.model))
    if not reasons and random_forward is not None:  # randomness no module names
        reasons = (random_forward_reason(random_forward),)
    if reasons:  # a replay would draw other dropout masks, or normalise by other statistics
        # (judged anyway, the floor samples' own draws would widen the allowance past a weighting bug)
        return WindowAudit(
            step=window.step,
            micro_batches=len(window.calls),
            items=items,
            tier=tier,
            mismatches=(),
            worst=None,
            usual_micro_batches=usual_micro_batches,
            inherent=reasons,
            hint=inherent_advice(replay.model, random_forward=random_forward is not None),
        )
    rows = _judged_rows(window, replay, working, tier)
    worst = max(rows, key=lambda row: row.ratio, default=None)
    mismatches = tuple(row for row in rows if not row.ok)
    return WindowAudit(
        step=window.step,
        micro_batches=len(window.calls),
        items=items,
        tier=tier,
        mismatches=mismatches,
        worst=worst,
        usual_micro_batches=usual_micro_batches,
        ranks=() if replay.ranks is None else _rank_verdicts(replay.ranks, mismatches, worst),
    )


def _judged_rows(window: RecordedWindow, replay: WindowReplay, working: torch.dtype, tier: Tier) -> list[TensorDiff]:
    """The rows of the user's step against the window's float64 full-batch replay, in ``tier``."""
    # The engine's floor plan over three roundings of the same mathematics: in order, in reverse,
    # normalised after backward, run only while the verdict depends on them (Judge.judge_tier, as a
    # check's): a window within half the roundoff term alone replays the float64 truth only.  Its worst
    # ratio is then an upper bound of the one every sample would give; the status is the same.
    if replay.ranks is not None:
        replay.ranks.step = window.step
    judge = Judge(replay.source(window), working=working, tiers=(tier,), roundings=_ROUNDINGS, steps=1)
    start, applied = _start(window), _named_snapshot(replay.model, replay.optimizer)

    def the_users_step(on_snapshot: OnSnapshot) -> None:
        """The step the user's code applied, as it stands (its tensors read again if a failing row is detailed)."""
        on_snapshot(0, start)
        on_snapshot(1, applied)

    # The ranks run each floor sample together (its replay sums gradients across them) while any one
    # still has a row past its allowance.
    return judge.judge_tier(tier, the_users_step, agree=None if replay.ranks is None else replay.ranks.any_of)


def _rank_verdicts(
    ranks: Ranks, mismatches: tuple[TensorDiff, ...], worst: TensorDiff | None
) -> tuple[RankVerdict, ...]:
    """Every rank's verdict on the window, gathered from all ranks (this rank's marked ``mine``)."""
    furthest = max(mismatches, key=lambda row: row.relative_error, default=None)
    gathered = ranks.gather(
        RankVerdict(
            rank=ranks.rank,
            equivalent=not mismatches,
            furthest=None if furthest is None else furthest.label,
            relative_error=0.0 if furthest is None else furthest.relative_error,
            worst_ratio=0.0 if worst is None else worst.ratio,
        )
    )
    return tuple(dataclasses.replace(rank, mine=rank.rank == ranks.rank) for rank in gathered)


def _named_snapshot(model: nn.Module, optimizer: torch.optim.Optimizer) -> Snapshot:
    """The user's state after its step, its own tensors lent (read at once): what this rank holds."""
    snapshot = state_snapshot(
        stepped_by_name(model, optimizer),
        {name: b for name, b in model.named_buffers() if b.is_floating_point()},
        optimizer,
        copy_tensors=False,
        state=torch_state(optimizer.inner if isinstance(optimizer, ZeroOptimizer) else optimizer),
    )
    return Snapshot(
        params={name: local(t) for name, t in snapshot.params.items()},
        buffers={name: local(t) for name, t in snapshot.buffers.items()},
        optimizer_state={name: local(t) for name, t in snapshot.optimizer_state.items()},
    )


def inherent_advice(model: nn.Module, *, random_forward: bool = False) -> str:
    """What to change so that a model whose windows are inherently not equivalent
    (:func:`~equiv.judging.inherent.inherent_non_equivalences`, or ``random_forward``: its
    forward draws random numbers no module names) can be audited: what the audit judges is
    the accumulation, which these layers do not change.  Not ``model.eval()``: the audit
    records training-mode calls only, and a trainer puts the model back in train mode
    (``model.train()``) each epoch or step."""
    from torch.nn.modules.batchnorm import _BatchNorm

    modules = list(model.modules())
    advice = []
    if random_forward:
        advice.append(
            "turn off the randomness of its training-mode forward for the audited run (a transformers model: "
            "its config's dropout and jitter fields, e.g. attention_dropout and router_jitter_noise, at 0.0)"
        )
    if any(
        isinstance(m, nn.modules.dropout._DropoutNd) or (isinstance(m, nn.MultiheadAttention) and m.dropout > 0)
        for m in modules
    ):
        advice.append(
            "turn dropout off for the audited run, which model.train() does not undo: "
            "for m in model.modules(): if isinstance(m, torch.nn.Dropout): m.p = 0.0 "
            "(a MultiheadAttention's m.dropout = 0.0; a transformers model: its config's dropout "
            "fields at 0.0), then audit it"
        )
    if any(isinstance(m, _BatchNorm) for m in modules):
        advice.append(
            "audit a run with its BatchNorm layers using running statistics (each m.eval() again "
            "after every model.train()), or with a per-sample norm (GroupNorm, LayerNorm)"
        )
    if len(advice) < 1:
        advice.append("audit a run without the layers named (or with their batch-wise part turned off)")
    return (
        "to audit this run: " + "; ".join(advice) + " (model.eval() would record nothing: the audit "
        "records training-mode calls)"
    )

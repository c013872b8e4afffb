"""The averaged copy of the weights a run keeps beside its model (an EMA, SWA),
checked by the audit: moved once per optimizer step, by its own rule.

A run that averages its weights updates the average after each optimizer
step (``ema.update_parameters(model)`` after ``optimizer.step()``).  Under
gradient accumulation the usual slip is to update it once per *micro-batch*:
the model's update is right, so every window of the model passes, while the
average moves N times per step, towards weights that did not change between
the moves (each extra move pulls it further: with decay 0.999 and 8
micro-batches, 8x the intended pull).  Counting its updates by the loop's
micro-steps instead of the optimizer's steps does the same on some steps and
skips others.

What the audit checks, per audited window that follows an optimizer step:
the average as it stands when the window's own optimizer step is taken must be
the average when the window began moved *once* by its rule towards the weights
of the step before (the model's weights at the window's start), nothing else.
The move is replayed by the engine as a run source
(:class:`~equiv.judging.judge.Judge`): in float64 (the truth) and in the
average's own dtype (the floor), so a difference smaller than the average's
own rounding is never flagged.  The rule is the averaged model's own: a
``torch.optim.swa_utils.AveragedModel`` is replayed by calling its own
``update_parameters`` on a copy (``get_ema_multi_avg_fn``, SWA's running mean,
any ``avg_fn``), a hand-written EMA named with its decay as
:class:`ExponentialAverage` by ``average = decay * average + (1 - decay) *
weight`` on each parameter.

The first window of an audit is not checked: whether the update for the
optimizer step just before the audit began was made before or after entering
is not known.  A window of the model that is not replayed (dropout) leaves its
average unchecked too.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.optim.swa_utils import AveragedModel

from equiv.judging.floors import IN_ORDER, Rounding
from equiv.judging.judge import Judge, OnSnapshot
from equiv.judging.runs import Snapshot
from equiv.results.verdict import TensorDiff, Tier

__all__ = ["AveragedWeights", "ExponentialAverage", "averaged_weights"]

#: Prefix of the averaged model's tensors in the window's rows ("the update of 'averaged:...'").
LABEL = "averaged:"


@dataclass(frozen=True, slots=True)
class ExponentialAverage:
    """A hand-written exponential moving average of the model's weights, for
    ``equiv.audit(..., averaged=ExponentialAverage(ema_model, decay=0.999))``:
    after each optimizer step the run sets ``p_ema = decay * p_ema + (1 - decay)
    * p`` for each parameter, ``ema_model``'s parameters named as the model's
    (a ``copy.deepcopy`` of it).  A ``torch.optim.swa_utils.AveragedModel`` is
    handed to the audit as it is."""

    module: nn.Module
    decay: float

    def __post_init__(self) -> None:
        if not isinstance(self.module, nn.Module):
            raise TypeError(
                f"ExponentialAverage.module must be the averaged copy of the model (an nn.Module), "
                f"got {type(self.module).__name__}"
            )
        if isinstance(self.decay, bool) or not isinstance(self.decay, (int, float)) or not 0 <= self.decay < 1:
            raise ValueError(
                f"ExponentialAverage.decay must be a number in [0, 1) (the weight kept of the average "
                f"at each update), got {self.decay!r}"
            )


#: The weights of the model at a window's start, as the replay rebuilds them: (dtype) -> a model in that dtype.
ModelAt = Callable[[torch.dtype], nn.Module]


class AveragedWeights:
    """The audit's watch of an averaged model: captures it when a window begins,
    judges its move when the window's optimizer step is taken."""

    def __init__(self, averaged: AveragedModel | ExponentialAverage, model: nn.Module) -> None:
        self.averaged = averaged
        self.module: nn.Module = averaged if isinstance(averaged, AveragedModel) else averaged.module
        own = dict(model.named_parameters())
        #: the averaged tensor names, and the model's parameter each follows (by name for an EMA)
        if isinstance(averaged, AveragedModel):
            if averaged.use_buffers:
                raise ValueError(
                    "equiv.audit checks an AveragedModel that averages parameters only "
                    "(use_buffers=False): with use_buffers=True its buffers are averaged too, which "
                    "the replay of the model's weights does not rebuild"
                )
            names = [name for name, _ in averaged.named_parameters()]
            if len(names) != len(own):
                raise ValueError(
                    f"the AveragedModel averages {len(names)} parameter tensors but the audited model "
                    f"has {len(own)}: build it from the model the audit watches"
                )
        else:
            names = [name for name, _ in averaged.module.named_parameters()]
            missing = sorted(set(own) - set(names))
            if missing or len(names) != len(own):
                raise ValueError(
                    f"the ExponentialAverage's module must have the model's parameters, by name (a "
                    f"copy.deepcopy of the model): missing {missing[:3]}, it has {len(names)} "
                    f"parameter tensors, the model {len(own)}"
                )
        self.names = names
        #: a copy to replay the rule on, made before the run moves it (an AveragedModel's own update)
        self._template = copy.deepcopy(averaged) if isinstance(averaged, AveragedModel) else None

    def capture(self) -> dict[str, Tensor]:
        """The averaged model's state now (detached copies): parameters, and an AveragedModel's count."""
        state = {name: tensor.detach().clone() for name, tensor in self.module.named_parameters()}
        if isinstance(self.averaged, AveragedModel):
            state["n_averaged"] = self.averaged.n_averaged.detach().clone()
        return state

    def rows_and_move(self, start: dict[str, Tensor], model_at: ModelAt) -> tuple[list[TensorDiff], str | None]:
        """The rows of the averaged model's move since ``start`` against one move by its
        rule towards the window-start weights (``model_at``), and what a failing one
        likely did (its count of updates, when it keeps one, or the moves its pull
        amounts to)."""
        working = next(iter(self.module.parameters())).dtype
        tier: Tier = "exact" if working == torch.float64 else "noise"
        begin = _snapshot({name: start[name] for name in self.names})

        def one_move(dtype: torch.dtype, rounding: Rounding, on_snapshot: OnSnapshot) -> None:
            on_snapshot(0, begin)
            on_snapshot(1, _snapshot(self._moved_once(start, model_at(dtype), dtype)))

        judge = Judge(one_move, working=working, tiers=(tier,), roundings=(IN_ORDER,), steps=1)
        now = _snapshot({name: tensor.detach() for name, tensor in self.module.named_parameters()})

        def the_runs_average(on_snapshot: OnSnapshot) -> None:
            on_snapshot(0, begin)
            on_snapshot(1, now)

        rows = judge.judge_tier(tier, the_runs_average)
        if all(row.ok for row in rows):
            return rows, None
        return rows, self._what_moved(start, model_at(torch.float64))

    def _moved_once(self, start: dict[str, Tensor], weights: nn.Module, dtype: torch.dtype) -> dict[str, Tensor]:
        """The averaged tensors after one update from ``start`` towards ``weights``, in ``dtype``."""
        if self._template is not None:
            replica = copy.deepcopy(self._template).to(dtype)
            with torch.no_grad():
                for name, tensor in replica.named_parameters():
                    tensor.copy_(start[name])
                replica.n_averaged.copy_(start["n_averaged"])
            replica.update_parameters(weights)
            return {name: tensor.detach() for name, tensor in replica.named_parameters()}
        assert isinstance(self.averaged, ExponentialAverage)
        decay, own = self.averaged.decay, dict(weights.named_parameters())
        return {name: start[name].to(dtype) * decay + own[name].detach() * (1 - decay) for name in self.names}

    def _what_moved(self, start: dict[str, Tensor], weights: nn.Module) -> str:
        """How many updates the average's move amounts to: counted by an AveragedModel, else
        estimated from the pull towards the weights (``1 - decay**m`` of the way for ``m`` moves)."""
        after = "after optimizer.step(), once per optimizer step (not per micro-batch)"
        if isinstance(self.averaged, AveragedModel):
            moves = int(self.averaged.n_averaged) - int(start["n_averaged"])
            return (
                f"the AveragedModel was updated {moves} time{'s' if moves != 1 else ''} in this window "
                f"(n_averaged {int(start['n_averaged'])} -> {int(self.averaged.n_averaged)}), where one "
                f"optimizer step means one update: call update_parameters {after}"
            )
        decay = self.averaged.decay
        own = dict(weights.named_parameters())
        pull = sum(float(((own[n].detach() - start[n].double()) ** 2).sum()) for n in self.names)
        moved = sum(
            float(((p.detach().double() - start[n].double()) * (own[n].detach() - start[n].double())).sum())
            for n, p in self.module.named_parameters()
        )
        share = moved / pull if pull > 0 else math.nan
        if 0 < share < 1 and decay > 0:
            estimate = f"moved as {math.log(1 - share) / math.log(decay):.3g} updates would, "
        else:
            estimate = f"moved {share:.3g} of the way to the weights (one update: {1 - decay:.3g}), "
        return f"the exponential average {estimate}where one optimizer step means one update: update it {after}"


def averaged_weights(averaged: AveragedModel | ExponentialAverage | None, model: nn.Module) -> AveragedWeights | None:
    """The audit's watch of ``averaged`` (None: none), refusing anything else by name.

    Args:
        averaged: what the run averages its weights into, or None.
        model: the audited model (the averaged one must follow its parameters).

    Returns:
        The watch, or None when ``averaged`` is None.
    """
    if averaged is None:
        return None
    if not isinstance(averaged, (AveragedModel, ExponentialAverage)):
        raise TypeError(
            f"averaged must be a torch.optim.swa_utils.AveragedModel or an "
            f"equiv.ExponentialAverage(ema_model, decay=...) for a hand-written EMA, got "
            f"{type(averaged).__name__}"
        )
    return AveragedWeights(averaged, model)


def _snapshot(params: dict[str, Tensor]) -> Snapshot:
    return Snapshot(params={LABEL + name: tensor for name, tensor in params.items()}, buffers={}, optimizer_state={})

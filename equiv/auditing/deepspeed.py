"""The audit under DeepSpeed: what it hooks and compares when ZeRO stages 1 and 2 step flat partitions, and the
engine's setting a failing window's witness points at.

At ZeRO 1 and 2 every rank holds the whole model, but ``engine.optimizer`` is DeepSpeed's
``DeepSpeedZeroOptimizer``, not a torch optimizer: its ``step()`` averages and clips the gradients, then calls
its inner optimizer (``FusedAdam``, a torch one…) once per parameter group over that group's flat fp32
partition, copies the partitions back into the model and all-gathers them.  The audit therefore

* hooks the ZeRO optimizer's own ``step`` (one event per optimizer step; the inner optimizer's would fire once
  per group), through :class:`ZeroOptimizer`, a view with the torch optimizer's hook methods;
* judges this rank's fp32 partitions and the inner optimizer's state of them: the truth is the window's float64
  full-batch gradient of the whole model (each rank its own micro-batches, summed by the audit's all-reduce, as
  under DDP), clipped on its global norm, cut into this rank's partitions by DeepSpeed's own layout
  (:class:`~equiv.distributed.deepspeed.ZeroLayout`), and stepped from the window-start partitions and state
  by the inner optimizer's torch equivalent: no rank ever holds optimizer state it did not already hold;
* keeps, for the witness, the gradient partition each group's inner step took (averaged and clipped by
  DeepSpeed), copied by a pre-step hook on the inner optimizer during audited windows only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from equiv.distributed.deepspeed import EngineSettings, ZeroLayout, is_zero_optimizer
from equiv.results.witness import NOT_A_REWEIGHTING, NOT_IDENTIFIABLE, UNEXPLAINED, Witness

__all__ = ["ZeroOptimizer", "deepspeed_setting_at_fault", "zero_view"]

Hook = Callable[[Any, tuple[Any, ...], dict[str, Any]], None]


class _Handle:
    def __init__(self, hooks: dict[int, Hook], key: int, on_empty: Callable[[], None]) -> None:
        self._hooks, self._key, self._on_empty = hooks, key, on_empty

    def remove(self) -> None:
        self._hooks.pop(self._key, None)
        self._on_empty()


class ZeroOptimizer(torch.optim.Optimizer):
    """DeepSpeed's ZeRO 1/2 optimizer as the audit hooks it (see the module's docstring).  A view: it holds no
    state of its own (``param_groups``, ``state`` and ``defaults`` are the inner optimizer's, over this rank's
    flat partitions) and never runs ``torch.optim.Optimizer.__init__``."""

    def __init__(self, zero: Any, model: nn.Module) -> None:  # no super().__init__: a view, as Accelerate's wrapper
        #: DeepSpeed's ZeRO optimizer, and the torch optimizer it steps each partition with
        self.zero, self.inner = zero, zero.optimizer
        #: where each parameter sits in the flat partitions
        self.layout = ZeroLayout(zero, model)
        self._pre: dict[int, Hook] = {}
        self._post: dict[int, Hook] = {}
        self._next = 0
        self._original: Callable[..., Any] | None = None
        self._own_step: Any = None
        #: the gradient partition each group's inner step took, while :attr:`capturing` (by partition name)
        self.gradients: dict[str, Tensor] = {}
        self.capturing = False
        self._inner_hook: Any = None
        #: each partition's name, by the tensor's identity (DeepSpeed keeps the same partition tensors for the run)
        self._names = {id(tensor): name for name, tensor in self.held().items()}

    # The inner optimizer's, read through (a view keeps nothing of its own).
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.inner.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        self.inner.param_groups = groups

    @property
    def state(self) -> Any:
        return self.inner.state

    @state.setter
    def state(self, value: Any) -> None:
        self.inner.state = value

    @property
    def defaults(self) -> dict[str, Any]:
        return self.inner.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.inner.defaults = value

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def held(self) -> dict[str, Tensor]:
        """This rank's fp32 partitions, by name: the tensors its optimizer steps (DeepSpeed's own, lent)."""
        return dict(zip(self.layout.names(), self.zero.single_partition_of_fp32_groups, strict=True))

    def register_step_pre_hook(self, hook: Hook) -> _Handle:  # type: ignore[override]  # a view's own handle
        return self._add(self._pre, hook)

    def register_step_post_hook(self, hook: Hook) -> _Handle:  # type: ignore[override]
        return self._add(self._post, hook)

    def _add(self, hooks: dict[int, Hook], hook: Hook) -> _Handle:
        if self._original is None:  # the ZeRO optimizer's step, wrapped on the instance (restored at the last remove)
            self._own_step = vars(self.zero).get("step")
            self._original = self.zero.step
            self.zero.step = self._step
            self._inner_hook = self.inner.register_step_pre_hook(self._capture)
        self._next += 1
        hooks[self._next] = hook
        return _Handle(hooks, self._next, self._restore_if_unhooked)

    def _restore_if_unhooked(self) -> None:
        if not self._pre and not self._post and self._original is not None:
            if self._own_step is not None:
                self.zero.step = self._own_step
            else:
                del self.zero.step  # the class's own step again, as before the audit
            self._original = None
            self._inner_hook.remove()

    def _step(self, *args: Any, **kwargs: Any) -> Any:
        assert self._original is not None
        for hook in list(self._pre.values()):
            hook(self, args, kwargs)
        self.gradients = {}
        result = self._original(*args, **kwargs)
        if getattr(self.zero, "overflow", False):  # DeepSpeed skipped the step (an fp16 overflow): no update
            return result
        for hook in list(self._post.values()):
            hook(self, args, kwargs)
        return result

    def _capture(self, inner: Any, args: Any, kwargs: Any) -> None:
        """Each group's inner step: the gradient partition it takes (DeepSpeed's averaged, clipped one)."""
        if not self.capturing:
            return
        names = self._names
        for group in inner.param_groups:  # DeepSpeed hands its inner optimizer one group at a time
            for param in group["params"]:
                if id(param) in names and param.grad is not None:
                    self.gradients[names[id(param)]] = param.grad.detach().clone()


def zero_view(optimizer: Any, model: nn.Module) -> ZeroOptimizer | None:
    """``optimizer`` (or the ZeRO optimizer in its ``.optimizer`` chain: Accelerate's and transformers' wrappers)
    as the audit hooks it, when it is DeepSpeed's ZeRO 1/2 optimizer; None otherwise.

    Raises:
        ValueError: DeepSpeed's ZeRO stage 3 optimizer (its parameters are partitioned too).
    """
    seen = optimizer
    for _ in range(8):
        stage = is_zero_optimizer(seen)
        if stage == 3:
            raise ValueError(
                "equiv.audit replays DeepSpeed ZeRO stages 0, 1 and 2; this engine runs ZeRO stage 3 (parameters "
                "partitioned across the ranks), which it does not yet: audit the same loop at ZeRO stage 2"
            )
        if stage:
            return ZeroOptimizer(seen, model)
        seen = getattr(seen, "optimizer", None)
        if seen is None:
            return None
    return None


def deepspeed_setting_at_fault(engine: EngineSettings) -> Callable[[Witness], str | None]:
    """The engine's setting a failing window's witness points at: where the witness names a normaliser, the
    loss the engine needed (its ``engine.backward`` divides every micro-batch's loss by the accumulation steps
    and its reduction averages over the data-parallel ranks, so the full batch's loss is each micro-batch's
    item-loss sum over the window's global item count, times both)."""
    steps, ranks = engine.gradient_accumulation_steps, engine.data_parallel

    def at_fault(found: Witness) -> str | None:
        if found.normaliser in (UNEXPLAINED, NOT_A_REWEIGHTING, NOT_IDENTIFIABLE):
            return None
        return (
            f"DeepSpeed's engine.backward divided each micro-batch's loss by gradient_accumulation_steps={steps} "
            f"(scale_wrt_gas) and its reduction averaged the gradients over {ranks} rank{'s' if ranks != 1 else ''}: "
            "the full batch's loss is each micro-batch's item-loss sum over the window's item count on every rank, "
            f"times {ranks * steps} ({ranks} ranks x {steps} steps; or engine.backward(loss, scale_wrt_gas=False) "
            f"and times {ranks})"
        )

    return at_fault

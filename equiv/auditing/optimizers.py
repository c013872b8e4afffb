"""The optimizer the audit hooks, from what the user holds.

Users hold their optimizer as their trainer hands it back: Accelerate's
``AcceleratedOptimizer`` (``accelerator.prepare(optimizer)``; a subclass of
``torch.optim.Optimizer`` that never runs its ``__init__``, so it has no hooks of
its own), Lightning's ``LightningOptimizer`` (``self.optimizers()``), or any
object keeping the torch optimizer as ``.optimizer``.  The audit hooks the torch
optimizer inside (unwrapped repeatedly, a bounded number of times) and says once
which wrapper it unwrapped.  A wrapper that skips ``step()`` during accumulation
micro-steps (Accelerate's, under ``accelerator.accumulate``) then shows the audit
only the real steps, as the full-batch run takes them.

An optimizer whose ``step`` needs a closure (``torch.optim.LBFGS``) re-evaluates the
loss several times per step: there is no one update from the accumulated gradient to
compare with a full-batch step.  It is refused when the audit is made, with the
reason ``equiv check`` gives (:data:`equiv.cases.case.UNSUPPORTED_OPTIMIZERS`), not
from inside its first step.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import torch

from equiv.cases.case import UNSUPPORTED_OPTIMIZERS

__all__ = ["MAX_WRAPPERS", "audited_optimizer", "closure_required"]

#: How many wrappers deep the audit looks for the torch optimizer (a loop of ``.optimizer``
#: references, or a chain this deep, is not an optimizer wrapper).
MAX_WRAPPERS = 8


def _is_torch_optimizer(value: Any) -> bool:
    """A torch optimizer the hooks can be set on: a ``torch.optim.Optimizer`` that ran its own
    ``__init__``.  An ``AcceleratedOptimizer`` is an ``Optimizer`` subclass that did not, a
    ``LightningOptimizer`` makes itself one (a subclass of its optimizer's class, every attribute
    looked up on the optimizer inside): neither holds the hooks in its own ``__dict__``."""
    return isinstance(value, torch.optim.Optimizer) and "_optimizer_step_pre_hooks" in vars(value)


def audited_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer the audit hooks: ``optimizer`` itself, or the one inside its
    wrappers (``.optimizer``, repeatedly, up to :data:`MAX_WRAPPERS` deep), said once in a
    ``UserWarning`` naming the wrapper and the optimizer inside.

    Raises:
        TypeError: ``optimizer`` is neither a torch optimizer nor a wrapper of one (named, with
            its type), or a learning-rate scheduler (the optimizer it schedules is named).
    """
    if _is_torch_optimizer(optimizer):
        return optimizer
    _refuse_a_scheduler(optimizer)
    chain = [optimizer]
    while len(chain) <= MAX_WRAPPERS:
        inner = getattr(chain[-1], "optimizer", None)
        if inner is None or any(inner is seen for seen in chain):
            break
        chain.append(inner)
        if _is_torch_optimizer(inner):
            wrappers = " in ".join(_wrapper_name(wrapper) for wrapper in reversed(chain[:-1]))
            warnings.warn(
                f"equiv audit: auditing the {type(inner).__name__} inside the {wrappers} given (its "
                "steps are the optimizer steps; a wrapper's step() that skips it, as Accelerate's does "
                "during accumulation micro-steps, is not one)",
                UserWarning,
                stacklevel=4,
            )
            return inner
    found = type(optimizer).__name__
    inside = f" (its .optimizer chain ends at a {type(chain[-1]).__name__})" if len(chain) > 1 else ""
    raise TypeError(
        f"optimizer must be a torch.optim.Optimizer, or a wrapper holding one as .optimizer "
        f"(Accelerate's AcceleratedOptimizer, Lightning's LightningOptimizer), got a {found}{inside}"
    )


def _wrapper_name(wrapper: Any) -> str:
    """A wrapper's class as its library names it: ``LightningOptimizer`` for the ``LightningSGD`` it
    makes itself (the first class of its MRO that is not an optimizer), else its own class."""
    return next(
        (
            wrapper_class.__name__
            for wrapper_class in type(wrapper).__mro__
            if wrapper_class is not object and not issubclass(wrapper_class, torch.optim.Optimizer)
        ),
        type(wrapper).__name__,
    )


def _refuse_a_scheduler(value: Any) -> None:
    """A learning-rate scheduler handed where the optimizer goes holds ``.optimizer`` too: refused,
    naming the optimizer to pass (a scheduler's steps are not the optimizer's)."""
    from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

    inner = getattr(value, "scheduler", None)  # Accelerate's AcceleratedScheduler wraps one
    if isinstance(value, (LRScheduler, ReduceLROnPlateau)) or isinstance(inner, (LRScheduler, ReduceLROnPlateau)):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer, got a {type(value).__name__}, a learning-rate "
            "scheduler: pass the optimizer it schedules (the audit follows the scheduler itself)"
        )


def closure_required(optimizer: torch.optim.Optimizer) -> str | None:
    """Why the audit cannot judge ``optimizer``'s steps when its ``step`` needs a closure
    (``LBFGS``: the loss re-evaluated several times per step), in ``equiv check``'s words; else None."""
    try:
        closure = inspect.signature(type(optimizer).step).parameters.get("closure")
    except (TypeError, ValueError):  # a step without a signature: its steps are judged as they come
        return None
    if closure is None or closure.default is not inspect.Parameter.empty:
        return None
    return UNSUPPORTED_OPTIMIZERS.get(type(optimizer).__name__) or (
        "its step(closure) needs a closure that re-evaluates the loss inside the step, not one update from the "
        "accumulated gradient"
    )

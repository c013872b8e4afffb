"""The MindSpore tutorials' accumulation patterns, ported to PyTorch faithfully.

Ported from MindSpore's public tutorials: the r1.0 / r1.3 single-device
gradient-accumulation tutorial
(https://gitee.com/mindspore/docs/blob/r1.0/tutorials/training/source_en/advanced_use/apply_gradient_accumulation.md,
https://gitee.com/mindspore/docs/blob/r1.3/docs/mindspore/programming_guide/source_zh_cn/apply_gradient_accumulation.md)
and the MindSpore 2.0 gradient-accumulation notebook
(https://obs.dualstack.cn-north-4.myhuaweicloud.com/mindspore-website/notebook/modelarts/mindspore_apply_gradient_accumulation.ipynb).
Their behaviour is kept, bugs and all;
the docstrings say where the port reads each rule from.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from equiv.zoo.adapters._state import PerRun, describe

__all__ = ["MindSporeAccumulator", "MindSporeGradientAccumulation"]

Batches = list[tuple[Tensor, Tensor]]


def _gradients(model: nn.Module, loss: Tensor) -> list[Tensor]:
    params = [p for p in model.parameters() if p.requires_grad]
    return list(torch.autograd.grad(loss, params, allow_unused=True, materialize_grads=True))


def _apply(optimizer: torch.optim.Optimizer, model: nn.Module, grads: list[Tensor]) -> None:
    """``optimizer(grads)`` in MindSpore: step with the given gradients."""
    params = [p for p in model.parameters() if p.requires_grad]
    for param, grad in zip(params, grads, strict=True):
        param.grad = grad.clone()
    optimizer.step()
    for param in params:
        param.grad = None


class _PortedLoop:
    """A tutorial loop that sees one mini-batch at a time and keeps its state
    (a counter, a gradient buffer) across windows and, in ``run_epochs``, across
    epochs, as the tutorial's own loop does."""

    def __init__(self) -> None:
        self._run = PerRun()

    def _configured_steps(self) -> int | None:
        raise NotImplementedError

    def _start(self, model: nn.Module) -> None:
        raise NotImplementedError

    def _epoch_start(self) -> None:
        """What the tutorial's loop resets when an epoch starts (nothing by default)."""

    def _mini_batch(self, model: nn.Module, optimizer: torch.optim.Optimizer, batch: tuple[Tensor, Tensor],
                    loss_fn: Callable[..., Tensor], steps: int) -> None:
        raise NotImplementedError

    def __call__(self, model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: Batches,
                 loss_fn: Callable[..., Tensor]) -> None:
        if self._run.is_new(model):
            self._start(model)
        for batch in micro_batches:
            self._mini_batch(model, optimizer, batch, loss_fn, self._configured_steps() or len(micro_batches))

    def run_epochs(self, model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: Batches,
                   loss_fn: Callable[..., Tensor], *, epochs: int) -> None:
        """The tutorial's loop over ``epochs`` passes of ``micro_batches``."""
        self._start(model)
        for _ in range(epochs):
            self._epoch_start()
            for batch in micro_batches:
                self._mini_batch(model, optimizer, batch, loss_fn, self._configured_steps() or len(micro_batches))


class MindSporeGradientAccumulation(_PortedLoop):
    """r1.0 / r1.3 ``GradientAccumulation``: ``TrainForwardBackward`` adds each
    mini-batch's gradient of its MEAN loss (``sens=1.0``) into ``grad_sum``;
    ``train_process`` calls ``TrainOptim`` (``optimizer(grad_sum)``) and
    ``TrainClear`` when ``(k + 1) % mini_steps == 0``, ``k`` counting mini-batches
    through the epoch.  Nothing divides by ``mini_steps``: an unscaled sum.
    ``run_epochs`` follows the tutorial's ``train_process``
    (https://www.mindspore.cn/tutorial/training/en/r1.0/advanced_use/apply_gradient_accumulation.html)::

        for i in range(epoch):
            step = 0
            for k, next_element in enumerate(dataset_helper):
                loss = self._train_forward_backward(*next_element)
                if (k + 1) % mini_steps == 0:
                    step += 1
                    ...
                    self._train_optim()
                    self._train_clear()

    so ``k`` restarts each epoch while ``grad_sum`` keeps an epoch's partial window.

    ``mini_steps`` None: the number of micro-batches in the window.
    """

    def __init__(self, mini_steps: int | None = None) -> None:
        if mini_steps is not None and mini_steps < 1:
            raise ValueError(f"mini_steps must be a positive int or None, got {mini_steps!r}")
        super().__init__()
        self.mini_steps = mini_steps
        self._k = 0
        self._grad_sum: list[Tensor] = []

    def _start(self, model: nn.Module) -> None:
        self._k = 0
        self._grad_sum = [torch.zeros_like(p) for p in model.parameters() if p.requires_grad]

    def _mini_batch(self, model: nn.Module, optimizer: torch.optim.Optimizer, batch: tuple[Tensor, Tensor],
                    loss_fn: Callable[..., Tensor], mini_steps: int) -> None:
        inputs, targets = batch
        grads = _gradients(model, loss_fn(model(inputs), targets))
        torch._foreach_add_(self._grad_sum, grads)  # _cumulative_gard: AssignAdd(grad_sum, grad)
        if (self._k + 1) % mini_steps == 0:
            _apply(optimizer, model, self._grad_sum)  # TrainOptim
            torch._foreach_zero_(self._grad_sum)  # TrainClear
        self._k += 1

    def _configured_steps(self) -> int | None:
        return self.mini_steps

    def _epoch_start(self) -> None:
        # ``for k, next_element in enumerate(dataset_helper)``: k restarts, grad_sum is not cleared,
        # so an epoch's partial window leaks into the next epoch's first window.
        self._k = 0

    def __repr__(self) -> str:
        return describe("MindSporeGradientAccumulation", mini_steps=self.mini_steps)


class MindSporeAccumulator(_PortedLoop):
    """2.0 notebook ``Accumulator``: ``forward_fn`` returns ``loss /
    accumulate_step``; ``__call__(grads)`` adds into ``inner_grads`` and, when
    ``counter % accumulate_step == 0`` (``counter`` starts at 1), calls
    ``optimizer(inner_grads)`` and clears them; then ``counter += 1``.  Its
    ``clip_norm`` argument (default 1.0) is stored but never applied.

    ``accumulate_step`` None: the number of micro-batches in the window.
    """

    def __init__(self, accumulate_step: int | None = None, clip_norm: float = 1.0) -> None:
        if accumulate_step is not None and accumulate_step < 1:
            raise ValueError(f"accumulate_step must be a positive int or None, got {accumulate_step!r}")
        self.accumulate_step = accumulate_step
        self.clip_norm = clip_norm  # kept, as in the notebook, and never used
        super().__init__()
        self._counter = 1
        self._inner_grads: list[Tensor] = []

    def _start(self, model: nn.Module) -> None:
        self._counter = 1
        self._inner_grads = [torch.zeros_like(p) for p in model.parameters() if p.requires_grad]

    def _mini_batch(self, model: nn.Module, optimizer: torch.optim.Optimizer, batch: tuple[Tensor, Tensor],
                    loss_fn: Callable[..., Tensor], accumulate_step: int) -> None:
        inputs, targets = batch
        loss = loss_fn(model(inputs), targets) / accumulate_step  # "loss除以累加步数"
        torch._foreach_add_(self._inner_grads, _gradients(model, loss))
        if self._counter % accumulate_step == 0:
            _apply(optimizer, model, self._inner_grads)
            torch._foreach_zero_(self._inner_grads)
        self._counter += 1

    def _configured_steps(self) -> int | None:
        # ``counter`` is a Parameter of the Accumulator, never reset: windows run across epochs.
        return self.accumulate_step

    def __repr__(self) -> str:
        return describe("MindSporeAccumulator", accumulate_step=self.accumulate_step)

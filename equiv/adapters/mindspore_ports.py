"""The MindSpore tutorials' accumulation patterns, ported to PyTorch faithfully.

Ported from MindSpore's public tutorials: the r1.0 / r1.3 single-device
gradient-accumulation tutorial
(https://gitee.com/mindspore/docs/blob/r1.0/tutorials/training/source_en/advanced_use/apply_gradient_accumulation.md,
https://gitee.com/mindspore/docs/blob/r1.3/docs/mindspore/programming_guide/source_zh_cn/apply_gradient_accumulation.md)
and its parallel-mode loss-scale cell (same r1.3 page,
https://www.mindspore.cn/docs/programming_guide/zh-CN/r1.3/apply_gradient_accumulation.html),
the MindSpore 2.0 gradient-accumulation notebook
(https://obs.dualstack.cn-north-4.myhuaweicloud.com/mindspore-website/notebook/modelarts/mindspore_apply_gradient_accumulation.ipynb),
and the r2.6 distributed tutorial's ``mindspore.parallel.nn.GradAccumulation``
(https://www.mindspore.cn/tutorials/zh-CN/r2.6.0/parallel/distributed_gradient_accumulation.html)
as MindSpore v2.6.0's own source trains it.
Their behaviour is kept, bugs and all;
the docstrings say where the port reads each rule from, and what is inferred.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from equiv.adapters.state import PerRun, UnsupportedWindow, describe
from equiv.batches import MicroBatches

__all__ = [
    "MindSporeAccuStepsWithLossScale",
    "MindSporeAccumulator",
    "MindSporeGradAccumulation",
    "MindSporeGradientAccumulation",
]


def _gradients(model: nn.Module, loss: Tensor) -> list[Tensor]:
    params = [p for p in model.parameters() if p.requires_grad]
    return list(torch.autograd.grad(loss, params, allow_unused=True, materialize_grads=True))


def _positive_or_none(name: str, value: int | None) -> int | None:
    """A tutorial's step count: a positive int, or None for the window's micro-batch count."""
    if value is not None and value < 1:
        raise ValueError(f"{name} must be a positive int or None, got {value!r}")
    return value


def _set_grads(model: nn.Module, grads: list[Tensor]) -> list[nn.Parameter]:
    """The trainable parameters, each given (a copy of) its gradient in ``grads``."""
    params = [p for p in model.parameters() if p.requires_grad]
    for param, grad in zip(params, grads, strict=True):
        param.grad = grad.clone()
    return params


def _apply(optimizer: torch.optim.Optimizer, model: nn.Module, grads: list[Tensor]) -> None:
    """``optimizer(grads)`` in MindSpore: step with the given gradients."""
    params = _set_grads(model, grads)
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

    def _mini_batch(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        batch: tuple[Tensor, Tensor],
        loss_fn: Callable[..., Tensor],
        steps: int,
    ) -> None:
        raise NotImplementedError

    def __call__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        micro_batches: MicroBatches,
        loss_fn: Callable[..., Tensor],
    ) -> None:
        if self._run.is_new(model):
            self._start(model)
        for batch in micro_batches:
            self._mini_batch(model, optimizer, batch, loss_fn, self._configured_steps() or len(micro_batches))

    def run_epochs(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        micro_batches: MicroBatches,
        loss_fn: Callable[..., Tensor],
        *,
        epochs: int,
    ) -> None:
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
        super().__init__()
        self.mini_steps = _positive_or_none("mini_steps", mini_steps)
        self._k = 0
        self._grad_sum: list[Tensor] = []

    def _start(self, model: nn.Module) -> None:
        self._k = 0
        self._grad_sum = [torch.zeros_like(p) for p in model.parameters() if p.requires_grad]

    def _mini_batch(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        batch: tuple[Tensor, Tensor],
        loss_fn: Callable[..., Tensor],
        mini_steps: int,
    ) -> None:
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
        self.accumulate_step = _positive_or_none("accumulate_step", accumulate_step)
        self.clip_norm = clip_norm  # kept, as in the notebook, and never used
        super().__init__()
        self._counter = 1
        self._inner_grads: list[Tensor] = []

    def _start(self, model: nn.Module) -> None:
        self._counter = 1
        self._inner_grads = [torch.zeros_like(p) for p in model.parameters() if p.requires_grad]

    def _mini_batch(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        batch: tuple[Tensor, Tensor],
        loss_fn: Callable[..., Tensor],
        accumulate_step: int,
    ) -> None:
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


def _all_finite(grads: list[Tensor]) -> bool:
    return all(bool(torch.isfinite(g).all()) for g in grads)


class MindSporeAccuStepsWithLossScale(_PortedLoop):
    """r1.3 parallel mode, ``TrainAccuStepsWithLossScaleCell`` driven by the
    tutorial's ``Model_ACCU``: the overflow flag ORed over the window, the
    whole window skipped and the loss scale updated once per window.

    Read from the r1.3 tutorial's parallel-mode section
    (https://www.mindspore.cn/docs/programming_guide/zh-CN/r1.3/apply_gradient_accumulation.html,
    source https://gitee.com/mindspore/docs/blob/r1.3/docs/mindspore/programming_guide/source_zh_cn/apply_gradient_accumulation.md)::

        scaling_sens_filled = ops.ones_like(loss) * ops.cast(scaling_sens, ops.dtype(loss))
        grads = self.grad(self.network, weights)(*inputs, scaling_sens_filled)
        if self.accumulation and self.accumulation_steps > 1:
            accu_succ = self.hyper_map(update_accu_grads, self.accu_grads, grads)
        overflow = self.get_overflow_status(status, grads)
        overflow = self.logical_or(self.not_equal(self.accu_overflow, self.zero), overflow)
        accu_overflow = self.select(overflow, self.one, self.zero)
        if self.accumulation:
            succ = False
            self.accu_overflow = accu_overflow
        else:
            self.accu_overflow = self.zero
            grads = self.grad_reducer(grads)
            grads = self.hyper_map(ops.partial(_grad_scale, scaling_sens), grads)
            ...  # accu_grads reset; overflow = process_loss_scale(overflow)
            if overflow:
                succ = False
            else:
                succ = self.optimizer(grads)

    and ``Model_ACCU``, which runs the accumulation graph (``accumulation=True``)
    for ``grad_accumulation_step - 1`` micro-steps, then the update graph
    (``accumulation=False``) for one.  Here micro-batch ``k`` (counted across
    windows, as the alternation is) is an update step when
    ``(k + 1) % accumulation_steps == 0``.

    Inferred, not in the tutorial's Python: the update step's ``grads`` already
    carry the window's earlier micro-batches.  The tutorial says the names
    ``accumulation`` and ``accu_grads`` are special because the framework's
    graph optimisation completes the accumulation; the backward of MindSpore's
    ``_MirrorMiniStepOperator`` (``mindspore/ops/_grad/grad_comm_ops.py``,
    https://github.com/mindspore-ai/mindspore/blob/ec9793861f5e2304637c3a363d847f78c9350297/mindspore/ops/_grad/grad_comm_ops.py;
    read at that commit, not at the r1.3 tag) does ``assign_add(z, dout)``
    then ``all_reduce(z)``, times ``1 / dev_num`` under ``gradients_mean``:
    the accumulated gradient plus this one, averaged over devices only.
    Nothing divides by ``grad_accumulation_step``, and ``sens`` is the loss
    scale alone: one device sums the window's mean-loss gradients, unscaled by N.

    ``grad_scaler`` stands in for the ``DynamicLossScaleUpdateCell`` passed as
    ``scale_sense`` (the scale read once per micro-batch, updated once per
    window by ``process_loss_scale``); None: a fixed ``scale_sense`` Tensor of
    1.0, never updated, an overflowing window still skipped.  The skip is
    decided by the ORed flag, not by the summed gradient.  No epoch loop is
    ported (``Model_ACCU`` sinks the dataset in alternating chunks of N - 1
    and 1 steps); ``accumulation_steps`` None: the window's micro-batch count.
    """

    def __init__(self, accumulation_steps: int | None = None) -> None:
        super().__init__()
        self.accumulation_steps = _positive_or_none("accumulation_steps", accumulation_steps)
        self._k = 0
        self._accu_grads: list[Tensor] = []
        self._accu_overflow = False
        self._scaler: torch.amp.GradScaler | None = None

    def _configured_steps(self) -> int | None:
        return self.accumulation_steps

    def _start(self, model: nn.Module) -> None:
        self._k = 0
        self._accu_grads = [torch.zeros_like(p) for p in model.parameters() if p.requires_grad]
        self._accu_overflow = False

    def __call__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        micro_batches: MicroBatches,
        loss_fn: Callable[..., Tensor],
        *,
        grad_scaler: torch.amp.GradScaler | None = None,
    ) -> None:
        self._scaler = grad_scaler
        super().__call__(model, optimizer, micro_batches, loss_fn)

    def _mini_batch(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        batch: tuple[Tensor, Tensor],
        loss_fn: Callable[..., Tensor],
        steps: int,
    ) -> None:
        inputs, targets = batch
        loss = loss_fn(model(inputs), targets)
        # sens = scaling_sens_filled: the gradient of the loss times the current scale (read each micro-step).
        grads = _gradients(model, self._scaler.scale(loss) if self._scaler is not None else loss)
        overflow = not _all_finite(grads) or self._accu_overflow  # logical_or(accu_overflow != 0, overflow)
        if (self._k + 1) % steps != 0:  # accumulation graph
            torch._foreach_add_(self._accu_grads, grads)  # update_accu_grads
            self._accu_overflow = overflow
        else:  # update graph
            self._accu_overflow = False
            window = list(
                torch._foreach_add(self._accu_grads, grads)
            )  # _MirrorMiniStepOperator: assign_add, all_reduce
            torch._foreach_zero_(self._accu_grads)  # reset_accu_grads, whether or not the window overflowed
            self._update(optimizer, model, window, overflow)
        self._k += 1

    def _update(self, optimizer: torch.optim.Optimizer, model: nn.Module, grads: list[Tensor], overflow: bool) -> None:
        if self._scaler is None:
            # A fixed scale_sense of 1.0: process_loss_scale leaves it; an overflow still skips the step.
            if not overflow:
                _apply(optimizer, model, grads)
            return
        params = _set_grads(model, grads)
        if overflow and _all_finite(grads):
            # The ORed flag decides, as in the cell; GradScaler reads overflow from the gradients,
            # so it is told through them (an overflowing micro-batch already made them non-finite).
            first = params[0].grad
            assert first is not None
            first.fill_(float("inf"))
        self._scaler.step(optimizer)  # unscale (_grad_scale); skip if overflow
        self._scaler.update()  # process_loss_scale: once per window
        optimizer.zero_grad(set_to_none=True)

    def __repr__(self) -> str:
        return describe("MindSporeAccuStepsWithLossScale", accumulation_steps=self.accumulation_steps)


class MindSporeGradAccumulation:
    """r2.6 ``mindspore.parallel.nn.GradAccumulation(network, micro_size)``
    trained with ``Model.train``, as the r2.6 tutorial does
    (https://www.mindspore.cn/tutorials/zh-CN/r2.6.0/parallel/distributed_gradient_accumulation.html,
    source https://gitee.com/mindspore/docs/blob/r2.6.0/tutorials/source_zh_cn/parallel/distributed_gradient_accumulation.md)::

        net = GradAccumulation(nn.WithLossCell(net, loss_fn), 4)
        model = ms.Model(net, optimizer=optimizer)

    Read from MindSpore's v2.6.0 source (the ``v2.6.0`` tag of the GitHub
    mirror https://github.com/mindspore-ai/mindspore_test):

    - ``GradAccumulation.construct``
      (https://github.com/mindspore-ai/mindspore_test/blob/v2.6.0/mindspore/python/mindspore/parallel/nn/parallel_cell_wrapper.py):
      for ``i in range(micro_size)`` the network's output (the slice's MEAN
      loss) on ``_MicroBatch`` slice ``i``, outputs added: ``ret = add(ret, output)``.
    - ``_MicroBatch.construct``
      (https://github.com/mindspore-ai/mindspore_test/blob/v2.6.0/mindspore/python/mindspore/nn/wrap/cell_wrapper.py):
      slice ``i`` is rows ``(n // micro_size) * i`` to ``(n // micro_size) * (i + 1)``,
      and ``n % micro_size != 0`` raises ``ValueError`` ("the 0th dimension shape
      of input(n) must be divided by micro size(m)").  So ``micro_size`` is the
      NUMBER of slices, whatever the docs' "MicroBatch size" suggests, and the
      window's own split is not used: the batch is re-cut into equal slices.
    - ``build_train_network`` (``mindspore/python/mindspore/train/amp.py``):
      ``_is_grad_accumulation`` matches a cell named ``GradAccumulation`` and
      wraps the network in ``_TrainGradAccuStepCell(network, optimizer)``, or,
      with a ``loss_scale_manager`` whose update cell is set, in
      ``_TrainGradAccuWithLossScaleCell``.
    - ``_TrainGradAccuStepCell`` (``cell_wrapper.py``): ``sens`` None, so
      ``self.sens = 1 / micro_size`` (from the first cell with a ``micro_size``)
      and the optimizer gets ``grad_scale(self.sens, accu_grads)`` = the summed
      gradient times ``1 / micro_size``: the mean of the equal slices' means.
    - ``_TrainGradAccuWithLossScaleCell``
      (https://github.com/mindspore-ai/mindspore_test/blob/v2.6.0/mindspore/python/mindspore/nn/wrap/loss_scale.py):
      ``sens`` is the loss scale alone and ``grad_scale`` multiplies
      ``accu_grads`` by ``reciprocal(scale)``; no ``1 / micro_size``: the
      summed gradient, ``micro_size`` times the mean.  One overflow flag for
      the whole backward; ``loss_scaling_manager(scale_sense, cond)`` once;
      ``if not overflow: self.optimizer(grads)``.

    Inferred: ``accu_grads`` holds the sum over the slices of their
    gradients (the graph pass ``AddVirtualAssignAdd`` that fills it, in C++,
    was read by name only); here one backward of ``ret`` gives that sum.
    ``grad_scaler`` stands in for the ``loss_scale_manager`` (None: Model
    without one).  No state outlives a call, so no epoch loop is ported.
    ``micro_size`` None: the window's micro-batch count.
    """

    def __init__(self, micro_size: int | None = None) -> None:
        self.micro_size = _positive_or_none("micro_size", micro_size)

    def __call__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        micro_batches: MicroBatches,
        loss_fn: Callable[..., Tensor],
        *,
        grad_scaler: torch.amp.GradScaler | None = None,
    ) -> None:
        micro_size = self.micro_size or len(micro_batches)
        # The dataset's mini-batch: GradAccumulation sees the whole batch and cuts it itself.
        inputs = torch.cat([x for x, _ in micro_batches])
        targets = torch.cat([t for _, t in micro_batches])
        rows = inputs.shape[0]
        if rows % micro_size != 0:
            raise UnsupportedWindow(
                f"For micro batch initialization, the 0th dimension shape of input({rows}) "
                f"must be divided by micro size({micro_size})"
            )
        width = rows // micro_size
        ret: Tensor | None = None
        for i in range(micro_size):
            output = loss_fn(model(inputs[width * i : width * (i + 1)]), targets[width * i : width * (i + 1)])
            ret = output if ret is None else ret + output  # self.add_list[i](ret, output)
        assert ret is not None
        if grad_scaler is None:
            grads = _gradients(model, ret)  # grad_no_sens: sens 1
            sens = 1 / micro_size  # _TrainGradAccuStepCell: self.sens = 1 / micro_size
            _apply(optimizer, model, [sens * g for g in grads])  # grad_scale(self.sens, accu_grads)
            return
        # _TrainGradAccuWithLossScaleCell: sens = the scale, grads * reciprocal(scale), no 1 / micro_size.
        optimizer.zero_grad(set_to_none=True)
        grad_scaler.scale(ret).backward()
        grad_scaler.step(optimizer)  # if not overflow: self.optimizer(grads)
        grad_scaler.update()  # loss_scaling_manager(scale_sense, cond), once
        optimizer.zero_grad(set_to_none=True)

    def __repr__(self) -> str:
        return describe("MindSporeGradAccumulation", micro_size=self.micro_size)

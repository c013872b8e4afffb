"""One optimizer step done three ways, and how its memory and time are measured.

* ``native``: the plain loop users write, ``(loss_sum / total_items).backward()``
  per micro-batch, gradients summed in ``.grad``;
* ``accumulator``: :class:`equiv.Accumulator`;
* ``checkpoint``: the native loop with every block of a
  :class:`~equiv.cost.workloads.BlockNet` activation-checkpointed.

:func:`prepare_step` builds and warms one up; :class:`PreparedStep` measures
its peak memory per phase (:mod:`equiv.cost.memory`) and times it.  The
benchmarks and the planner both measure through here.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from equiv.accumulator import Accumulator
from equiv.batches import Batch, MicroBatches, even_sizes, split_batch
from equiv.cost.memory import StepMemory, measure_step_memory, training_state_tensors
from equiv.cost.workloads import BlockNet, CountItems, LossSum, Workload, build_workload_model

__all__ = [
    "IMPLEMENTATIONS",
    "PreparedStep",
    "StepMeasurement",
    "StepOptions",
    "TrainStep",
    "default_optimizer",
    "make_train_step",
    "measure_step",
    "prepare_step",
    "prepare_workload_step",
    "synchronize",
]

#: The ways one optimizer step is done (see :func:`make_train_step`).
IMPLEMENTATIONS = ("native", "accumulator", "checkpoint")


def default_optimizer(params: Any) -> torch.optim.Optimizer:
    """AdamW with PyTorch's defaults: the optimizer whose step peak matters most."""
    return torch.optim.AdamW(params, lr=1e-3)


def _count_samples(targets: torch.Tensor) -> int:
    return int(targets.shape[0])


@dataclass(frozen=True, slots=True, kw_only=True)
class StepOptions:
    """How a measured step is done: the loss, what it counts, the optimizer,
    the implementation and the device.  Shared by every step of a plan or a
    benchmark, so they all measure the same thing."""

    loss_sum: LossSum
    #: Items the summed loss is over (default: samples).
    count_items: CountItems = _count_samples
    optimizer_factory: Callable[[Any], torch.optim.Optimizer] = default_optimizer
    implementation: str = "accumulator"
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    def __post_init__(self) -> None:
        if self.implementation not in IMPLEMENTATIONS:
            raise ValueError(f"unknown implementation {self.implementation!r}; expected one of {IMPLEMENTATIONS}")
        object.__setattr__(self, "device", torch.device(self.device))


@dataclass(frozen=True, slots=True)
class TrainStep:
    """One optimizer step in two phases, so memory can be measured per phase."""

    #: Every micro-batch forward and backward; gradients end up summed.
    accumulate: Callable[[], None]
    #: The optimizer step, gradients cleared.
    update: Callable[[], None]

    def __call__(self) -> None:
        self.accumulate()
        self.update()


def make_train_step(
    implementation: str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: Sequence[Batch],
    loss_sum: LossSum,
    count_items: CountItems,
) -> TrainStep:
    """One step over ``micro_batches`` done by ``implementation``:

    * ``native``: the plain loop users write, ``(loss_sum / total_items).backward()``
      per micro-batch (exact for uneven splits too), then ``optimizer.step()``
      and ``zero_grad(set_to_none=True)``;
    * ``accumulator``: :class:`~equiv.accumulator.Accumulator`, ``backward(loss_sum,
      items=n)`` per micro-batch and one ``step()``;
    * ``checkpoint``: the native loop with every block of a :class:`BlockNet`
      checkpointed (meant for N=1: checkpointing instead of accumulating).
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"unknown implementation {implementation!r}; expected one of {IMPLEMENTATIONS}")
    if implementation == "checkpoint":
        if not isinstance(model, BlockNet):
            raise ValueError(f"implementation 'checkpoint' needs a BlockNet to checkpoint, got {type(model).__name__}")
        model.checkpoint_blocks = True

    if implementation == "accumulator":
        acc = Accumulator(model, optimizer)

        def accumulate() -> None:
            for inputs, targets in micro_batches:
                acc.backward(loss_sum(model(inputs), targets), items=count_items(targets))

        def update() -> None:
            acc.step()

        return TrainStep(accumulate, update)

    # The native loop needs the window's total up front; counting is cheap.
    total_items = sum(count_items(targets) for _, targets in micro_batches)

    def accumulate_native() -> None:
        for inputs, targets in micro_batches:
            (loss_sum(model(inputs), targets) / total_items).backward()

    def update_native() -> None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return TrainStep(accumulate_native, update_native)


def synchronize(device: torch.device | str) -> None:
    """Wait for queued CUDA work, so a timer or a memory read sees all of it."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True, slots=True)
class PreparedStep:
    """A warmed-up train step with everything it touches, ready to measure."""

    step: TrainStep
    model: nn.Module
    optimizer: torch.optim.Optimizer
    micro_batches: MicroBatches
    device: torch.device

    @property
    def micro_batch_size(self) -> int:
        """The largest micro-batch: the one that sets the forward/backward peak."""
        return max(int(inputs.shape[0]) for inputs, _ in self.micro_batches)

    def measure_memory(self) -> StepMemory:
        """Peak memory of one more step (see :func:`equiv.cost.memory.measure_step_memory`)."""
        roots = [*training_state_tensors(self.model, self.optimizer)]
        roots += [t for pair in self.micro_batches for t in pair]
        return measure_step_memory(self.step.accumulate, self.step.update, roots=roots, device=self.device)

    def time_steps(self, repeats: int) -> list[float]:
        """Seconds of each of ``repeats`` steps, synchronised on CUDA."""
        return [sum(phases) for phases in self.time_phases(repeats)]

    def time_phases(self, repeats: int) -> list[tuple[float, float]]:
        """(accumulate, update) seconds of each of ``repeats`` steps, synchronised on CUDA."""
        seconds: list[tuple[float, float]] = []
        for _ in range(repeats):
            synchronize(self.device)
            start = time.perf_counter()
            self.step.accumulate()
            synchronize(self.device)
            middle = time.perf_counter()
            self.step.update()
            synchronize(self.device)
            seconds.append((middle - start, time.perf_counter() - middle))
        return seconds


def prepare_step(model: nn.Module, batch: Batch, n_micro_batches: int, options: StepOptions) -> PreparedStep:
    """Move ``model`` (trained in place) and ``batch`` to the options' device,
    cut the batch into ``n_micro_batches`` as even as possible, and run one
    warm-up step: it creates the optimizer state (static memory in steady
    training, so it must exist before a measurement) and warms every
    micro-batch shape."""
    device = options.device
    model = model.to(device)
    optimizer = options.optimizer_factory(model.parameters())
    inputs, targets = batch[0].to(device), batch[1].to(device)
    micro_batches = split_batch((inputs, targets), even_sizes(int(inputs.shape[0]), n_micro_batches))
    step = make_train_step(
        options.implementation, model, optimizer, micro_batches, options.loss_sum, options.count_items
    )
    step()
    synchronize(device)
    return PreparedStep(step, model, optimizer, micro_batches, device)


def prepare_workload_step(
    workload: Workload, n_micro_batches: int, implementation: str, device: torch.device | str = "cpu", *, seed: int = 0
) -> PreparedStep:
    """A workload's step at ``n_micro_batches``, ready to measure: fresh weights
    and the fixed global batch drawn from ``seed`` (so every implementation
    and N of one run trains the same model on the same data)."""
    batch = workload.make_batch(workload.global_batch_size, torch.Generator().manual_seed(seed))
    model = build_workload_model(workload, seed=seed)
    options = StepOptions(
        loss_sum=workload.loss_sum,
        count_items=workload.count_items,
        implementation=implementation,
        device=torch.device(device),
    )
    return prepare_step(model, batch, n_micro_batches, options)


@dataclass(frozen=True, slots=True, kw_only=True)
class StepMeasurement:
    n_micro_batches: int
    micro_batch_size: int
    memory: StepMemory
    #: Seconds of each timed step (empty when repeats == 0).
    step_seconds: list[float]

    @property
    def median_step_seconds(self) -> float:
        return statistics.median(self.step_seconds)


def measure_step(
    model: nn.Module, batch: Batch, n_micro_batches: int, options: StepOptions, *, repeats: int = 3
) -> StepMeasurement:
    """Peak memory and step times of ``model`` (a copy: the caller's weights
    are not touched) over ``batch`` cut into ``n_micro_batches``."""
    prepared = prepare_step(copy.deepcopy(model), batch, n_micro_batches, options)
    return StepMeasurement(
        n_micro_batches=n_micro_batches,
        micro_batch_size=prepared.micro_batch_size,
        memory=prepared.measure_memory(),
        step_seconds=prepared.time_steps(repeats),
    )

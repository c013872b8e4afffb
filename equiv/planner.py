"""Pick the number of micro-batches N: the fastest that fits a memory budget.

:func:`plan` measures a few *small* micro-batches of the user's model (the
largest N, which need the least memory, so no trial can run out of memory
before the budget is known to be reachable), fits :mod:`equiv.costmodel`'s
two lines, predicts every candidate N, and then measures the one it
recommends to confirm the prediction.  ``equiv plan`` is the same from the
command line.

This module also holds what the benchmarks and the planner both run:

* :data:`WORKLOADS`, three models with a fixed global batch (activation-heavy
  transformer, parameter-heavy MLP, convolutional net), named on the command
  line by their key;
* :func:`make_train_step`, one optimizer step done three ways: the plain
  native loop (``loss / total`` per micro-batch, gradients summed in
  ``.grad``), :class:`equiv.accumulator.Accumulator`, and activation
  checkpointing (``torch.utils.checkpoint``), the alternative users reach for.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import re
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from equiv.accumulator import Accumulator
from equiv.costmodel import MemoryModel, MemoryPoint, MicroStepPoint, TimeModel, fit_memory, fit_micro_steps
from equiv.losses import CrossEntropy, TokenCrossEntropy
from equiv.memory import StepMemory, measure_step_memory, training_state_tensors

__all__ = [
    "IMPLEMENTATIONS",
    "WORKLOADS",
    "NothingFitsError",
    "Plan",
    "PlanRow",
    "PreparedStep",
    "TrainStep",
    "Workload",
    "build_workload_model",
    "make_train_step",
    "measure_step",
    "plan",
    "prepare_step",
    "register_cli",
    "split_batch",
]

Batch = tuple[Tensor, Tensor]
LossSum = Callable[[Tensor, Tensor], Tensor]
CountItems = Callable[[Tensor], int]

#: The ways one optimizer step is done (see :func:`make_train_step`).
IMPLEMENTATIONS = ("native", "accumulator", "checkpoint")


# --------------------------------------------------------------------- models
class BlockNet(nn.Module):
    """stem -> blocks -> head, where each block can be activation-checkpointed:
    its activations are dropped after the forward pass and recomputed in backward."""

    def __init__(self, stem: nn.Module, blocks: Sequence[nn.Module], head: nn.Module) -> None:
        super().__init__()
        self.stem = stem
        self.blocks = nn.ModuleList(blocks)
        self.head = head
        self.checkpoint_blocks = False

    def forward(self, x: Tensor) -> Tensor:
        h = self.stem(x)
        for block in self.blocks:
            # use_reentrant=False: the variant PyTorch recommends, works with any input.
            h = checkpoint(block, h, use_reentrant=False) if self.checkpoint_blocks else block(h)
        return self.head(h)


class _TokenStem(nn.Module):
    def __init__(self, vocab_size: int, width: int, seq_len: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, width)
        self.position = nn.Parameter(torch.randn(seq_len, width) * 0.02)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.embed(tokens) + self.position


@dataclass(frozen=True, slots=True, kw_only=True)
class Workload:
    """A model, how to draw its global batch, and its summed loss."""

    name: str
    description: str
    global_batch_size: int
    build: Callable[[], BlockNet]
    make_batch: Callable[[int, torch.Generator], Batch]
    loss_sum: LossSum
    #: Items the summed loss is over (samples, or tokens): the normaliser.
    count_items: CountItems


def _transformer() -> Workload:
    vocab, width, seq_len, layers = 128, 64, 64, 2

    def build() -> BlockNet:
        # dropout=0: a benchmark must do the same work every round.
        blocks = [
            nn.TransformerEncoderLayer(
                width,
                nhead=4,
                dim_feedforward=4 * width,
                dropout=0.0,
                activation="gelu",
                batch_first=True,
                norm_first=True,
            )
            for _ in range(layers)
        ]
        head = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, vocab))
        return BlockNet(_TokenStem(vocab, width, seq_len), blocks, head)

    def make_batch(size: int, generator: torch.Generator) -> Batch:
        tokens = torch.randint(0, vocab, (size, seq_len + 1), generator=generator)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    return Workload(
        name="transformer",
        description=f"{layers} pre-norm transformer layers, width {width}, {seq_len} tokens, vocabulary {vocab}",
        global_batch_size=64,
        build=build,
        make_batch=make_batch,
        loss_sum=TokenCrossEntropy().sum,
        count_items=lambda targets: targets.numel(),  # no padding: every token counts
    )


def _mlp() -> Workload:
    width, classes = 1024, 10

    def build() -> BlockNet:
        blocks = [nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(2)]
        return BlockNet(nn.Identity(), blocks, nn.Linear(width, classes))

    def make_batch(size: int, generator: torch.Generator) -> Batch:
        return torch.randn(size, width, generator=generator), torch.randint(0, classes, (size,), generator=generator)

    return Workload(
        name="mlp",
        description=f"MLP {width}-{width}-{width}-{classes}, ReLU (2.1M parameters)",
        global_batch_size=256,
        build=build,
        make_batch=make_batch,
        loss_sum=CrossEntropy().sum,
        count_items=lambda targets: targets.shape[0],
    )


def _convnet() -> Workload:
    classes = 10

    def conv_block(c_in: int, c_out: int) -> nn.Module:
        return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))

    def build() -> BlockNet:
        blocks = [conv_block(3, 16), conv_block(16, 32), conv_block(32, 64)]
        return BlockNet(nn.Identity(), blocks, nn.Sequential(nn.Flatten(), nn.Linear(64 * 4 * 4, classes)))

    def make_batch(size: int, generator: torch.Generator) -> Batch:
        images = torch.randn(size, 3, 32, 32, generator=generator)
        return images, torch.randint(0, classes, (size,), generator=generator)

    return Workload(
        name="convnet",
        description="3 conv-ReLU-maxpool blocks (16, 32, 64 channels) on 3x32x32 images",
        global_batch_size=64,
        build=build,
        make_batch=make_batch,
        loss_sum=CrossEntropy().sum,
        count_items=lambda targets: targets.shape[0],
    )


WORKLOADS: dict[str, Workload] = {w.name: w for w in (_transformer(), _mlp(), _convnet())}


def build_workload_model(workload: Workload, *, seed: int = 0, device: torch.device | str = "cpu") -> BlockNet:
    """The workload's model with weights drawn from ``seed`` (global RNG untouched)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = workload.build()
    return model.to(device)


# ---------------------------------------------------------------- train steps
def split_batch(batch: Batch, n_micro_batches: int) -> list[Batch]:
    """Cut a batch into ``n_micro_batches`` consecutive pieces as even as
    possible (the first ``B % N`` get one more sample), as views."""
    inputs, targets = batch
    size = inputs.shape[0]
    if not 1 <= n_micro_batches <= size:
        raise ValueError(f"n_micro_batches must be in 1..{size} (the batch size), got {n_micro_batches}")
    return list(zip(inputs.tensor_split(n_micro_batches), targets.tensor_split(n_micro_batches), strict=True))


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


def default_optimizer(params: Any) -> torch.optim.Optimizer:
    """AdamW with PyTorch's defaults: the optimizer whose step peak matters most."""
    return torch.optim.AdamW(params, lr=1e-3)


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
    micro_batches: list[Batch]
    device: torch.device

    @property
    def micro_batch_size(self) -> int:
        """The largest micro-batch: the one that sets the forward/backward peak."""
        return max(int(inputs.shape[0]) for inputs, _ in self.micro_batches)

    def measure_memory(self) -> StepMemory:
        """Peak memory of one more step (see :func:`equiv.memory.measure_step_memory`)."""
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


def prepare_step(
    model: nn.Module,
    batch: Batch,
    n_micro_batches: int,
    *,
    loss_sum: LossSum,
    count_items: CountItems,
    implementation: str = "accumulator",
    optimizer_factory: Callable[[Any], torch.optim.Optimizer] = default_optimizer,
    device: torch.device | str = "cpu",
) -> PreparedStep:
    """Move ``model`` (trained in place) and ``batch`` to ``device``, cut the
    batch into ``n_micro_batches``, and run one warm-up step: it creates the
    optimizer state (static memory in steady training, so it must exist before
    a measurement) and warms every micro-batch shape."""
    device = torch.device(device)
    model = model.to(device)
    optimizer = optimizer_factory(model.parameters())
    micro_batches = split_batch((batch[0].to(device), batch[1].to(device)), n_micro_batches)
    step = make_train_step(implementation, model, optimizer, micro_batches, loss_sum, count_items)
    step()
    synchronize(device)
    return PreparedStep(step, model, optimizer, micro_batches, device)


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
    model: nn.Module,
    batch: Batch,
    n_micro_batches: int,
    *,
    loss_sum: LossSum,
    count_items: CountItems,
    implementation: str = "accumulator",
    optimizer_factory: Callable[[Any], torch.optim.Optimizer] = default_optimizer,
    device: torch.device | str = "cpu",
    repeats: int = 3,
) -> StepMeasurement:
    """Peak memory and step times of ``model`` (a copy: the caller's weights
    are not touched) over ``batch`` cut into ``n_micro_batches``."""
    prepared = prepare_step(
        copy.deepcopy(model),
        batch,
        n_micro_batches,
        loss_sum=loss_sum,
        count_items=count_items,
        implementation=implementation,
        optimizer_factory=optimizer_factory,
        device=device,
    )
    return StepMeasurement(
        n_micro_batches=n_micro_batches,
        micro_batch_size=prepared.micro_batch_size,
        memory=prepared.measure_memory(),
        step_seconds=prepared.time_steps(repeats),
    )


# ------------------------------------------------------------------- planning
@dataclass(frozen=True, slots=True, kw_only=True)
class PlanRow:
    """One candidate N: what the fit predicts, and what was measured if it ran."""

    n_micro_batches: int
    micro_batch_size: int
    predicted_peak_bytes: float
    predicted_samples_per_s: float
    #: Measured peak within the budget where measured (probe or full step), else predicted within it less the margin.
    fits: bool
    #: Peak of a probe at this micro-batch size (two micro-batches: the same peak as any N >= 2 window).
    probed_peak_bytes: int | None = None
    #: Figures of the whole step at this N, measured to confirm the recommendation.
    measured_peak_bytes: int | None = None
    measured_forward_backward_peak_bytes: int | None = None
    measured_optimizer_step_peak_bytes: int | None = None
    measured_samples_per_s: float | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """The recommended N and everything it was decided from."""

    global_batch_size: int
    memory_budget_bytes: int
    device: str
    #: None when no N whose micro-batch was tried fits (see rows).
    recommended_n: int | None
    rows: list[PlanRow]
    memory_model: MemoryModel
    time_model: TimeModel
    #: Micro-batch sizes probed, in the order they ran (smallest first).
    probed_micro_batch_sizes: list[int] = field(default_factory=list)

    @property
    def recommended(self) -> PlanRow | None:
        return next((r for r in self.rows if r.n_micro_batches == self.recommended_n), None)

    def to_dict(self) -> dict[str, Any]:
        return {
            "global_batch_size": self.global_batch_size,
            "memory_budget_bytes": self.memory_budget_bytes,
            "device": self.device,
            "recommended_n": self.recommended_n,
            "probed_micro_batch_sizes": self.probed_micro_batch_sizes,
            "memory_model": self.memory_model.to_dict(),
            "time_model": self.time_model.to_dict(),
            "rows": [asdict(r) for r in self.rows],
        }


class NothingFitsError(ValueError):
    """Not even the smallest micro-batch's step fits the memory budget."""


def default_candidates(global_batch_size: int) -> list[int]:
    """Powers of two up to the batch size, and the batch size itself (N = B: one sample each)."""
    candidates = [1 << k for k in range(global_batch_size.bit_length()) if 1 << k <= global_batch_size]
    return sorted({*candidates, global_batch_size})


def resize_batch(batch: Batch, size: int) -> Batch:
    """Repeat the example batch's rows (cyclically) to ``size`` rows."""
    inputs, targets = batch
    if inputs.shape[0] == 0 or inputs.shape[0] != targets.shape[0]:
        raise ValueError(
            f"example batch needs >= 1 sample and as many targets as inputs, got "
            f"{inputs.shape[0]} inputs and {targets.shape[0]} targets"
        )
    index = torch.arange(size) % inputs.shape[0]
    return inputs[index], targets[index]


@dataclass(frozen=True, slots=True)
class _Probe:
    memory: StepMemory
    point: MicroStepPoint
    #: Micro-batches in the probe's window: 2, or 1 when the micro-batch is the whole batch (N=1).
    window: int


def plan(
    model: nn.Module,
    batch: Batch,
    *,
    global_batch_size: int,
    memory_budget_bytes: int,
    loss_sum: LossSum | None = None,
    count_items: CountItems | None = None,
    optimizer_factory: Callable[[Any], torch.optim.Optimizer] = default_optimizer,
    device: torch.device | str = "cpu",
    candidates: Sequence[int] | None = None,
    probes: int = 4,
    repeats: int = 3,
    safety_margin: float = 0.05,
) -> Plan:
    """Recommend the fastest N whose step fits ``memory_budget_bytes``.

    ``batch`` is an example (inputs, targets); its rows are repeated to
    ``global_batch_size``.  ``loss_sum`` defaults to summed cross-entropy for
    integer targets and summed squared error for float targets.

    How, without a trial beyond the budget's reach:

    1. *Probe* micro-batch sizes, smallest first, each as a window of two
       micro-batches (the forward/backward peak of any N >= 2 window depends
       only on the micro-batch, and two micro-steps are cheap), timing the
       micro-steps and the optimizer update apart.  The two smallest come
       first; then the largest size the memory line predicts to fit (at least
       ``safety_margin`` below the budget) and one between, up to ``probes``.
       A probe over budget rules its size out and the line is refitted.
    2. Predict every candidate N from the fitted lines and take the fastest
       that fits; run its whole step to confirm (measured peak and samples/s).
    """
    if global_batch_size < 1:
        raise ValueError(f"global_batch_size must be >= 1, got {global_batch_size}")
    if memory_budget_bytes <= 0:
        raise ValueError(f"memory_budget_bytes must be > 0, got {memory_budget_bytes}")
    if not 0 <= safety_margin < 1:
        raise ValueError(f"safety_margin must be in [0, 1), got {safety_margin}")
    if probes < 2:
        raise ValueError(f"probes must be >= 2 (a line needs two points), got {probes}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1 (the time line needs a timing), got {repeats}")
    candidates = sorted(set(candidates if candidates is not None else default_candidates(global_batch_size)))
    bad = [n for n in candidates if not 1 <= n <= global_batch_size]
    if bad:
        raise ValueError(f"candidates must be in 1..{global_batch_size} (the global batch size), got {bad}")
    size_of = {n: _micro_batch_size(global_batch_size, n) for n in candidates}
    sizes = sorted(set(size_of.values()))
    if len(sizes) < 2:
        raise ValueError(f"candidates {candidates} give fewer than 2 micro-batch sizes; nothing to fit")
    loss_sum = loss_sum or _default_loss_sum(batch[1])
    count_items = count_items or (lambda targets: int(targets.shape[0]))
    full_batch = resize_batch(batch, global_batch_size)
    device = torch.device(device)
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda[:index]', got {str(device)!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(device)!r} asked for, but torch.cuda.is_available() is False")
    allowed_bytes = memory_budget_bytes * (1 - safety_margin)
    options: dict[str, Any] = {
        "loss_sum": loss_sum,
        "count_items": count_items,
        "optimizer_factory": optimizer_factory,
        "device": device,
    }

    probed: dict[int, _Probe] = {}

    def probe(m: int) -> _Probe:
        # Two micro-batches of m (one when m is the whole batch: that is N=1 exactly).
        k = 2 if 2 * m <= global_batch_size else 1
        window = (full_batch[0][: k * m], full_batch[1][: k * m])
        prepared = prepare_step(copy.deepcopy(model), window, k, **options)
        memory = prepared.measure_memory()
        phases = prepared.time_phases(repeats)
        probed[m] = _Probe(
            memory,
            window=k,
            point=MicroStepPoint(
                micro_batch_size=m,
                # The fastest repeat: load from other processes only ever adds
                # time, and one slow probe would tilt the whole line.
                micro_step_seconds=min(a for a, _ in phases) / k,
                update_seconds=min(u for _, u in phases),
            ),
        )
        return probed[m]

    smallest = probe(sizes[0])
    if smallest.memory.peak_bytes > memory_budget_bytes:
        raise NothingFitsError(
            f"no N fits: even micro-batch {sizes[0]} (N={max(candidates)}) peaks at "
            f"{smallest.memory.peak_bytes} bytes > budget {memory_budget_bytes} bytes "
            f"(optimizer step alone: {smallest.memory.optimizer_step_peak_bytes} bytes)"
        )
    probe(sizes[1])
    while len(probed) < probes:
        memory_model = _fit_memory(probed)
        fitting = [m for m in sizes if _fits_or_predicted(m, probed, memory_model, memory_budget_bytes, allowed_bytes)]
        unprobed = [m for m in fitting if m not in probed]
        if not unprobed:
            break
        if unprobed[-1] > max(probed):
            probe(unprobed[-1])  # the largest size predicted to fit: the likely pick
        else:
            # One between the small probes and the largest that fits, so the time line spans the range.
            middle = math.sqrt(sizes[1] * max(m for m in probed if m in fitting))
            probe(min(unprobed, key=lambda m: abs(math.log(m / middle))))

    recommended: int | None = None
    confirmed: dict[int, StepMeasurement] = {}
    while True:
        memory_model = _fit_memory(probed)
        time_model = fit_micro_steps([p.point for p in probed.values()])
        feasible = [
            n
            for n in candidates
            if n not in confirmed
            and _fits_or_predicted(size_of[n], probed, memory_model, memory_budget_bytes, allowed_bytes)
        ]
        if not feasible:
            break
        best = max(feasible, key=lambda n: (time_model.samples_per_s(n, global_batch_size), -n))
        confirmed[best] = measure_step(model, full_batch, best, repeats=repeats, **options)
        if confirmed[best].memory.peak_bytes <= memory_budget_bytes:
            recommended = best
            break

    rows = []
    for n in candidates:
        m = size_of[n]
        full = confirmed.get(n)
        fit_ok = _fits_or_predicted(m, probed, memory_model, memory_budget_bytes, allowed_bytes)
        rows.append(
            PlanRow(
                n_micro_batches=n,
                micro_batch_size=m,
                predicted_peak_bytes=memory_model.peak_bytes(m),
                predicted_samples_per_s=time_model.samples_per_s(n, global_batch_size),
                fits=full.memory.peak_bytes <= memory_budget_bytes if full else fit_ok,
                probed_peak_bytes=probed[m].memory.peak_bytes if m in probed else None,
                measured_peak_bytes=full.memory.peak_bytes if full else None,
                measured_forward_backward_peak_bytes=full.memory.forward_backward_peak_bytes if full else None,
                measured_optimizer_step_peak_bytes=full.memory.optimizer_step_peak_bytes if full else None,
                measured_samples_per_s=global_batch_size / full.median_step_seconds if full else None,
            )
        )
    return Plan(
        global_batch_size=global_batch_size,
        memory_budget_bytes=memory_budget_bytes,
        device=str(device),
        recommended_n=recommended,
        rows=rows,
        memory_model=memory_model,
        time_model=time_model,
        probed_micro_batch_sizes=list(probed),
    )


def _micro_batch_size(global_batch_size: int, n: int) -> int:
    return -(-global_batch_size // n)  # ceil: the largest piece sets the peak


def _fits_or_predicted(
    m: int, probed: dict[int, _Probe], memory_model: MemoryModel, budget_bytes: int, allowed_bytes: float
) -> bool:
    """Measured where probed (exact), predicted with the margin elsewhere."""
    if m in probed:
        return probed[m].memory.peak_bytes <= budget_bytes
    return memory_model.peak_bytes(m) <= allowed_bytes


def _fit_memory(probed: dict[int, _Probe]) -> MemoryModel:
    """The memory line through the two-micro-batch probes.  An N=1 probe has no
    gradient temporary (backward's gradients become ``.grad`` directly), so it
    would bend the line: it is left out while two others exist."""
    windows = {m: p for m, p in probed.items() if p.window == 2}
    chosen = windows if len(windows) >= 2 else probed
    return fit_memory(
        [
            MemoryPoint(
                micro_batch_size=m,
                forward_backward_peak_bytes=p.memory.forward_backward_peak_bytes,
                optimizer_step_peak_bytes=p.memory.optimizer_step_peak_bytes,
            )
            for m, p in sorted(chosen.items())
        ]
    )


def _default_loss_sum(targets: Tensor) -> LossSum:
    if targets.is_floating_point():
        return lambda output, target: torch.nn.functional.mse_loss(output, target, reduction="sum")

    def cross_entropy_sum(output: Tensor, target: Tensor) -> Tensor:
        # (batch, ..., classes) against (batch, ...): flatten all but the class dim.
        return torch.nn.functional.cross_entropy(output.flatten(0, -2), target.flatten(), reduction="sum")

    return cross_entropy_sum


# ------------------------------------------------------------------------ CLI
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_bytes(text: str) -> int:
    """'512MiB', '1.5GB', '1000000' -> bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(
            f"memory budget must be a number with an optional unit among B, KB, MB, GB, KiB, MiB, GiB; got {text!r}"
        )
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def load_plan_target(spec: str) -> tuple[nn.Module, Batch, LossSum | None, CountItems | None, int | None]:
    """A built-in workload name, or ``MODULE:FUNC`` / ``path/to/file.py:FUNC``
    where ``FUNC()`` returns ``(model, (inputs, targets))`` or
    ``(model, (inputs, targets), loss_sum)``.  Returns the model, the example
    batch, the loss and item count (None: defaults) and a default global batch."""
    from equiv.cli import UsageError, load_target  # the CLI's loader: same spec rules everywhere

    if spec in WORKLOADS:
        workload = WORKLOADS[spec]
        generator = torch.Generator().manual_seed(0)
        return (
            build_workload_model(workload),
            workload.make_batch(workload.global_batch_size, generator),
            workload.loss_sum,
            workload.count_items,
            workload.global_batch_size,
        )
    if ":" not in spec:
        raise UsageError(f"target must be a built-in workload {sorted(WORKLOADS)} or MODULE:FUNC, got {spec!r}")
    func = load_target(spec)
    try:
        result = func()
    except Exception as exc:  # the user's code: say which call failed, keep the cause
        raise UsageError(f"{spec}() raised {type(exc).__name__}: {exc}") from exc
    if not (isinstance(result, tuple) and len(result) in (2, 3) and isinstance(result[0], nn.Module)):
        raise UsageError(
            f"{spec}() must return (model, (inputs, targets)[, loss_sum]) with an nn.Module first, "
            f"got {type(result).__name__}"
        )
    model, batch = result[0], result[1]
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2 and all(isinstance(t, Tensor) for t in batch)):
        raise UsageError(f"{spec}(): the batch must be (inputs, targets) tensors, got {type(batch).__name__}")
    return model, (batch[0], batch[1]), (result[2] if len(result) == 3 else None), None, None


def register_cli(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``plan`` to an argparse subparsers object; its ``handler(args) -> int`` runs it."""
    parser = subparsers.add_parser(
        "plan",
        help="recommend the number of micro-batches N for a memory budget",
        description="Measure a few micro-batch sizes, fit memory and time, and recommend the "
        "fastest N whose step fits the budget (no trial beyond the budget's reach).",
    )
    parser.add_argument(
        "target",
        help=f"a built-in workload ({', '.join(sorted(WORKLOADS))}) or MODULE:FUNC "
        "returning (model, (inputs, targets)[, loss_sum])",
    )
    parser.add_argument("--budget", type=parse_bytes, required=True, help="memory budget, e.g. 256MiB or 8GB")
    parser.add_argument(
        "--global-batch-size",
        type=int,
        default=None,
        help="samples per optimizer step (default: the workload's, or the example batch's size)",
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:index] (default: cpu)")
    parser.add_argument(
        "--candidates",
        type=lambda s: [int(x) for x in s.split(",")],
        default=None,
        help="comma-separated N to consider (default: powers of two up to the batch)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per measured N (default: 3)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads for the measurement")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.set_defaults(handler=run_plan_command)
    return parser


def run_plan_command(args: argparse.Namespace) -> int:
    """Exit 0 with a recommendation, 1 when no N fits the budget; bad input
    raises ``equiv.cli.UsageError`` (exit 2)."""
    from equiv.cli import UsageError

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    model, batch, loss_sum, count_items, default_batch = load_plan_target(args.target)
    global_batch_size = args.global_batch_size or default_batch or int(batch[0].shape[0])
    try:
        result = plan(
            model,
            batch,
            global_batch_size=global_batch_size,
            memory_budget_bytes=args.budget,
            loss_sum=loss_sum,
            count_items=count_items,
            device=args.device,
            candidates=args.candidates,
            repeats=args.repeats,
        )
    except NothingFitsError as exc:
        print(f"equiv plan: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(format_plan(result))
    return 0 if result.recommended_n is not None else 1


def format_plan(result: Plan) -> str:
    """The plan as a table a person reads: predicted and measured, per N."""
    mib = 2**20
    memory, timing = result.memory_model, result.time_model

    def mib_or_dash(value: float | None) -> str:
        return f"{value / mib:.2f}" if value is not None else "-"

    lines = [
        f"global batch {result.global_batch_size}, budget {result.memory_budget_bytes / mib:.1f} MiB, "
        + f"device {result.device}; probed micro-batches {result.probed_micro_batch_sizes}",
        f"memory model: peak = max({memory.static_bytes / mib:.2f} MiB + "
        + f"{memory.activation_bytes_per_sample / mib * 1024:.1f} KiB x micro-batch, "
        + f"optimizer step {memory.optimizer_step_peak_bytes / mib:.2f} MiB)",
        f"time model: step = N x {timing.seconds_per_micro_step * 1e3:.2f} ms + "
        + f"B x {timing.seconds_per_sample * 1e6:.1f} us + update {timing.seconds_per_update * 1e3:.2f} ms",
        "",
        f"{'N':>5} {'micro':>6} {'pred MiB':>9} {'probe MiB':>9} {'step MiB':>9} "
        + f"{'pred samples/s':>15} {'meas samples/s':>15}  fits",
    ]
    for row in result.rows:
        measured_rate = f"{row.measured_samples_per_s:.0f}" if row.measured_samples_per_s is not None else "-"
        marker = "  <- recommended" if row.n_micro_batches == result.recommended_n else ""
        lines.append(
            f"{row.n_micro_batches:>5} {row.micro_batch_size:>6} {row.predicted_peak_bytes / mib:>9.2f} "
            f"{mib_or_dash(row.probed_peak_bytes):>9} {mib_or_dash(row.measured_peak_bytes):>9} "
            f"{row.predicted_samples_per_s:>15.0f} {measured_rate:>15}  {'yes' if row.fits else 'no'}{marker}"
        )
    if result.recommended_n is None:
        lines.append("no N fits the budget: every candidate was measured or predicted over it")
    return "\n".join(lines)

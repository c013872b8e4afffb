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
import importlib
import json
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
from equiv.costmodel import MemoryModel, MemoryPoint, TimeModel, TimePoint, fit_memory, fit_time
from equiv.losses import CrossEntropy, TokenCrossEntropy
from equiv.memory import StepMemory, measure_step_memory, training_state_tensors

__all__ = [
    "IMPLEMENTATIONS",
    "WORKLOADS",
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
        seconds: list[float] = []
        for _ in range(repeats):
            synchronize(self.device)
            start = time.perf_counter()
            self.step()
            synchronize(self.device)
            seconds.append(time.perf_counter() - start)
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
    fits: bool
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
    #: None when not even the smallest micro-batch fits the budget.
    recommended_n: int | None
    rows: list[PlanRow]
    memory_model: MemoryModel
    time_model: TimeModel
    #: Candidates measured, in the order they ran (smallest micro-batches first).
    measured_n: list[int] = field(default_factory=list)

    @property
    def recommended(self) -> PlanRow | None:
        return next((r for r in self.rows if r.n_micro_batches == self.recommended_n), None)

    def to_dict(self) -> dict[str, Any]:
        return {
            "global_batch_size": self.global_batch_size,
            "memory_budget_bytes": self.memory_budget_bytes,
            "device": self.device,
            "recommended_n": self.recommended_n,
            "measured_n": self.measured_n,
            "memory_model": self.memory_model.to_dict(),
            "time_model": self.time_model.to_dict(),
            "rows": [asdict(r) for r in self.rows],
        }


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
    probes: int = 3,
    repeats: int = 3,
    safety_margin: float = 0.05,
) -> Plan:
    """Recommend the fastest N whose step fits ``memory_budget_bytes``.

    ``batch`` is an example (inputs, targets); its rows are repeated to
    ``global_batch_size``.  ``loss_sum`` defaults to summed cross-entropy for
    integer targets and summed squared error for float targets.  The
    ``probes`` largest candidate N are measured first (least memory); a
    candidate is then taken only if its predicted peak is at least
    ``safety_margin`` below the budget, and it is measured before it is
    recommended.  A measured peak over budget rules that N out and refits.
    """
    if global_batch_size < 1:
        raise ValueError(f"global_batch_size must be >= 1, got {global_batch_size}")
    if memory_budget_bytes <= 0:
        raise ValueError(f"memory_budget_bytes must be > 0, got {memory_budget_bytes}")
    if not 0 <= safety_margin < 1:
        raise ValueError(f"safety_margin must be in [0, 1), got {safety_margin}")
    if probes < 2:
        raise ValueError(f"probes must be >= 2 (a line needs two points), got {probes}")
    candidates = sorted(set(candidates if candidates is not None else default_candidates(global_batch_size)))
    bad = [n for n in candidates if not 1 <= n <= global_batch_size]
    if bad:
        raise ValueError(f"candidates must be in 1..{global_batch_size} (the global batch size), got {bad}")
    loss_sum = loss_sum or _default_loss_sum(batch[1])
    count_items = count_items or (lambda targets: int(targets.shape[0]))
    full_batch = resize_batch(batch, global_batch_size)
    device = torch.device(device)

    measured: dict[int, StepMeasurement] = {}

    def measure(n: int) -> StepMeasurement:
        measured[n] = measure_step(
            model,
            full_batch,
            n,
            loss_sum=loss_sum,
            count_items=count_items,
            optimizer_factory=optimizer_factory,
            device=device,
            repeats=repeats,
        )
        return measured[n]

    # Probe the smallest micro-batches first: if they do not fit, nothing does,
    # and no probe can need more memory than the budget-checked one before it.
    probe_ns: list[int] = []
    probe_sizes: set[int] = set()
    for n in sorted(candidates, key=lambda n: (_micro_batch_size(global_batch_size, n), n)):
        if _micro_batch_size(global_batch_size, n) not in probe_sizes:
            probe_sizes.add(_micro_batch_size(global_batch_size, n))
            probe_ns.append(n)
        if len(probe_ns) == probes:
            break
    if len(probe_ns) < 2:
        raise ValueError(f"candidates {candidates} give fewer than 2 micro-batch sizes; nothing to fit")
    smallest = measure(probe_ns[0])
    if smallest.memory.peak_bytes > memory_budget_bytes:
        raise ValueError(
            f"no N fits: even N={probe_ns[0]} (micro-batch {smallest.micro_batch_size}) peaks at "
            f"{smallest.memory.peak_bytes} bytes > budget {memory_budget_bytes} bytes "
            f"(optimizer step alone: {smallest.memory.optimizer_step_peak_bytes} bytes)"
        )
    for n in probe_ns[1:]:
        if measure(n).memory.peak_bytes > memory_budget_bytes:
            break  # larger micro-batches need even more

    over_budget: set[int] = {n for n, m in measured.items() if m.memory.peak_bytes > memory_budget_bytes}
    recommended: int | None = None
    while True:
        memory_model, time_model = _fit(measured.values(), global_batch_size)
        allowed = memory_budget_bytes * (1 - safety_margin)
        feasible = [
            n
            for n in candidates
            if n not in over_budget and memory_model.peak_bytes(_micro_batch_size(global_batch_size, n)) <= allowed
        ]
        if not feasible:
            break
        best = max(feasible, key=lambda n: (_predicted_rate(n, global_batch_size, time_model, measured), -n))
        if best not in measured:
            measure(best)
        if measured[best].memory.peak_bytes <= memory_budget_bytes:
            recommended = best
            break
        over_budget.add(best)  # the line under-predicted: rule it out, refit with it

    memory_model, time_model = _fit(measured.values(), global_batch_size)
    rows = []
    for n in candidates:
        m = _micro_batch_size(global_batch_size, n)
        got = measured.get(n)
        rows.append(
            PlanRow(
                n_micro_batches=n,
                micro_batch_size=m,
                predicted_peak_bytes=memory_model.peak_bytes(m),
                predicted_samples_per_s=time_model.samples_per_s(n, global_batch_size),
                fits=(got.memory.peak_bytes <= memory_budget_bytes)
                if got
                else memory_model.peak_bytes(m) <= memory_budget_bytes * (1 - safety_margin),
                measured_peak_bytes=got.memory.peak_bytes if got else None,
                measured_forward_backward_peak_bytes=got.memory.forward_backward_peak_bytes if got else None,
                measured_optimizer_step_peak_bytes=got.memory.optimizer_step_peak_bytes if got else None,
                measured_samples_per_s=global_batch_size / got.median_step_seconds
                if got and got.step_seconds
                else None,
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
        measured_n=list(measured),
    )


def _micro_batch_size(global_batch_size: int, n: int) -> int:
    return -(-global_batch_size // n)  # ceil: the largest piece sets the peak


def _predicted_rate(
    n: int, global_batch_size: int, time_model: TimeModel, measured: dict[int, StepMeasurement]
) -> float:
    """Samples/s for N: measured where it was, predicted elsewhere."""
    if n in measured and measured[n].step_seconds:
        return global_batch_size / measured[n].median_step_seconds
    return time_model.samples_per_s(n, global_batch_size)


def _fit(measurements: Any, global_batch_size: int) -> tuple[MemoryModel, TimeModel]:
    measurements = list(measurements)
    memory_model = fit_memory(
        [
            MemoryPoint(
                micro_batch_size=m.micro_batch_size,
                forward_backward_peak_bytes=m.memory.forward_backward_peak_bytes,
                optimizer_step_peak_bytes=m.memory.optimizer_step_peak_bytes,
            )
            for m in measurements
        ]
    )
    time_model = fit_time(
        [
            TimePoint(
                n_micro_batches=m.n_micro_batches,
                global_batch_size=global_batch_size,
                step_seconds=m.median_step_seconds,
            )
            for m in measurements
        ]
    )
    return memory_model, time_model


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


def load_target(spec: str) -> tuple[nn.Module, Batch, LossSum | None, CountItems | None, int | None]:
    """A built-in workload name, or ``MODULE:FUNC`` where ``FUNC()`` returns
    ``(model, (inputs, targets))`` or ``(model, (inputs, targets), loss_sum)``."""
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
    module_name, sep, func_name = spec.partition(":")
    if not sep or not module_name or not func_name:
        raise ValueError(f"target must be one of {sorted(WORKLOADS)} or MODULE:FUNC, got {spec!r}")
    func = getattr(importlib.import_module(module_name), func_name, None)
    if not callable(func):
        raise ValueError(f"{func_name!r} in module {module_name!r} is not a function")
    result = func()
    if not isinstance(result, tuple) or len(result) not in (2, 3):
        raise TypeError(f"{spec}() must return (model, (inputs, targets)[, loss_sum]), got {type(result).__name__}")
    model, batch = result[0], result[1]
    return model, (batch[0], batch[1]), (result[2] if len(result) == 3 else None), None, None


def register_cli(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``plan`` to an argparse subparsers object; the handler is ``func(args) -> int``."""
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
    parser.set_defaults(func=run_plan_command)
    return parser


def run_plan_command(args: argparse.Namespace) -> int:
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        model, batch, loss_sum, count_items, default_batch = load_target(args.target)
    except (ValueError, TypeError, ImportError) as exc:
        print(f"equiv plan: {exc}", file=sys.stderr)
        return 2
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
    except ValueError as exc:
        print(f"equiv plan: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(format_plan(result))
    return 0 if result.recommended_n is not None else 1


def format_plan(result: Plan) -> str:
    mib = 2**20
    memory, timing = result.memory_model, result.time_model
    lines = [
        f"global batch {result.global_batch_size}, budget {result.memory_budget_bytes / mib:.1f} MiB, "
        + f"device {result.device}",
        f"memory model: peak = max({memory.static_bytes / mib:.2f} MiB + "
        + f"{memory.activation_bytes_per_sample / mib:.4f} MiB x micro-batch, "
        + f"optimizer step {memory.optimizer_step_peak_bytes / mib:.2f} MiB)",
        f"time model: step = N x {timing.seconds_per_micro_step * 1e3:.2f} ms + "
        + f"B x {timing.seconds_per_sample * 1e6:.1f} us",
        "",
        f"{'N':>5} {'micro':>6} {'pred MiB':>9} {'meas MiB':>9} {'pred samples/s':>15} {'meas samples/s':>15}  fits",
    ]
    for row in result.rows:
        measured_mib = f"{row.measured_peak_bytes / mib:.2f}" if row.measured_peak_bytes is not None else "-"
        measured_rate = f"{row.measured_samples_per_s:.0f}" if row.measured_samples_per_s is not None else "-"
        marker = "  <- recommended" if row.n_micro_batches == result.recommended_n else ""
        lines.append(
            f"{row.n_micro_batches:>5} {row.micro_batch_size:>6} {row.predicted_peak_bytes / mib:>9.2f} "
            f"{measured_mib:>9} {row.predicted_samples_per_s:>15.0f} {measured_rate:>15}  "
            f"{'yes' if row.fits else 'no'}{marker}"
        )
    if result.recommended_n is None:
        lines.append("no N fits the budget: measured candidates exceeded it and the rest are predicted to")
    return "\n".join(lines)

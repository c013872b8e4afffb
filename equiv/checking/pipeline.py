"""Pipeline parallelism (``torch.distributed.pipelining``) checked against the full batch.

A pipeline schedule owns the micro-batch loop: it cuts the batch it is given
into ``n_microbatches`` chunks (``torch.tensor_split`` along dim 0, so a batch
that does not divide evenly gives uneven chunks), runs forward and backward on
its stages, and, with ``scale_grads=True`` (its default), divides every
stage's gradients by ``n_microbatches`` after the backward.  Whether one
optimizer step then equals the full-batch step depends on the loss the
schedule is given and on those settings, so what is checked here is a
:class:`PipelineSetting`: the schedule, ``scale_grads``, the loss (each
chunk's mean, or its sum over the window's item count), how many
``schedule.step`` calls make one optimizer step (gradient accumulation
around the pipeline), and whether the gradients are cleared between calls.

Every rank builds the same float64 model (a stack of ``nn.Linear`` + tanh
layers), keeps its stages' layers, runs ``steps`` optimizer steps (SGD) through
the schedule, and is judged as :func:`equiv.check` judges a step: the run source
is one single-process full-batch run of the same steps (its float64 truth, and
the floor plan's samples of it: in float32, and on a shuffled batch in both
precisions, :mod:`equiv.judging.floors`), and every step of the rank's stage
parameters is compared with it in the exact tier
(:class:`~equiv.judging.judge.Judge`), each tensor allowed the derived multiple
of that run's own rounding error.  A weighting mistake is orders of magnitude
past it.
Ranks are spawned gloo processes (:func:`equiv.distributed.launcher.run_on_ranks`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from equiv.cases.pipeline import (
    LOSS_MODES,
    MULTI_STAGE_SCHEDULES,
    SCHEDULES,
    V_SHAPED_SCHEDULES,
    PipelineSetting,
)
from equiv.checking.failure_kinds import named_by
from equiv.checking.witnessing import finite
from equiv.distributed.launcher import DistributedCheckError, Launcher, run_on_ranks
from equiv.judging.compare import StepComparer
from equiv.judging.floors import IN_ORDER, Rounding
from equiv.judging.judge import Judge, OnSnapshot, RunSource
from equiv.judging.runs import Snapshot
from equiv.judging.witness import recover_weights, witness
from equiv.outcomes import Fault, Outcome, outcome_words
from equiv.results.protocol import ResultBase, headed
from equiv.results.verdict import FailureKind, TensorDiff
from equiv.results.witness import Witness

__all__ = [
    "LOSS_MODES",
    "MULTI_STAGE_SCHEDULES",
    "SCHEDULES",
    "PipelineSetting",
    "PipelineVerdict",
    "check_pipeline",
    "settings_grid",
]


@dataclass(frozen=True, slots=True)
class PipelineRank:
    """What one rank of a pipeline check sends back: its stages' worst parameter."""

    #: The largest difference of its stages' parameters from the full-batch run, over its allowance.
    worst_ratio: float
    #: Which parameter, and the allowance's terms there.
    worst_where: str
    #: The first step (1-based) where a parameter is past its allowance (None: none is).
    first_failing: int | None = None


@dataclass(frozen=True, slots=True)
class _StageWindow:
    """What one rank sends back for the witness: its stages' parameters at the failing step's start and the
    gradients its optimizer saw there, named as :func:`_stage_snapshot` names them."""

    params: dict[str, Tensor]
    grads: dict[str, Tensor | None]


@dataclass(frozen=True, slots=True)
class PipelineVerdict(ResultBase):
    """One pipeline setting against the float64 full-batch run: truthy only when equivalent."""

    KIND = "pipeline_verdict"

    setting: PipelineSetting
    status: Outcome
    #: The largest parameter difference from the float64 full-batch run as a multiple of its derived
    #: allowance (any rank): at most 1 when equivalent.
    worst_ratio: float | None = None
    #: Which stage parameter that worst ratio belongs to, and the allowance's terms there.
    worst_where: str | None = None
    #: Why it could not run (status STEP_ERROR): the ranks' report, as :func:`equiv.check_distributed`'s
    #: :class:`~equiv.distributed.launcher.DistributedCheckError` says it (which rank, how, the setting).
    error: str | None = None
    #: How the ranks failed to give a verdict (with ``error``), as data: read it, never the error's text.
    fault: Fault | None = None
    #: The weight each chunk's loss got at the first failing step, named (issue 44); None unless not equivalent.
    witness: Witness | None = None
    #: The kind of failure the witness names (the same names as ``equiv check``'s); None with no witness.
    failure_kind: FailureKind | None = None

    def __bool__(self) -> bool:
        return self.status is Outcome.EQUIVALENT

    def message(self) -> str:
        if self.error is not None:
            return f"{self.setting.describe()}: could not run on these ranks: {self.error}"
        text = (
            f"{self.setting.describe()}: {outcome_words(self.status)} (worst parameter {self.worst_ratio:.3g} "
            f"x allowed: {self.worst_where})"
        )
        if self.failure_kind is not None:
            text += f"\nKind of failure: {self.failure_kind.describe()}"
        if self.witness is not None:
            text += f"\nWhat the loop did: {self.witness.clause()}"
        return text

    def line(self) -> str:
        """One line: the outcome, the setting, and the worst parameter against its allowance."""
        if self.error is not None:
            # One line, as the schema wants it (a rank's report may hold a collective mismatch's lines).
            return headed(self.status, f"{self.setting.describe()}: could not run: {' '.join(self.error.split())}")
        witnessed = "" if self.witness is None else f"; {self.witness.clause()}"
        return headed(
            self.status, f"{self.setting.describe()}, worst {self.worst_ratio:.3g} of its allowance{witnessed}"
        )

    def _fields(self) -> dict[str, Any]:
        return {
            "setting": asdict(self.setting),
            "description": self.setting.describe(),
            "worst_ratio": self.worst_ratio,
            "worst_where": self.worst_where,
            "error": self.error,
            "fault": None if self.fault is None else self.fault.value,
            # optional, as in a verdict's: a failure kind and weights only where the witness was read
            **({} if self.failure_kind is None else {"failure_kind": self.failure_kind.to_dict()}),
            **({} if self.witness is None else {"weights": self.witness.to_dict()}),
        }


_WIDTH = 4
_FEATURES = 3


def _layers(count: int) -> list[nn.Module]:
    """``count`` blocks of Linear + tanh (the last a plain Linear), float64, fixed seed."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        blocks: list[nn.Module] = [
            nn.Sequential(nn.Linear(_FEATURES if i == 0 else _WIDTH, _WIDTH), nn.Tanh()) for i in range(count - 1)
        ]
        blocks.append(nn.Linear(_WIDTH, _FEATURES))
    return [block.double() for block in blocks]


def _batches(setting: PipelineSetting) -> list[list[tuple[Tensor, Tensor]]]:
    """Per optimizer step, per call: (inputs, targets), float64, fixed seed;
    with ``padding`` about 40% of the target entries are NaN (padding), each
    sample keeping at least one real entry."""
    generator = torch.Generator().manual_seed(1)
    out = []
    for _ in range(setting.steps):
        calls = []
        for _ in range(setting.calls_per_step):
            inputs = torch.randn(setting.batch_size, _FEATURES, generator=generator, dtype=torch.float64)
            targets = torch.randn(setting.batch_size, _FEATURES, generator=generator, dtype=torch.float64)
            if setting.padding:
                padded = torch.rand(setting.batch_size, _FEATURES, generator=generator) < 0.4
                padded[:, 0] = False
                targets = targets.masked_fill(padded, math.nan)
            calls.append((inputs, targets))
        out.append(calls)
    return out


def _squared_error_sum(output: Tensor, target: Tensor) -> Tensor:
    """Summed squared error over the real (non-NaN) target entries."""
    real = ~target.isnan()
    return (output - target.nan_to_num()).pow(2)[real].sum()


def _real_items(target: Tensor) -> int:
    return int((~target.isnan()).sum())


_LR = 0.1


#: The floor plan's roundings of the full-batch run: in order (the truth's), and on a shuffled batch.
_ROUNDINGS = (IN_ORDER, Rounding("shuffled", seed=2))


def _stage_snapshot(blocks: list[nn.Module], indices: list[int]) -> Snapshot:
    """The parameters of stages ``indices``, named by stage (their live tensors: read at once).
    SGD without momentum keeps no optimizer state."""
    params = {f"stage {i}.{name}": p.detach() for i in indices for name, p in blocks[i].named_parameters()}
    return Snapshot(params=params, buffers={}, optimizer_state={})


def _full_batch_source(setting: PipelineSetting, stages: int, indices: list[int]) -> RunSource:
    """The run source of the pipeline's truth: the same steps in one process, the whole
    model at once, each step's calls as one batch with the mean loss over its real items;
    stages ``indices`` handed over after each step."""

    def source(dtype: torch.dtype, rounding: Rounding, on_snapshot: OnSnapshot) -> None:
        blocks = [block.to(dtype) for block in _layers(stages)]
        model = nn.Sequential(*blocks)
        optimizer = torch.optim.SGD(model.parameters(), lr=_LR)
        generator = None if rounding.seed is None else torch.Generator().manual_seed(rounding.seed)
        on_snapshot(0, _stage_snapshot(blocks, indices))
        for step, calls in enumerate(_batches(setting), start=1):
            inputs = torch.cat([x for x, _ in calls]).to(dtype)
            targets = torch.cat([y for _, y in calls]).to(dtype)
            if generator is not None:
                order = torch.randperm(len(inputs), generator=generator)
                inputs, targets = inputs[order], targets[order]
            optimizer.zero_grad(set_to_none=True)
            (_squared_error_sum(model(inputs), targets) / _real_items(targets)).backward()
            optimizer.step()
            on_snapshot(step, _stage_snapshot(blocks, indices))

    return source


def _worst(rows: list[TensorDiff]) -> tuple[float, str]:
    """The greatest difference / allowed over a rank's rows, and where (which step, stage and tensor)."""
    row = max(rows, key=lambda r: r.ratio)
    return row.ratio, (
        f"step {row.step}, '{row.name}', off by {row.max_abs_diff:.3g}, allowed {row.allowed:.3g} = {row.explanation}"
    )


def _stage_indices(setting: PipelineSetting, rank: int) -> list[int]:
    if setting.stages_per_rank == 1:
        return [rank]
    if setting.schedule in V_SHAPED_SCHEDULES:
        return [rank, 2 * setting.ranks - 1 - rank]
    return [rank + setting.ranks * k for k in range(setting.stages_per_rank)]


def _comparer(setting: PipelineSetting, indices: list[int]) -> StepComparer:
    """The exact tier's comparer of stages ``indices`` against the full-batch run (its floors run first)."""
    judge = Judge(
        _full_batch_source(setting, setting.ranks * setting.stages_per_rank, indices),
        working=torch.float64,
        tiers=("exact",),
        roundings=_ROUNDINGS,
        steps=setting.steps,
    )
    return judge.with_floors().comparer("exact")


def _stage_grads(blocks: list[nn.Module], indices: list[int]) -> dict[str, Tensor | None]:
    """The gradients of stages ``indices``, copied, named as :func:`_stage_snapshot` names their parameters."""
    return {
        f"stage {i}.{name}": None if p.grad is None else p.grad.detach().clone()
        for i in indices
        for name, p in blocks[i].named_parameters()
    }


@dataclass(frozen=True)
class _PipelineTask:
    setting: PipelineSetting
    #: Run to this step (0-based) and send back its :class:`_StageWindow` at the optimizer step (the witness's
    #: run), judging nothing; None: every step, judged.
    witness_step: int | None = None

    def _schedule(self, blocks: list[nn.Module], indices: list[int], current: dict[str, int]) -> Any:
        """The setting's schedule over this rank's stages, its loss reading the step ``current`` holds."""
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining import schedules as pipelining

        setting = self.setting
        stages = len(blocks)
        pipeline_stages = [
            PipelineStage(blocks[i], i, stages, torch.device("cpu"), group=dist.group.WORLD) for i in indices
        ]
        window_items = [sum(_real_items(y) for _, y in calls) for calls in _batches(setting)]

        def loss_fn(output: Tensor, target: Tensor) -> Tensor:
            if setting.loss == "mean":  # this chunk's mean over its real items
                return _squared_error_sum(output, target) / _real_items(target)
            return _squared_error_sum(output, target) / window_items[current["step"]]

        schedule_class = getattr(pipelining, f"Schedule{setting.schedule}")
        return schedule_class(
            pipeline_stages if setting.stages_per_rank > 1 else pipeline_stages[0],
            setting.n_microbatches,
            loss_fn=loss_fn,
            scale_grads=setting.scale_grads,
        )

    def __call__(self, rank: int, world_size: int, progress: Any) -> PipelineRank | _StageWindow:
        setting = self.setting
        stages = setting.ranks * setting.stages_per_rank
        blocks = _layers(stages)
        indices = _stage_indices(setting, rank)
        params = [p for i in indices for p in blocks[i].parameters()]
        optimizer = torch.optim.SGD(params, lr=_LR)
        current = {"step": 0}
        schedule = self._schedule(blocks, indices, current)
        first, last = 0 in indices, stages - 1 in indices
        judging = self.witness_step is None
        if judging:
            comparer = _comparer(setting, indices)
            comparer.add(0, _stage_snapshot(blocks, indices))
        for step, calls in enumerate(_batches(setting)):
            current["step"] = step
            if step == self.witness_step:
                started = {name: p.clone() for name, p in _stage_snapshot(blocks, indices).params.items()}
            optimizer.zero_grad(set_to_none=True)
            for call, (inputs, targets) in enumerate(calls):
                progress(f"step {step}, call {call}")
                if setting.clear_between_calls:
                    for p in params:
                        p.grad = None
                args = (inputs,) if first else ()
                try:
                    schedule.step(*args, target=targets if last else None)
                except RuntimeError as exc:
                    # torch's stage errors span lines; one line keeps the cause in the fault report.
                    raise RuntimeError(" ".join(str(exc).split())) from None
            if step == self.witness_step:
                return _StageWindow(started, _stage_grads(blocks, indices))
            optimizer.step()
            if judging:
                comparer.add(step + 1, _stage_snapshot(blocks, indices))
        comparer.end_run()
        worst, where = _worst(comparer.diffs)
        failing = [row.step for row in comparer.diffs if not row.ok]
        return PipelineRank(worst, where, min(failing, default=None))


def check_pipeline(
    setting: PipelineSetting, *, timeout_s: float = 60.0, launcher: Launcher = run_on_ranks
) -> PipelineVerdict:
    """Run ``setting`` on ``setting.ranks`` spawned gloo ranks and judge every stage's
    parameters after every step against the single-process full-batch steps.

    Call it under ``if __name__ == "__main__":`` in a script: the ranks are spawned
    processes that import the script again.

    Args:
        setting: the schedule, ``scale_grads``, the loss and the split to run.
        timeout_s: seconds the ranks may take before they are stopped (a positive number).
        launcher: how the ranks are started (:func:`equiv.distributed.launcher.run_on_ranks`).

    Returns:
        A :class:`PipelineVerdict`: EQUIVALENT or NOT_EQUIVALENT with the worst ratio and
        where; a schedule that raises, hangs or dies on these ranks is a STEP_ERROR
        verdict carrying the ranks' report and its :class:`~equiv.outcomes.Fault`
        (what could not run, and why, as ``check_distributed``'s ranks report it), never a pass.

    Raises:
        ValueError: ``timeout_s`` is not a positive number.
        UnguardedMainError: called at the top level of a script the ranks import again
            (not under ``if __name__ == "__main__":``).
    """
    if not (timeout_s > 0 and math.isfinite(timeout_s)):
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
    try:
        results = launcher(
            _PipelineTask(setting), setting.ranks, timeout_s=timeout_s, describe=f"pipeline {setting.describe()}"
        )
    except DistributedCheckError as exc:
        # As check_distributed's ranks fail: the launcher's report and its Fault, kept as data.
        return PipelineVerdict(setting, Outcome.STEP_ERROR, error=str(exc), fault=exc.fault)
    worst = max(results, key=lambda r: r.worst_ratio)
    status = Outcome.EQUIVALENT if worst.worst_ratio <= 1.0 else Outcome.NOT_EQUIVALENT
    verdict = PipelineVerdict(setting, status, worst_ratio=worst.worst_ratio, worst_where=worst.worst_where)
    failing = [r.first_failing for r in results if r.first_failing is not None]
    if status is not Outcome.NOT_EQUIVALENT or not failing:
        return verdict  # a passing setting runs nothing more
    witness = _witness(setting, min(failing), launcher, timeout_s)
    if witness is None:
        return verdict
    return dataclasses.replace(verdict, witness=witness, failure_kind=named_by(witness))


def _witness(setting: PipelineSetting, step: int, launcher: Launcher, timeout_s: float) -> Witness | None:
    """The witness of ``step`` (1-based, the first failing): the ranks run to its optimizer step and send their
    stages' parameters and gradients; each chunk's loss-sum gradient is taken here, on the whole model at those
    parameters (every chunk of every ``schedule.step`` call of the window is a micro-batch)."""
    try:
        windows = launcher(
            _PipelineTask(setting, witness_step=step - 1),
            setting.ranks,
            timeout_s=timeout_s,
            describe=f"the witness of pipeline {setting.describe()}",
        )
    except DistributedCheckError:
        return None  # the verdict stands without a witness
    params = {name: p for window in windows for name, p in window.params.items()}
    grads = {name: g for window in windows for name, g in window.grads.items()}
    blocks = _layers(setting.ranks * setting.stages_per_rank)
    named = [(f"stage {i}.{name}", p) for i, block in enumerate(blocks) for name, p in block.named_parameters()]
    with torch.no_grad():
        for name, p in named:
            p.copy_(params[name])
    model = nn.Sequential(*blocks)
    chunks = [
        chunk
        for inputs, targets in _batches(setting)[step - 1]
        for chunk in zip(
            inputs.tensor_split(setting.n_microbatches), targets.tensor_split(setting.n_microbatches), strict=True
        )
    ]
    leaves = [p for _, p in named]
    gradients: list[list[Tensor | None]] = [
        list(torch.autograd.grad(_squared_error_sum(model(x), y), leaves)) for x, y in chunks
    ]
    accumulated = [grads[name] for name, _ in named]
    if not finite([accumulated, *gradients]):
        return None
    items = [float(_real_items(y)) for _, y in chunks]
    return witness(recover_weights(gradients, accumulated), items, configured_n=None)


def settings_grid(schedules: Sequence[str] = SCHEDULES) -> list[PipelineSetting]:
    """Every schedule with each ``scale_grads`` x loss setting, on uneven chunks."""
    return [
        PipelineSetting(schedule=schedule, scale_grads=scale, loss=loss)
        for schedule in schedules
        for scale in (True, False)
        for loss in LOSS_MODES
    ]

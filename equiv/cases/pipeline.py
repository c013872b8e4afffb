"""A pipeline setting: one way of training through a ``torch.distributed.pipelining`` schedule.

What :func:`equiv.checking.pipeline.check_pipeline` runs, as a
:class:`~equiv.cases.case.Case` is what :func:`equiv.check` runs: plain
values only, so a setting reproduces exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "LOSS_MODES",
    "MULTI_STAGE_SCHEDULES",
    "SCHEDULES",
    "SINGLE_STAGE_SCHEDULES",
    "V_SHAPED_SCHEDULES",
    "PipelineSetting",
]

#: Schedules with one stage per rank.
SINGLE_STAGE_SCHEDULES: tuple[str, ...] = ("GPipe", "1F1B")
#: Schedules with several stages per rank; the V-shaped ones place rank r's
#: stages at r and 2W - 1 - r, the looped ones at r, r + W, ...
MULTI_STAGE_SCHEDULES: tuple[str, ...] = (
    "Interleaved1F1B",
    "LoopedBFS",
    "InterleavedZeroBubble",
    "ZBVZeroBubble",
    "DualPipeV",
)
SCHEDULES: tuple[str, ...] = SINGLE_STAGE_SCHEDULES + MULTI_STAGE_SCHEDULES
V_SHAPED_SCHEDULES: tuple[str, ...] = ("ZBVZeroBubble", "DualPipeV")
#: "mean": each chunk's mean loss (what a model's loss returns); "window_sum": each
#: chunk's summed loss over the window's item count (known before the window starts).
LOSS_MODES: tuple[str, ...] = ("mean", "window_sum")


@dataclass(frozen=True, kw_only=True, slots=True)
class PipelineSetting:
    """One way of training through a pipeline schedule; ``batch_size`` samples
    per ``schedule.step`` call, cut into ``n_microbatches`` chunks."""

    schedule: str
    scale_grads: bool
    loss: str
    n_microbatches: int = 4
    #: Samples per call: 8 cuts into 4 equal chunks; 7 into chunks of 2, 2, 2, 1
    #: (which torch 2.13's schedules cannot run: PyTorch #126600).
    batch_size: int = 8
    #: Padded targets (NaN, ignored by the loss): chunks of equal samples hold
    #: different numbers of real items, so a mean of chunk means is off.
    padding: bool = True
    #: ``schedule.step`` calls per optimizer step (gradient accumulation around the pipeline).
    calls_per_step: int = 1
    #: Clear the stages' gradients before every call (a stage rebuilt per call).
    clear_between_calls: bool = False
    steps: int = 2
    ranks: int = 2

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.loss not in LOSS_MODES:
            raise ValueError(f"loss must be one of {LOSS_MODES}, got {self.loss!r}")
        for name in ("n_microbatches", "batch_size", "calls_per_step", "steps", "ranks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.batch_size < self.n_microbatches:
            raise ValueError(f"batch_size ({self.batch_size}) must be at least n_microbatches ({self.n_microbatches})")

    @property
    def stages_per_rank(self) -> int:
        return 1 if self.schedule in SINGLE_STAGE_SCHEDULES else 2

    @property
    def chunk_sizes(self) -> tuple[int, ...]:
        """The micro-batch sizes the schedule cuts each call's batch into (``torch.tensor_split``)."""
        return tuple(len(chunk) for chunk in torch.arange(self.batch_size).tensor_split(self.n_microbatches))

    def describe(self) -> str:
        extra = ", ragged real items" if self.padding else ", no padding"
        extra += f", {self.calls_per_step} calls per step" if self.calls_per_step > 1 else ""
        extra += ", grads cleared between calls" if self.clear_between_calls else ""
        return (
            f"{self.schedule}, scale_grads={self.scale_grads}, loss={self.loss}, chunks {list(self.chunk_sizes)}{extra}"
        )

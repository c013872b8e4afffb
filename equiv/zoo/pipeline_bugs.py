"""Ways of training through a ``torch.distributed.pipelining`` schedule, right and wrong.

A pipeline schedule owns the micro-batch loop, so what goes wrong is a
setting, not a step function: the loss it is given, ``scale_grads``, how many
``schedule.step`` calls make one optimizer step, whether gradients survive
between them.  Each entry is a :class:`equiv.cases.pipeline.PipelineSetting`
with what :func:`equiv.checking.pipeline.check_pipeline` must conclude and the
upstream report it reproduces.  Chunks hold equal samples and, with padding,
different numbers of real items (the uneven token counts of real batches).
"""

from __future__ import annotations

from dataclasses import dataclass

from equiv.cases.pipeline import PipelineSetting
from equiv.outcomes import Outcome

__all__ = ["PIPELINE_ZOO", "PipelineEntry"]


@dataclass(frozen=True, slots=True)
class PipelineEntry:
    #: The setting on each schedule: only ``schedule`` differs between them.
    setting: PipelineSetting
    expected: Outcome
    #: The upstream report it reproduces ("" for a correct setting).
    upstream: str
    what: str


def _on(scale_grads: bool, loss: str, **changes: object) -> PipelineSetting:
    return PipelineSetting(schedule="GPipe", scale_grads=scale_grads, loss=loss, **changes)  # type: ignore[arg-type]


#: name -> entry; each runs on every schedule of equiv.checking.pipeline.SCHEDULES.
PIPELINE_ZOO: dict[str, PipelineEntry] = {
    "window_sum_unscaled": PipelineEntry(
        _on(False, "window_sum"),
        Outcome.EQUIVALENT,
        "",
        "scale_grads=False, each chunk's summed loss over the window's real items (known up front)",
    ),
    "window_sum_unscaled_two_calls": PipelineEntry(
        _on(False, "window_sum", calls_per_step=2),
        Outcome.EQUIVALENT,
        "",
        "the same over 2 schedule.step calls per optimizer step",
    ),
    "mean_scaled_even_items": PipelineEntry(
        _on(True, "mean", padding=False),
        Outcome.EQUIVALENT,
        "",
        "the default (scale_grads=True, each chunk's mean): exact when every chunk holds as many items",
    ),
    "mean_scaled_ragged_items": PipelineEntry(
        _on(True, "mean"),
        Outcome.NOT_EQUIVALENT,
        "torchtitan PR #2206 (a mean of per-micro-batch token means; fixed by dividing by the window's token count)",
        "the default with ragged real items: a mean of the chunks' means",
    ),
    "mean_unscaled": PipelineEntry(
        _on(False, "mean"),
        Outcome.NOT_EQUIVALENT,
        "DeepSpeed #7773 (sums instead of averaging)",
        "scale_grads=False with each chunk's mean: the chunks' means summed",
    ),
    "window_sum_scaled": PipelineEntry(
        _on(True, "window_sum"),
        Outcome.NOT_EQUIVALENT,
        "",
        "a window-normalised loss and scale_grads=True: divided twice",
    ),
    "scaled_every_call": PipelineEntry(
        _on(True, "mean", padding=False, calls_per_step=2),
        Outcome.NOT_EQUIVALENT,
        "torchtitan #1733 (scale_grads rescales every step: a moving average)",
        "scale_grads=True over 2 calls per optimizer step: the first call's gradient divided again",
    ),
    "grads_cleared_between_calls": PipelineEntry(
        _on(False, "window_sum", calls_per_step=2, clear_between_calls=True),
        Outcome.NOT_EQUIVALENT,
        "NeMo Automodel PR #3530 (stage re-init sets param.grad = None)",
        "the stages' gradients cleared before every call: only the last call trains",
    ),
    "uneven_chunks": PipelineEntry(
        _on(False, "window_sum", batch_size=7),
        Outcome.STEP_ERROR,
        "PyTorch #126600 (uneven micro-batch sizes)",
        "7 samples cut into chunks of 2, 2, 2, 1: the stages' buffers are sized from the first chunk",
    ),
}

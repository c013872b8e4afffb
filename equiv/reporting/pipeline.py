"""The pipeline-parallel section of reports/equivalence.md, rendered.

One row per setting of the pipeline zoo, one column per ``torch.distributed.pipelining``
schedule, as :func:`equiv.findings.pipeline.pipeline_table` measured them (which
settings, which schedules, and why only statuses are kept: see there).
Nothing here measures.
"""

from __future__ import annotations

import pandas as pd

from equiv.reporting.markdown import markdown_table

__all__ = ["pipeline_section"]


def pipeline_section(table: pd.DataFrame) -> str:
    """The section, from :func:`equiv.findings.pipeline.pipeline_table`."""
    return "\n\n".join(
        [
            "## Pipeline parallelism: torch.distributed.pipelining schedules",
            "`equiv.checking.pipeline.check_pipeline(setting)` on 2 spawned gloo ranks (CPU), torch's own schedules: "
            "GPipe and 1F1B with one stage per rank, Interleaved1F1B, LoopedBFS and InterleavedZeroBubble with two "
            "looped stages per rank, ZBVZeroBubble and DualPipeV with two V-placed stages per rank; every one ran here. "
            "Model: 4 stages of `nn.Linear` (+ tanh), float64, SGD, 2 optimizer steps; each `schedule.step` gets 8 "
            "samples cut into 4 chunks of 2, whose targets are padded (NaN entries the loss skips), so the chunks "
            "hold different numbers of real items. Each rank's stage parameters, after every step, are judged by "
            "the engine of `equiv.check` against one single-process full-batch run in the exact tier (32 x the floor, "
            "how far the same full-batch steps land in float32, scaled to float64, and on a shuffled batch, + 16 x "
            "steps x float64's unit roundoff x the tensor's scale); each NOT here is orders of magnitude past it. "
            "Equivalent: `scale_grads=False` with each chunk's summed loss over "
            "the window's real items, also across several `schedule.step` calls per optimizer step; the default "
            "(`scale_grads=True`, each chunk's mean) only when every chunk holds as many items. Uneven chunk sizes "
            "could not run on any schedule: torch 2.13's stages size their send/receive buffers from the first "
            'chunk, so the 1-sample chunk fails ("Failed to run stage backward": output gradient of the first '
            "chunk's shape, or an IndexError in the loss on the last stage).",
            markdown_table(table),
        ]
    )

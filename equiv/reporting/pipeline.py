"""The pipeline-parallel section of reports/equivalence.md.

Every setting of :data:`equiv.zoo.pipeline_bugs.PIPELINE_ZOO` on every
``torch.distributed.pipelining`` schedule of
:data:`equiv.checking.pipeline.SCHEDULES`, 2 gloo ranks, checked with
:func:`equiv.checking.pipeline.check_pipeline`.  Only statuses are printed
(a setting's parameters are within the exact tier's derived allowance or
orders of magnitude past it), and a setting that cannot run is printed with the upstream
report naming why, not with torch's message (which rank fails first depends
on timing).
"""

from __future__ import annotations

import dataclasses
import logging

import pandas as pd

from equiv.checking.pipeline import SCHEDULES, check_pipeline
from equiv.outcomes import Outcome
from equiv.reporting.markdown import markdown_table
from equiv.zoo.pipeline_bugs import PIPELINE_ZOO, PipelineEntry

__all__ = ["pipeline_section", "pipeline_table"]

log = logging.getLogger(__name__)


def _cell(entry: PipelineEntry, status: Outcome) -> str:
    upstream = entry.upstream.split(" (")[0]
    if status is Outcome.NOT_EQUIVALENT:
        return "NOT ({})".format(upstream or "equiv's zoo, no upstream report")
    if status is Outcome.STEP_ERROR:
        return f"could not run ({upstream})" if upstream else "could not run"
    return status.replace("_", " ")


def pipeline_table() -> pd.DataFrame:
    rows = []
    for name, entry in PIPELINE_ZOO.items():
        row = {"setting": f"`{name}`", "what": entry.what}
        as_expected = True
        for schedule in SCHEDULES:
            verdict = check_pipeline(dataclasses.replace(entry.setting, schedule=schedule))
            log.info("pipeline: %s on %s: %s", name, schedule, verdict.status)
            row[schedule] = _cell(entry, verdict.status)
            as_expected &= verdict.status is entry.expected
        row["as expected"] = "yes" if as_expected else "NO"
        row["upstream"] = entry.upstream or "-"
        rows.append(row)
    return pd.DataFrame(rows)


def pipeline_section() -> str:
    return "\n\n".join([
        "## Pipeline parallelism: torch.distributed.pipelining schedules",
        "`equiv.checking.pipeline.check_pipeline(setting)` on 2 spawned gloo ranks (CPU), torch's own schedules: "
        "GPipe and 1F1B with one stage per rank, Interleaved1F1B, LoopedBFS and InterleavedZeroBubble with two "
        "looped stages per rank, ZBVZeroBubble and DualPipeV with two V-placed stages per rank; every one ran here. "
        "Model: 4 stages of `nn.Linear` (+ tanh), float64, SGD, 2 optimizer steps; each `schedule.step` gets 8 "
        "samples cut into 4 chunks of 2, whose targets are padded (NaN entries the loss skips), so the chunks "
        "hold different numbers of real items. Each rank compares its stages' parameters with one single-process "
        "full-batch run, with the exact tier's derived allowance of `equiv.check` (32 x the floor, how far the same "
        "full-batch steps land on a shuffled batch, + 16 x steps x float64's unit roundoff x the parameter's "
        "magnitude); each NOT here is orders of magnitude past it. Equivalent: `scale_grads=False` with each chunk's summed loss over "
        "the window's real items, also across several `schedule.step` calls per optimizer step; the default "
        "(`scale_grads=True`, each chunk's mean) only when every chunk holds as many items. Uneven chunk sizes "
        "could not run on any schedule: torch 2.13's stages size their send/receive buffers from the first "
        "chunk, so the 1-sample chunk fails (\"Failed to run stage backward\": output gradient of the first "
        "chunk's shape, or an IndexError in the loss on the last stage).",
        markdown_table(pipeline_table()),
    ])

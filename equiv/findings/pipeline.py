"""What the pipeline-parallel section of reports/equivalence.md shows, measured.

Every setting of :data:`equiv.zoo.pipeline_bugs.PIPELINE_ZOO` on every
``torch.distributed.pipelining`` schedule of
:data:`equiv.checking.pipeline.SCHEDULES`, 2 gloo ranks, checked with
:func:`equiv.checking.pipeline.check_pipeline`.  Only statuses are printed
(a setting's parameters are within the exact tier's derived allowance or
orders of magnitude past it), and a setting that cannot run is printed with the upstream
report naming why, not with torch's message (which rank fails first depends
on timing).  :mod:`equiv.reporting.pipeline` renders it.
"""

from __future__ import annotations

import dataclasses
import logging

import pandas as pd

from equiv.checking.pipeline import SCHEDULES, check_pipeline
from equiv.outcomes import Outcome, outcome_words
from equiv.zoo.pipeline_bugs import PIPELINE_ZOO, PipelineEntry

__all__ = ["pipeline_table"]

log = logging.getLogger(__name__)


def _cell(entry: PipelineEntry, status: Outcome) -> str:
    upstream = entry.upstream.split(" (")[0]
    if status is Outcome.NOT_EQUIVALENT:
        return "NOT ({})".format(upstream or "equiv's zoo, no upstream report")
    if status is Outcome.STEP_ERROR:
        return f"could not run ({upstream})" if upstream else "could not run"
    return outcome_words(status)


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

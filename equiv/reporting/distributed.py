"""The distributed and loss-scale sections of reports/equivalence.md.

Runs W=2 gloo ranks on the CPU: the reference accumulator and the distributed
bug zoo on uneven shards, the gradient all-reduces and bytes per optimizer
step as the number of micro-batches per rank N grows, and single-process
loss-scale windows where one micro-batch overflows.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pandas as pd

from equiv.accumulator import accumulator_step
from equiv.cases.case import Case
from equiv.checking.check import check
from equiv.checking.distributed import DistributedCase, check_distributed
from equiv.reporting.markdown import format_ratio, markdown_table
from equiv.zoo.distributed_bugs import DISTRIBUTED_BUGS, LOSS_SCALE_BUGS

__all__ = ["distributed_section"]

log = logging.getLogger(__name__)

_BASE = Case(batch_size=1, micro_batch_sizes=(1,), model_kwargs={"hidden": (16, 16)}, optimizer="AdamW",
             optimizer_kwargs={"lr": 1e-3, "weight_decay": 0.1}, steps=2)
#: Uneven shards: rank 0 holds 6 samples in 3 micro-batches, rank 1 holds 3 in 3.
_UNEVEN = [[1, 2, 3], [1, 1, 1]]


def distributed_section() -> str:
    """The markdown of the distributed and loss-scale sections."""
    candidates: dict[str, Callable[..., Any]] = {"accumulator_step": accumulator_step, **DISTRIBUTED_BUGS}
    rows = []
    for name, candidate in candidates.items():
        verdict = check_distributed(candidate, DistributedCase.of(_BASE, _UNEVEN))
        log.info("distributed: %s", name)
        first = next((v.first_mismatch for v in verdict.ranks if v.first_mismatch), None)
        rows.append({
            "candidate": name,
            "verdict": verdict.status.replace("_", " "),
            "worst exact / allowed": format_ratio(max(v.worst["exact"].ratio for v in verdict.ranks)),
            "all-reduces per step": ", ".join(map(str, sorted(verdict.allreduces_per_step()))),
            "first divergence": "-" if first is None else f"step {first.step}, {first.tier}, {first.label}",
        })
    verdicts = pd.DataFrame(rows)

    sweep = []
    for per_rank in (1, 2, 4, 8):
        shards = [[1] * per_rank, [1] * per_rank]
        for name, candidate in (("accumulator_step", accumulator_step),
                                ("no_sync_missing", DISTRIBUTED_BUGS["no_sync_missing"])):
            verdict = check_distributed(candidate, DistributedCase.of(_BASE.replace(steps=1), shards), tiers=("exact",))
            log.info("all-reduce sweep: N=%d %s", per_rank, name)
            sweep.append({
                "N per rank": per_rank,
                "candidate": name,
                "equivalent": "yes" if verdict else "no",
                "all-reduces per step": max(verdict.allreduces_per_step()),
                "bytes per step per rank": verdict.bytes_per_step(),
            })
    communication = pd.DataFrame(sweep).sort_values(["candidate", "N per rank"], kind="stable")

    scaled = _BASE.replace(batch_size=6, micro_batch_sizes=[1, 2, 3], steps=3, loss_scale=2.0**10)
    loss_rows = []
    for sample, where in ((0, "first micro-batch"), (2, "second micro-batch"), (5, "last micro-batch")):
        for name, candidate in (("accumulator_step", accumulator_step), *LOSS_SCALE_BUGS.items()):
            single = check(candidate, scaled.replace(overflow_at=[1, sample]))
            loss_rows.append({
                "overflow in": f"{where} (sample {sample}) of step 1",
                "candidate": name,
                "verdict": single.status.replace("_", " "),
                "worst exact / allowed": format_ratio(single.worst["exact"].ratio),
            })
    loss_scale = pd.DataFrame(loss_rows)

    return "\n\n".join([
        "## Distributed data parallel (W=2 gloo ranks on the CPU)",
        f"Every rank against the single-process full-batch step; shards {_UNEVEN} (samples per micro-batch, "
        f"per rank), case `{DistributedCase.of(_BASE, _UNEVEN)!r}`. All-reduces are DDP gradient buckets counted "
        "by a comm hook (this model fits one bucket).",
        markdown_table(verdicts),
        "Communication per optimizer step as the micro-batches per rank N grow (float64 gradients): "
        "`no_sync` keeps it at one all-reduce per window.",
        markdown_table(communication),
        "## Loss-scale window (dynamic loss scaling, one overflowing sample)",
        f"Case `{scaled!r}` with `overflow_at=[1, sample]`: the full-batch step skips step 1 and backs the "
        "scale off once; so must the accumulation, whichever micro-batch overflowed.",
        markdown_table(loss_scale),
    ])

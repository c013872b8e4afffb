"""What the tensor-parallel section of reports/equivalence.md shows, measured: clipping under TP and FSDP2 + TP.

Every step of :data:`equiv.zoo.tensor_parallel_bugs.TP_ZOO` checked with an
active clip norm under ``engine="tp"`` (2 TP ranks, one data rank) and
``engine="fsdp2+tp"`` (2 data ranks x 2 TP ranks), and searched with
:func:`equiv.verify_distributed` under ``"tp"`` (the engine where the zoo's
local sample weighting is right on every drawn split, so a finding is its
clipping).  Only statuses and the shrunk split are printed: the same on every
machine.  :mod:`equiv.reporting.tensor_parallel` renders it.
"""

from __future__ import annotations

import logging

import pandas as pd

from equiv.cases.case import Case
from equiv.checking.distributed import DistributedCase, check_distributed
from equiv.checking.distributed_search import verify_distributed
from equiv.findings.results import TensorParallelFindings
from equiv.outcomes import Outcome, outcome_words
from equiv.zoo.tensor_parallel_bugs import TP_ZOO, TensorParallelEntry

__all__ = ["TP_SPLITS", "measure_tensor_parallel", "tensor_parallel_table"]

log = logging.getLogger(__name__)

_SEED = 0
_EXAMPLES = 10
_CLIPPED = Case(
    batch_size=1,
    micro_batch_sizes=(1,),
    model_kwargs={"hidden": (8,), "activation": "tanh"},
    optimizer="Adam",
    optimizer_kwargs={"lr": 1e-2},
    steps=2,
    max_grad_norm=1e-2,
)
#: engine -> the data ranks' micro-batches (2 TP ranks each): equal data shards under FSDP2 + TP.
TP_SPLITS: dict[str, list[list[int]]] = {"tp": [[1, 2]], "fsdp2+tp": [[1, 2], [2, 1]]}


def _cell(entry: TensorParallelEntry, status: Outcome) -> str:
    if status is Outcome.NOT_EQUIVALENT:
        return f"NOT ({entry.upstream})" if entry.upstream else "NOT"
    return outcome_words(status)


def tensor_parallel_table() -> pd.DataFrame:
    rows = []
    for name, entry in TP_ZOO.items():
        row = {"step": f"`{name}`", "what": entry.what}
        statuses = []
        for engine, split in TP_SPLITS.items():
            verdict = check_distributed(
                entry.step, DistributedCase.of(_CLIPPED, split, tensor_parallel=2), engine=engine
            )
            statuses.append(verdict.status)
            row[f"{engine.upper()} {split}"] = _cell(entry, verdict.status)
        result = verify_distributed(entry.step, engines=("tp",), models=("mlp",), max_examples=_EXAMPLES, seed=_SEED)
        log.info("tensor parallel: %s: search %s", name, result.outcome)
        found = result.counterexample
        row["search under TP"] = (
            "nothing found"
            if found is None
            else (
                f"found, shrunk to {[list(s) for s in found.rank_micro_batch_sizes]}"
                f"{', clipped' if found.case.max_grad_norm is not None else ''}"
            )
        )
        # A bug must be found by the checks and the search alike; a correct step by neither.
        searched_right = (found is not None) == (entry.expected is Outcome.NOT_EQUIVALENT)
        row["as expected"] = "yes" if searched_right and all(s is entry.expected for s in statuses) else "NO"
        rows.append(row)
    return pd.DataFrame(rows)


def measure_tensor_parallel() -> TensorParallelFindings:
    """The tensor-parallel section's findings: :func:`tensor_parallel_table` and the search's settings."""
    return TensorParallelFindings(table=tensor_parallel_table(), examples=_EXAMPLES, seed=_SEED)

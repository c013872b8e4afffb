"""The tensor-parallel section of reports/equivalence.md: clipping under TP and FSDP2 + TP.

Every step of :data:`equiv.zoo.tensor_parallel_bugs.TP_ZOO` checked with an
active clip norm under ``engine="tp"`` (2 TP ranks, one data rank) and
``engine="fsdp2+tp"`` (2 data ranks x 2 TP ranks), and searched with
:func:`equiv.verify_distributed` under ``"tp"`` (the engine where the zoo's
local sample weighting is right on every drawn split, so a finding is its
clipping).  Only statuses and the shrunk split are printed: the same on every
machine.
"""

from __future__ import annotations

import logging

import pandas as pd

from equiv.cases.case import Case
from equiv.checking.distributed import DistributedCase, check_distributed
from equiv.checking.distributed_search import verify_distributed
from equiv.outcomes import Outcome
from equiv.reporting.markdown import markdown_table
from equiv.zoo.tensor_parallel_bugs import TP_ZOO, TensorParallelEntry

__all__ = ["TP_SPLITS", "tensor_parallel_section", "tensor_parallel_table"]

log = logging.getLogger(__name__)

_SEED = 0
_EXAMPLES = 10
_CLIPPED = Case(batch_size=1, micro_batch_sizes=(1,), model_kwargs={"hidden": (8,), "activation": "tanh"},
                optimizer="Adam", optimizer_kwargs={"lr": 1e-2}, steps=2, max_grad_norm=1e-2)
#: engine -> the data ranks' micro-batches (2 TP ranks each): equal data shards under FSDP2 + TP.
TP_SPLITS: dict[str, list[list[int]]] = {"tp": [[1, 2]], "fsdp2+tp": [[1, 2], [2, 1]]}


def _cell(entry: TensorParallelEntry, status: Outcome) -> str:
    if status is Outcome.NOT_EQUIVALENT:
        return f"NOT ({entry.upstream})" if entry.upstream else "NOT"
    return status.replace("_", " ")


def tensor_parallel_table() -> pd.DataFrame:
    rows = []
    for name, entry in TP_ZOO.items():
        row = {"step": f"`{name}`", "what": entry.what}
        statuses = []
        for engine, split in TP_SPLITS.items():
            verdict = check_distributed(entry.step, DistributedCase.of(_CLIPPED, split, tensor_parallel=2),
                                        engine=engine)
            statuses.append(verdict.status)
            row[f"{engine.upper()} {split}"] = _cell(entry, verdict.status)
        result = verify_distributed(entry.step, engines=("tp",), models=("mlp",), max_examples=_EXAMPLES, seed=_SEED)
        log.info("tensor parallel: %s: search %s", name, result.kind)
        found = result.counterexample
        row["search under TP"] = "nothing found" if found is None else (
            f"found, shrunk to {[list(s) for s in found.rank_micro_batch_sizes]}"
            f"{', clipped' if found.case.max_grad_norm is not None else ''}")
        # A bug must be found by the checks and the search alike; a correct step by neither.
        searched_right = (found is not None) == (entry.expected is Outcome.NOT_EQUIVALENT)
        row["as expected"] = "yes" if searched_right and all(s is entry.expected for s in statuses) else "NO"
        rows.append(row)
    return pd.DataFrame(rows)


def tensor_parallel_section() -> str:
    return "\n\n".join([
        "## Tensor parallelism: clipping over DTensor shards",
        "`equiv.check_distributed(step, DistributedCase.of(case, split, tensor_parallel=2), engine=...)` on gloo "
        "ranks: `\"tp\"` applies `parallelize_module` (`ColwiseParallel` on the MLP's first `nn.Linear`, "
        "`RowwiseParallel` on its second, whose bias stays replicated) on a 1-D mesh of 2 ranks that see the same "
        "micro-batches; `\"fsdp2+tp\"` does the same inside each row of a 2 x 2 `(dp, tp)` mesh and then "
        "`fully_shard` over `dp`. Case: the MLP (4-8-3, tanh), Adam, 2 steps, clip norm 0.01 (active). Columns "
        "name the data ranks' micro-batches. The window's gradient norm must cover every shard of every parameter, "
        "replicated ones once, once per window: the reference `Accumulator` (`get_total_norm` on the DTensor "
        "gradients; under FSDP2 + TP the item count summed over the data ranks only) is exact under both. "
        f"'search under TP': `verify_distributed(step, engines=('tp',), models=('mlp',), max_examples={_EXAMPLES}, "
        f"seed={_SEED})`, the split shrunk; the zoo weights micro-batches by its own samples, right under TP on "
        "every split, so what the search finds is the clipping.",
        markdown_table(tensor_parallel_table()),
    ])

"""The distributed search's findings and the torchrun runs, measured for reports/equivalence.md.

- :func:`measure_distributed_search`: every step of
  :data:`equiv.zoo.distributed_bugs.SEARCH_ZOO` through
  :func:`equiv.verify_distributed` at a fixed seed, no split picked by hand:
  what it found and the split it shrank to, each bug with the upstream report
  it reproduces.
- :func:`torchrun_table`: ``torchrun --standalone --nproc-per-node 2 -m equiv
  check-distributed STEP`` on the standard splits, as a user runs it.

Only facts that hold on every machine are kept: pass / fail, the shrunk
split of a mismatch (the search is steered by pass / fail alone).  A rank fault
is kept as one, without the split: whether a deadlocked DDP rank is seen
as a hang or, first, as a mismatched collective depends on timing, and only a
mismatch is shrunk.  :mod:`equiv.reporting.distributed_findings` renders both.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd

from equiv.checking.distributed_search import standard_distributed_cases, verify_distributed
from equiv.findings.results import RANK_FAULT, DistributedSearchFindings
from equiv.outcomes import Outcome
from equiv.zoo.distributed_bugs import SEARCH_ZOO, SearchEntry

__all__ = ["measure_distributed_search", "torchrun_table"]

log = logging.getLogger(__name__)

_SEED = 0
_EXAMPLES = 25
#: The steps run under torchrun (SEARCH_ZOO names): the reference and bugs of each kind.
_TORCHRUN = ("accumulator_step (DDP)", "local_mean_per_rank", "local_token_mean_per_rank", "global_item_count",
             "accumulator_step (FSDP2)", "clip_shard_with_local_norm")


def _found(kind: Outcome | None) -> str:
    if kind is None:
        return "nothing"
    return RANK_FAULT if kind is Outcome.STEP_ERROR else kind.replace("_", " ")


def _upstream(entry: SearchEntry) -> str:
    return entry.upstream or "equiv's zoo, no upstream report"


def measure_distributed_search() -> DistributedSearchFindings:
    """Every step of ``SEARCH_ZOO`` searched: what was found, the split it shrank to, the upstream report."""
    rows = []
    for name, entry in SEARCH_ZOO.items():
        result = verify_distributed(entry.step, engines=(entry.engine,), models=entry.models,
                                    max_examples=_EXAMPLES, seed=_SEED)
        log.info("distributed search: %s: %s", name, result.kind)
        expected = None if entry.expected is Outcome.EQUIVALENT else entry.expected
        shown = result.counterexample is not None and result.kind is not Outcome.STEP_ERROR
        split = "-" if not shown else "; ".join(
            str(list(sizes)) for sizes in result.counterexample.rank_micro_batch_sizes  # type: ignore[union-attr]
        )
        rows.append({
            "step": name,
            "engine": entry.engine.upper(),
            "models drawn": ", ".join(entry.models),
            "what": entry.what,
            "expected": _found(expected),
            "found": _found(result.kind),
            "as expected": "yes" if result.kind == expected else "NO",
            "shrunk split (samples per micro-batch, per rank)": split,
            "upstream": _upstream(entry) if entry.expected is not Outcome.EQUIVALENT else (entry.upstream or "-"),
        })
    return DistributedSearchFindings(table=pd.DataFrame(rows), examples=_EXAMPLES, seed=_SEED)


def _torchrun(target: str, engine: str, out: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "equiv",
         "check-distributed", target, "--engine", engine, "--json", str(out)],
        env=env, capture_output=True, text=True, timeout=600,
    )


def torchrun_table() -> pd.DataFrame:
    """One row per step of ``_TORCHRUN`` run under torchrun on 2 ranks, one column per standard split."""
    rows = []
    case_names: list[str] = []
    for name in _TORCHRUN:
        entry = SEARCH_ZOO[name]
        target = f"{entry.step.__module__}:{entry.step.__qualname__}"
        cases = list(standard_distributed_cases(2, entry.engine))
        case_names += [case for case in cases if case not in case_names]
        with tempfile.TemporaryDirectory(prefix="equiv-torchrun-") as folder:
            out = Path(folder) / "verdicts.json"
            run = _torchrun(target, entry.engine, out)
            log.info("torchrun: %s (%s): exit %d", name, entry.engine, run.returncode)
            if not out.exists():
                raise RuntimeError(f"torchrun wrote no verdicts for {target}: {run.stderr[-2000:]}")
            verdicts = {v["case_name"]: v for v in json.loads(out.read_text())["cases"]}
        row = {"step": name, "engine": entry.engine.upper()}
        for case in cases:
            verdict = verdicts.get(case)
            if verdict is None:
                row[case] = "not run (after a rank fault)"
            elif verdict["status"] == Outcome.STEP_ERROR:
                row[case] = RANK_FAULT
            elif verdict["status"] == Outcome.NOT_EQUIVALENT:
                row[case] = f"NOT ({_upstream(entry)})"
            else:
                row[case] = verdict["status"].replace("_", " ")
        rows.append(row)
    return pd.DataFrame(rows, columns=["step", "engine", *case_names]).fillna("- (DDP only)")

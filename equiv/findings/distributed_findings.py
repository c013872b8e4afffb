"""The distributed search's findings and the torchrun runs, measured for reports/equivalence.md.

- :func:`measure_distributed_search`: every step of
  :data:`equiv.zoo.distributed_bugs.SEARCH_ZOO` through
  :func:`equiv.verify_distributed` at a fixed seed, no split picked by hand:
  what it found and the split it shrank to, each bug with the upstream report
  it reproduces.
- :func:`measure_context_parallel_search` and :func:`measure_aux_loss_search`:
  the same for the context-parallel zoo (``"cp"`` / ``"fsdp2+cp"``, up to 2 data
  x 2 context ranks) and the router aux / z-loss zoo (the MoE model, DDP / FSDP2).
- :func:`torchrun_table`: ``torchrun --standalone --nproc-per-node 2 -m equiv
  check-distributed STEP`` on the standard splits, as a user runs it.

Only facts that hold on every machine are kept: pass / fail, the shrunk
split of a mismatch or of mismatched collectives (the search is steered by pass /
fail alone; every collective a DDP or FSDP2 step makes, DDP's C++ bucket rebuild
included, is in the collective log, so ranks that part are named at the same
call on every machine).  A hang is kept without its split: the search stops at
it unshrunk.  :mod:`equiv.reporting.distributed_findings` renders both.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

import pandas as pd

from equiv.checking.distributed import DistributedCase
from equiv.checking.distributed_search import standard_distributed_cases, verify_distributed
from equiv.findings.results import RANK_FAULT, DistributedSearchFindings
from equiv.outcomes import Fault, Outcome, outcome_words
from equiv.zoo.aux_loss_bugs import AUX_SEARCH_ZOO
from equiv.zoo.context_parallel_bugs import CP_SEARCH_ZOO
from equiv.zoo.distributed_bugs import SEARCH_ZOO, SearchEntry

__all__ = [
    "CP_MAX_WORLD_SIZE",
    "measure_aux_loss_search",
    "measure_context_parallel_search",
    "measure_distributed_search",
    "search_zoo_rows",
    "torchrun_table",
]

log = logging.getLogger(__name__)

_SEED = 0
_EXAMPLES = 25
#: The steps run under torchrun (SEARCH_ZOO names): the reference and bugs of each kind.
_TORCHRUN = (
    "accumulator_step (DDP)",
    "local_mean_per_rank",
    "local_token_mean_per_rank",
    "global_item_count",
    "accumulator_step (FSDP2)",
    "clip_shard_with_local_norm",
)


def _found(outcome: Outcome | None) -> str:
    if outcome is None:
        return "nothing"
    return RANK_FAULT if outcome is Outcome.STEP_ERROR else outcome_words(outcome)


def _upstream(entry: SearchEntry) -> str:
    return entry.upstream or "equiv's zoo, no upstream report"


def search_zoo_rows(zoo: Mapping[str, SearchEntry], *, max_world_size: int = 3) -> pd.DataFrame:
    """Every step of ``zoo`` searched at the report's seed: what was found, the split it shrank to, the upstream report.

    Args:
        zoo: name -> :class:`~equiv.zoo.distributed_bugs.SearchEntry`.
        max_world_size: the most ranks a drawn case may have.

    Returns:
        One row per step.
    """
    rows = []
    for name, entry in zoo.items():
        result = verify_distributed(
            entry.step,
            engines=(entry.engine,),
            models=entry.models,
            optimizers=entry.optimizers,
            max_examples=_EXAMPLES,
            seed=_SEED,
            max_world_size=max_world_size,
        )
        log.info("distributed search: %s: %s", name, result.outcome)
        expected = None if entry.expected is Outcome.EQUIVALENT else entry.expected
        found = result.counterexample
        # A split is shown where it is the same on every machine: a mismatch, and mismatched
        # collectives (shrunk like one); not a hang (the search stops at it, unshrunk).
        named = result.fault is Fault.COLLECTIVE_MISMATCH
        shown = found is not None and (result.outcome is not Outcome.STEP_ERROR or named)
        split = (
            "-"
            if not shown
            else "; ".join(
                str(list(sizes))
                for sizes in found.rank_micro_batch_sizes  # type: ignore[union-attr]
            )
            + _split_notes(found)  # type: ignore[arg-type]
        )
        rows.append(
            {
                "step": name,
                "engine": entry.engine.upper(),
                "models drawn": ", ".join(entry.models),
                "what": entry.what,
                "expected": _found(expected),
                "found": _found(result.outcome),
                "as expected": "yes" if result.outcome == expected else "NO",
                "shrunk split (samples per micro-batch, per rank)": split,
                "upstream": _upstream(entry) if entry.expected is not Outcome.EQUIVALENT else (entry.upstream or "-"),
            }
        )
    return pd.DataFrame(rows)


def _split_notes(found: DistributedCase) -> str:
    """What the split alone does not say: slices per data rank, samples with no real token."""
    notes = []
    if found.context_parallel > 1:
        notes.append(f"{found.context_parallel} sequence slices per data rank")
    elif found.sequence_slices > 1:
        notes.append(f"sequence parallel: {found.sequence_slices} TP slices per data rank")
    if found.case.empty_samples:
        notes.append(f"no real token in sample(s) {list(found.case.empty_samples)}")
    return f" ({'; '.join(notes)})" if notes else ""


def measure_distributed_search() -> DistributedSearchFindings:
    """Every step of ``SEARCH_ZOO`` searched: what was found, the split it shrank to, the upstream report."""
    return DistributedSearchFindings(table=search_zoo_rows(SEARCH_ZOO), examples=_EXAMPLES, seed=_SEED)


#: Data x context ranks a context-parallel case may draw: 1 or 2 data ranks of 2 slices.
CP_MAX_WORLD_SIZE = 4


def measure_context_parallel_search() -> DistributedSearchFindings:
    """Every step of :data:`~equiv.zoo.context_parallel_bugs.CP_SEARCH_ZOO` searched under its CP engine."""
    return DistributedSearchFindings(
        table=search_zoo_rows(CP_SEARCH_ZOO, max_world_size=CP_MAX_WORLD_SIZE),
        examples=_EXAMPLES,
        seed=_SEED,
        max_world_size=CP_MAX_WORLD_SIZE,
    )


def measure_aux_loss_search() -> DistributedSearchFindings:
    """Every step of :data:`~equiv.zoo.aux_loss_bugs.AUX_SEARCH_ZOO` searched on the MoE model."""
    return DistributedSearchFindings(table=search_zoo_rows(AUX_SEARCH_ZOO), examples=_EXAMPLES, seed=_SEED)


def _torchrun(target: str, engine: str, out: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "equiv",
            "check-distributed",
            target,
            "--engine",
            engine,
            "--json",
            str(out),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
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
                row[case] = outcome_words(verdict["status"])
        rows.append(row)
    return pd.DataFrame(rows, columns=["step", "engine", *case_names]).fillna("- (DDP only)")

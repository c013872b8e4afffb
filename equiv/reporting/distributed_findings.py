"""The distributed search's findings and the torchrun runs, as sections of reports/equivalence.md.

- :func:`distributed_search_section`: every step of
  :data:`equiv.zoo.distributed_bugs.SEARCH_ZOO` through
  :func:`equiv.verify_distributed` at a fixed seed, no split picked by hand:
  what it found and the split it shrank to, each bug with the upstream report
  it reproduces.
- :func:`torchrun_section`: ``torchrun --standalone --nproc-per-node 2 -m equiv
  check-distributed STEP`` on the standard splits, as a user runs it.

Only facts that hold on every machine are printed: pass / fail, the shrunk
split of a mismatch (the search is steered by pass / fail alone).  A rank fault
is printed as one, without the split: whether a deadlocked DDP rank is seen
as a hang or, first, as a mismatched collective depends on timing, and only a
mismatch is shrunk.
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
from equiv.outcomes import Outcome
from equiv.reporting.markdown import markdown_table
from equiv.zoo.distributed_bugs import SEARCH_ZOO, SearchEntry

__all__ = ["distributed_search_section", "torchrun_section"]

log = logging.getLogger(__name__)

_SEED = 0
_EXAMPLES = 25
_FAULT = "a rank hung or made mismatched collectives"
#: The steps run under torchrun (SEARCH_ZOO names): the reference and bugs of each kind.
_TORCHRUN = ("accumulator_step (DDP)", "local_mean_per_rank", "local_token_mean_per_rank", "global_item_count",
             "accumulator_step (FSDP2)", "clip_shard_with_local_norm")


def _found(kind: Outcome | None) -> str:
    if kind is None:
        return "nothing"
    return _FAULT if kind is Outcome.STEP_ERROR else kind.replace("_", " ")


def _upstream(entry: SearchEntry) -> str:
    return entry.upstream or "equiv's zoo, no upstream report"


def distributed_search_section() -> str:
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
    return "\n\n".join([
        "## Distributed search (no split picked by hand)",
        f"`equiv.verify_distributed(step, engines=(engine,), models=..., max_examples={_EXAMPLES}, seed={_SEED})` "
        "on every step of `equiv.zoo.distributed_bugs.SEARCH_ZOO`: Hypothesis draws 2-3 ranks, each rank's number "
        "and sizes of micro-batches (under FSDP2 the same number on every rank), a sample-mean MLP or a token model "
        "whose padded sequences give ranks different real-token counts, SGD or Adam, 1-2 steps and, for a step "
        "that takes `max_grad_norm`, an active clip norm; each case runs on spawned gloo ranks and a mismatch is "
        "shrunk to the smallest split that still shows it. A correct step must give nothing in every drawn case. "
        f"\"{_FAULT}\": under DDP, a step that syncs every micro-batch deadlocks on ranks holding different "
        "numbers of micro-batches (the search reports it; the split is left out, as whether it is seen as a hang "
        "or, first, as mismatched collectives depends on timing).",
        markdown_table(pd.DataFrame(rows)),
    ])


def _torchrun(target: str, engine: str, out: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "equiv",
         "check-distributed", target, "--engine", engine, "--json", str(out)],
        env=env, capture_output=True, text=True, timeout=600,
    )


def torchrun_section() -> str:
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
            verdicts = {v["case_name"]: v for v in json.loads(out.read_text())}
        row = {"step": name, "engine": entry.engine.upper()}
        for case in cases:
            verdict = verdicts.get(case)
            if verdict is None:
                row[case] = "not run (after a rank fault)"
            elif verdict["status"] == Outcome.STEP_ERROR:
                row[case] = _FAULT
            elif verdict["status"] == Outcome.NOT_EQUIVALENT:
                row[case] = f"NOT ({_upstream(entry)})"
            else:
                row[case] = verdict["status"].replace("_", " ")
        rows.append(row)
    table = pd.DataFrame(rows, columns=["step", "engine", *case_names]).fillna("- (DDP only)")
    return "\n\n".join([
        "## torchrun (the launcher users already have)",
        "`torchrun --standalone --nproc-per-node 2 -m equiv check-distributed MODULE:STEP [--engine fsdp2]` on "
        "this machine's CPU (gloo): every rank reads torchrun's environment, rank 0 computes the single-process "
        "references, posts each task to the other rank through torchrun's rendezvous store and prints the "
        "verdicts. With no `--split`, the standard splits (`standard_distributed_cases`): rank r holds "
        "micro-batches of 1 and r + 2 samples (ranks differ in samples, and on the token model in real tokens); "
        "under DDP also r + 1 micro-batches of 2 samples; an active clip norm (n/a to a step without "
        "`max_grad_norm`). Across machines the same command runs on each with `--nnodes` and a c10d rendezvous "
        "(README).",
        markdown_table(table),
    ])

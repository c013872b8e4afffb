"""The distributed search's findings and the torchrun runs, as sections of reports/equivalence.md.

- :func:`distributed_search_section`: what the search of every step of
  ``SEARCH_ZOO`` found and the split it shrank to, with the upstream report
  each bug reproduces;
- :func:`torchrun_section`: ``equiv check-distributed`` under torchrun on the
  standard splits, as a user runs it.

Both render what :mod:`equiv.findings.distributed_findings` measured (only
facts that hold on every machine; see there why a rank fault is shown
without its split).  Nothing here measures.
"""

from __future__ import annotations

import pandas as pd

from equiv.findings.results import RANK_FAULT, DistributedSearchFindings
from equiv.reporting.markdown import markdown_table

__all__ = ["distributed_search_section", "torchrun_section"]


def distributed_search_section(findings: DistributedSearchFindings) -> str:
    """The section, from :func:`equiv.findings.distributed_findings.measure_distributed_search`."""
    return "\n\n".join([
        "## Distributed search (no split picked by hand)",
        "`equiv.verify_distributed(step, engines=(engine,), models=..., "
        f"max_examples={findings.examples}, seed={findings.seed})` "
        "on every step of `equiv.zoo.distributed_bugs.SEARCH_ZOO`: Hypothesis draws 2-3 ranks, each rank's number "
        "and sizes of micro-batches (under FSDP2 the same number on every rank), a sample-mean MLP or a token model "
        "whose padded sequences give ranks different real-token counts, SGD or Adam, 1-2 steps and, for a step "
        "that takes `max_grad_norm`, an active clip norm; each case runs on spawned gloo ranks and a mismatch is "
        "shrunk to the smallest split that still shows it. A correct step must give nothing in every drawn case. "
        f"\"{RANK_FAULT}\": under DDP, a step that syncs every micro-batch deadlocks on ranks holding different "
        "numbers of micro-batches (the search reports it; the split is left out, as whether it is seen as a hang "
        "or, first, as mismatched collectives depends on timing).",
        markdown_table(findings.table),
    ])


def torchrun_section(table: pd.DataFrame) -> str:
    """The section, from :func:`equiv.findings.distributed_findings.torchrun_table`."""
    return "\n\n".join([
        "## torchrun (the launcher users already have)",
        "`torchrun --standalone --nproc-per-node 2 -m equiv check-distributed MODULE:STEP [--engine fsdp2]` on "
        "this machine's CPU (gloo): every rank reads torchrun's environment, rank 0 computes the single-process "
        "references, posts each task to the other rank through torchrun's rendezvous store and prints the "
        "verdicts. With no `--split`, the standard splits (`standard_distributed_cases`): rank r holds "
        "micro-batches of 1 and r + 2 samples (ranks differ in samples, and on the token model in real tokens); "
        "under DDP also r + 1 micro-batches of 2 samples; an active clip norm (n/a to a step without "
        "`max_grad_norm`). Across machines the same command runs on each with `--nnodes` and a c10d rendezvous "
        "(docs/distributed.md).",
        markdown_table(table),
    ])

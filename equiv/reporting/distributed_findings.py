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

__all__ = ["aux_loss_section", "context_parallel_section", "distributed_search_section", "torchrun_section"]


def distributed_search_section(findings: DistributedSearchFindings) -> str:
    """The section, from :func:`equiv.findings.distributed_findings.measure_distributed_search`."""
    return "\n\n".join(
        [
            "## Distributed search (no split picked by hand)",
            "`equiv.verify_distributed(step, engines=(engine,), models=..., "
            f"max_examples={findings.examples}, seed={findings.seed})` "
            "on every step of `equiv.zoo.distributed_bugs.SEARCH_ZOO`: Hypothesis draws 2-3 ranks, each rank's number "
            "and sizes of micro-batches (under FSDP2 the same number on every rank), a sample-mean MLP or a token model "
            "whose padded sequences give ranks different real-token counts, SGD or Adam (Muon on a bias-free MLP for the Muon rows), 1-2 steps and, for a step "
            "that takes `max_grad_norm`, an active clip norm; each case runs on spawned gloo ranks and a mismatch is "
            "shrunk to the smallest split that still shows it. A correct step must give nothing in every drawn case. "
            '"precision": a step computing its gradient in bfloat16 (its own accumulation buffer, a compressed '
            "all-reduce) is a precision finding of class `bfloat16_arithmetic`, failing float32 master weights and "
            "gradients: the ranks run it again with its bfloat16 lifted to each tier's dtype and then match. "
            f'"{RANK_FAULT}": ranks that make different collectives, e.g. under DDP a step that syncs every '
            "micro-batch on ranks holding different numbers of micro-batches, or one that skips the synced backward "
            "on one rank; every collective is recorded before it runs (DDP's gradient all-reduces and its bucket "
            "rebuild included), so the first difference is named at once and shrunk like a mismatch (a hang would "
            "be reported without its split).",
            markdown_table(findings.table),
        ]
    )


def context_parallel_section(findings: DistributedSearchFindings) -> str:
    """The section, from :func:`equiv.findings.distributed_findings.measure_context_parallel_search`."""
    return "\n\n".join(
        [
            "## Context parallelism: the real-token count over every slice",
            '`equiv.check_distributed(step, DistributedCase.of(case, split, context_parallel=2), engine="cp")`: each '
            "data rank's micro-batches are served by 2 ranks, each holding one contiguous half of every sequence's "
            "positions (inputs and targets) of the position-wise token model, the model DDP-wrapped over every rank "
            '(data x context, as Megatron reduces over its DP x CP group); `"fsdp2+cp"` shards with FSDP2 over the '
            "same ranks. The reference is the float64 full-batch step on whole sequences: the mean over the window's "
            "real tokens, every slice of every data rank. Padding sits at the end of each sequence, so slices hold "
            "ragged numbers of real tokens and the second often none; the search also draws a micro-batch with no "
            "real token on one data rank. Steps read their groups from `equiv.distributed.context_parallel.layout()`. "
            f"`equiv.verify_distributed(step, engines=(engine,), models=('tokens',), max_world_size="
            f"{findings.max_world_size}, max_examples={findings.examples}, seed={findings.seed})` on every step of "
            "`equiv.zoo.context_parallel_bugs.CP_SEARCH_ZOO`, no split picked by hand (1 or 2 data ranks of 2 slices).",
            markdown_table(findings.table),
        ]
    )


def aux_loss_section(findings: DistributedSearchFindings) -> str:
    """The section, from :func:`equiv.findings.distributed_findings.measure_aux_loss_search`."""
    return "\n\n".join(
        [
            "## Router aux and z-losses under data, context and sequence parallelism",
            'The MoE model (`model="moe"`, sequence-wise load-balancing loss at weight 0.1 and a router z-loss, the '
            'mean over a sequence\'s tokens of `logsumexp(router_logits)^2`, at weight 0.01, `loss="mse_aux"`), drawn '
            "by the distributed search under DDP and FSDP2. The full-batch objective is the mean over the window's "
            "samples of task loss + router losses, so the router losses take the task loss's weight: summed, over the "
            "global sample count, times the world size DDP's average divides out. Under CP the search draws `moe` as "
            'the token-level MoE (`model="token_moe"`, `loss="token_mse_aux"`: an output at every position, each '
            "token carrying its share of its sequence's router losses, the routing counts summed over the sequence's "
            "slices in the forward as Megatron's router sums them over its TP x CP group): each slice's router shares "
            "take the task's weight, data x context ranks over the global token count. "
            f"`equiv.verify_distributed(step, engines=(engine,), models=('moe',), max_examples={findings.examples}, "
            f"seed={findings.seed})` on every step of `equiv.zoo.aux_loss_bugs.AUX_SEARCH_ZOO`. Under TP the search "
            "draws the same token-level MoE sequence-parallel (one data rank, each of its 2 TP ranks routing a slice "
            "of every sequence's tokens, the routing counts summed over the TP group, the replicated weights' "
            "gradients reduced over it), so the TP side of the same reports is searched too: the per-token path "
            "short of the TP x CP tokens (Megatron-LM PR #5047) and the z-loss summed over the TP slices (commit "
            "cac8d1a) are found on engine TP as on CP.",
            markdown_table(findings.table),
        ]
    )


def torchrun_section(table: pd.DataFrame) -> str:
    """The section, from :func:`equiv.findings.distributed_findings.torchrun_table`."""
    return "\n\n".join(
        [
            "## torchrun (the launcher users already have)",
            "`torchrun --standalone --nproc-per-node 2 -m equiv check-distributed MODULE:STEP [--engine fsdp2]` on "
            "this machine's CPU (gloo): every rank reads torchrun's environment, rank 0 computes the single-process "
            "references, posts each task to the other rank through torchrun's rendezvous store and prints the "
            "verdicts. With no `--split`, the standard splits (`standard_distributed_cases`): rank r holds "
            "micro-batches of 1 and r + 2 samples (ranks differ in samples, and on the token model in real tokens); "
            "under DDP also r + 1 micro-batches of 2 samples; an active clip norm (n/a to a step without "
            "`max_grad_norm`); torch's Muon on the MLP without biases (its bfloat16 Newton-Schulz lifted to float64 in "
            "the float64 tier: docs/distributed.md). Across machines the same command runs on each with `--nnodes` and a c10d rendezvous "
            "(docs/distributed.md).",
            markdown_table(table),
        ]
    )

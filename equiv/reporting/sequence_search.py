"""Packed sequences, RL loss normalisers and the accumulation buffer's precision, as sections of reports/equivalence.md.

Each renders what :mod:`equiv.findings.sequence_search` measured (one zoo
searched with :func:`equiv.verify` at the report's seed; only facts that hold on
every machine).  Nothing here measures.
"""

from __future__ import annotations

from collections.abc import Iterable

import pandas as pd

from equiv.findings.results import ZooSearchFindings
from equiv.reporting.markdown import markdown_table

__all__ = ["packed_section", "policy_section", "precision_section"]


def _searched(findings: ZooSearchFindings, zoo: str, loss_names: str) -> str:
    return (
        f"`equiv.verify(step, SearchSpace(losses=(loss,)), max_examples={findings.examples}, "
        f"seed={findings.seed})`: the reference accumulator on every {loss_names} loss, then every step of "
        f"`{zoo}` on the loss its report is about, no case picked by hand. A correct step must give nothing "
        "in every drawn case; a bug is shrunk to the smallest case that still shows it."
    )


def packed_section(findings: ZooSearchFindings) -> str:
    """The section, from :func:`equiv.findings.sequence_search.measure_packed_search`."""
    return "\n\n".join(
        [
            "## Packed sequences: per-token, per-sequence and per-row losses, packed DPO",
            "Packing puts several sequences in one row, so the items a loss averages are neither the rows nor the "
            "micro-batch's tokens: a mean taken per row or per micro-batch weighs a sequence by how it was packed, "
            "and a DPO pair read the wrong way round trains the rejected answer up (a gradient of the wrong sign, "
            "ms-swift #10144). The `packed_lm` model: position ids restart at each sequence (-1 on padding), "
            "attention kept within a sequence; the full-batch objective of each loss is its mean over the "
            "window's tokens (`packed_token_ce`), sequences (`packed_sequence_ce`), rows (`packed_row_ce`) or "
            "chosen/rejected pairs (`packed_dpo`, TRL's sigmoid DPO loss). "
            + _searched(findings, "equiv.zoo.sequence_bugs.PACKED_BUGS", "packed"),
            markdown_table(findings.table),
        ]
    )


def policy_section(findings: ZooSearchFindings) -> str:
    """The section, from :func:`equiv.findings.sequence_search.measure_policy_search`."""
    return "\n\n".join(
        [
            "## RL loss normalisers: GRPO, DAPO, Dr. GRPO",
            "The truth is each trainer's documented full-batch objective (the `GRPOObjective` the TRL audit of "
            "reports/peers.md uses): GRPO's mean over completions of each completion's token mean, DAPO's mean over "
            "the batch's tokens (BNPO over one batch), Dr. GRPO's sum over a constant. Where the normaliser is taken "
            "per micro-batch or per worker the split changes the objective: a mean of micro-batch token means "
            "(SkyRL PR #925 / #1296; its SFT path still open, #1504), token means weighted per sequence by default "
            "with the fix an opt-in flag (Trinity-RFT #336), each micro-batch divided by the tokens its filter kept "
            "(AReaL #1730). The `policy` model gives each completion its log-probs, advantages and masks. "
            + _searched(findings, "equiv.zoo.sequence_bugs.POLICY_BUGS", "policy"),
            markdown_table(findings.table),
        ]
    )


def precision_section(findings: ZooSearchFindings, distributed: Iterable[pd.DataFrame] = ()) -> str:
    """The section, from :func:`equiv.findings.sequence_search.measure_precision_search`, then the
    rows of ``distributed`` (the distributed searches' tables) whose expected outcome is a precision finding."""
    precision_rows = [table[table["expected"] == "precision"] for table in distributed if "expected" in table]
    shown = pd.concat(precision_rows, ignore_index=True) if precision_rows else pd.DataFrame()
    return "\n\n".join(
        [
            "## Precision of the accumulation buffer",
            "A step that sums its micro-batch gradients in bfloat16 loses all but 8 bits of each (ISEEKYAN #149: "
            "bf16 gradient accumulation 3.5e-5 relative where float32 buffers agree to 2.7e-8, Megatron-FSDP). That "
            "is neither a mathematical mismatch nor a pass: a precision finding (`bfloat16_arithmetic`), proven by "
            "running the step again with its bfloat16 lifted to the run's dtype, which then matches. It fails a user "
            "whose master weights and gradients are float32 and passes one who trains in bfloat16; a float32 buffer "
            "passes float32 training and is a float32-sized finding only for float64 training. "
            f"`equiv.verify(step, SearchSpace(item_weighted=True, optimizers=...), max_examples={findings.examples}, "
            f"seed={findings.seed}, train_dtype=...)` on every entry of `equiv.zoo.precision.PRECISION_SEARCH` (the "
            "correct loops of `equiv.zoo.correct.FLOAT32_ON_THE_GRADIENT` each for float32 and float64 training). A "
            "precision finding is not shrunk (the search looks on for a mathematical mismatch): its case is the first "
            "drawn. Sensitivity: the smallest relative difference the check resolves in a dtype is its smallest "
            "allowance over the tensor's scale, 32 x the full-batch run's own error (measured: its digits move with "
            "the CPU's kernels, `equiv check` prints them) + 16 x steps x the dtype's unit roundoff, so never below "
            "the constant shown, and below one bfloat16 rounding in every dtype judged, or the finding could not be "
            "told apart. Under a sign-based optimizer (Rprop) a rounding that flips a small element's sign is a "
            "different update, not a rounding of it.",
            markdown_table(findings.table),
            *(
                []
                if shown.empty
                else [
                    "The distributed searches' precision entries (their rows above, repeated):",
                    markdown_table(shown),
                ]
            ),
        ]
    )

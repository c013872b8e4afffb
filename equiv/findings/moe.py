"""What the MoE section of reports/equivalence.md shows, measured: load-balancing losses under accumulation.

The ``"moe"`` family (:mod:`equiv.cases.moe`) with its aux loss taken per
sequence and over the batch, checked with the reference accumulator and the
steps of :data:`equiv.zoo.moe_bugs.MOE_BUGS`, on an even and an uneven split.
Only statuses and the order of magnitude of a first divergence are printed
(:mod:`equiv.results.facts`): the same on every machine.
:mod:`equiv.reporting.moe` renders it.
"""

from __future__ import annotations

import pandas as pd

from equiv.accumulator import accumulator_step
from equiv.cases.case import Case
from equiv.checking.check import check
from equiv.findings.results import MoeFindings
from equiv.outcomes import outcome_words
from equiv.results.facts import VerdictFacts
from equiv.zoo.moe_bugs import MOE_BUGS

__all__ = ["MOE_UPSTREAM", "measure_moe", "moe_table"]

#: Where each MoE zoo step's mistake was reported.
MOE_UPSTREAM: dict[str, str] = {
    "aux_loss_per_micro_batch": "NeMo Automodel PR #3359 (aux loss over-weighted by the micro-batch count)",
    "aux_divided_by_micro_batches": "the 1/M normalisation of NeMo Automodel PR #3359 (exact for equal micro-batches)",
}
_SPLITS: dict[str, tuple[int, ...]] = {"3 + 3": (3, 3), "2 + 4": (2, 4)}


def _case(balance: str, micro_batch_sizes: tuple[int, ...]) -> Case:
    return Case(
        batch_size=6,
        micro_batch_sizes=micro_batch_sizes,
        model="moe",
        model_kwargs={"balance": balance},
        loss="mse_aux",
        steps=2,
    )


def moe_table() -> pd.DataFrame:
    """One row per (aux loss, step, split): the verdict, its first divergence, and
    for a NOT the upstream report it reproduces or the reason it is inherent."""
    rows = []
    candidates = {"accumulator_step": accumulator_step, **MOE_BUGS}
    for balance in ("sequence", "batch"):
        for name, step in candidates.items():
            for split, sizes in _SPLITS.items():
                verdict = check(step, _case(balance, sizes))
                facts = VerdictFacts.of(verdict)
                first = facts.first_divergence
                if verdict.inherent:
                    why = "inherent: the batch-wise balance loss is not linear in the samples (torchtitan PR #3000)"
                elif not verdict:
                    why = MOE_UPSTREAM.get(name, "-")
                else:
                    why = "-"
                rows.append(
                    {
                        "aux loss": f"{balance}-wise",
                        "step": f"`{name}`",
                        "split": split,
                        "verdict": outcome_words(facts.outcome),
                        "first divergence": "-" if first is None or verdict.inherent else first.describe(),
                        "NOT because": why,
                    }
                )
    return pd.DataFrame(rows)


def measure_moe() -> MoeFindings:
    """The MoE section's findings: why a batch-wise balance loss is inherent, then :func:`moe_table`."""
    reason = check(accumulator_step, _case("batch", (2, 4))).inherent
    return MoeFindings(table=moe_table(), inherent_reason=reason)

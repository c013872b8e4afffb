"""The MoE section of reports/equivalence.md, rendered: load-balancing losses under accumulation.

The checker's reason a batch-wise balance loss is inherent, then one row per
(aux loss, step, split), as :func:`equiv.findings.moe.measure_moe` measured
them (statuses and orders of magnitude only: the same on every machine).
Nothing here measures.
"""

from __future__ import annotations

from equiv.findings.results import MoeFindings
from equiv.reporting.markdown import markdown_table

__all__ = ["moe_section"]


def moe_section(findings: MoeFindings) -> str:
    """The section, from :func:`equiv.findings.moe.measure_moe`."""
    reason = findings.inherent_reason
    return "\n\n".join(
        [
            "## MoE auxiliary (load-balancing) losses",
            "The `moe` family: a top-2 of 4 experts router, Switch Transformer's load-balancing loss "
            '(experts x Σ f_e P_e, weight 0.1) added to an MSE task loss (`loss="mse_aux"`), batch of 6, two '
            "steps of SGD. A sequence-wise balance loss is a mean over samples, so the reference accumulator "
            "reproduces the full batch; a batch-wise one multiplies batch statistics and is reported inherent, "
            "as BatchNorm is, with the reason the checker gives:",
            *(f"> {line}" for line in reason),
            markdown_table(findings.table),
        ]
    )

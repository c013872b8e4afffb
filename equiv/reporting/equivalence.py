"""reports/equivalence.md: the reference and the bug zoo, checked and searched, rendered.

Renders :class:`equiv.findings.results.EquivalenceFindings` (measured by
:func:`equiv.findings.equivalence.measure_equivalence`).  Sections: the
standard cases (reference and zoo), the property-suite record (read from
reports/properties.json, which ``pytest properties`` writes), the zoo searched
with :func:`equiv.verify`, the reference's equivalent cases by model family x
optimizer, inherent non-equivalences, and the distributed and loss-scale
sections (:mod:`equiv.reporting.distributed`), the distributed search and
torchrun sections (:mod:`equiv.reporting.distributed_findings`), the packed-sequence, RL-normaliser
and precision sections (:mod:`equiv.reporting.sequence_search`), the MoE
section (:mod:`equiv.reporting.moe`), the tensor-parallel section
(:mod:`equiv.reporting.tensor_parallel`) and the pipeline section
(:mod:`equiv.reporting.pipeline`).  Nothing here measures: the findings hold
only what holds on every machine (statuses, within or past the allowance,
first divergences as an order of magnitude, counts), so the same code gives
the same report on any CPU: CI regenerates it and diffs it against the
committed one.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from equiv.findings.results import EquivalenceFindings, SearchFindings
from equiv.reporting.distributed import distributed_section
from equiv.reporting.distributed_findings import (
    aux_loss_section,
    context_parallel_section,
    distributed_search_section,
    torchrun_section,
)
from equiv.reporting.markdown import markdown_table
from equiv.reporting.moe import moe_section
from equiv.reporting.pipeline import pipeline_section
from equiv.reporting.sequence_search import packed_section, policy_section, precision_section
from equiv.reporting.tensor_parallel import tensor_parallel_section

__all__ = ["PROPERTIES_RECORD", "render_equivalence", "search_sections"]

PROPERTIES_RECORD = Path("reports/properties.json")


def _fixed_cases_section(findings: EquivalenceFindings) -> str:
    return "\n\n".join(
        [
            "## Fixed cases",
            "The reference accumulator (`equiv.Accumulator` via `accumulator_step`) on every standard case; "
            "'worst / allowed' is the largest difference from the float64 full-batch truth over its allowance, "
            "shown as the band every machine agrees on: within it (≤ 1) or past it (> 1). Its digits are rounding "
            "noise (they move ~2x between torch's CPU kernels); `equiv.check` prints them. A first divergence is "
            "the earliest step's tensor furthest off, with its greatest difference over the tensor's scale as an "
            "order of magnitude.",
            markdown_table(findings.reference),
            "The bug zoo on the same cases: each must be found where the case exposes it "
            "(an unscaled sum is invisible with one micro-batch; a mean of means only with uneven splits).",
            markdown_table(findings.bugs),
            "Cases:",
            markdown_table(findings.cases),
        ]
    )


def _properties_section(record_path: Path) -> str:
    if not record_path.is_file():
        return "## Property suites\n\nNo record of a property run (`pytest properties` writes reports/properties.json)."
    record = json.loads(record_path.read_text())
    frame = pd.DataFrame(
        [
            {
                "property": nodeid.split("::", 1)[-1],
                "suite": nodeid.split("::", 1)[0].removeprefix("properties/"),
                "outcome": result["outcome"],
            }
            for nodeid, result in record["tests"].items()
        ]
    ).sort_values(["suite", "property"], kind="stable")
    mode = "derandomized" if record.get("derandomize") else "random"
    return "\n\n".join(
        [
            "## Property suites",
            f"Hypothesis profile `{record['profile']}` ({mode}): up to {record['max_examples']} cases per property "
            "(a bug search stops at its first counterexample, then shrinks it).",
            markdown_table(frame),
        ]
    )


def search_sections(findings: SearchFindings, *, properties_record: Path | None = PROPERTIES_RECORD) -> list[str]:
    """The sections that come from searches: property suites (left out when
    ``properties_record`` is None), bug zoo, equivalent cases of the reference
    per family x optimizer, inherent non-equivalences.

    The searches are the report's own (:func:`equiv.findings.equivalence.measure_searches`),
    with fixed seeds and steered by nothing but pass / fail, so the same code
    gives the same report on every machine; timings are left out for the same reason.
    """
    verdict_of_search = (
        f"no counterexample in {findings.reference_examples} cases"
        if not findings.reference_found
        else f"COUNTEREXAMPLE: `{findings.reference_counterexample}`"
    )
    return [
        *([] if properties_record is None else [_properties_section(properties_record)]),
        "\n\n".join(
            [
                "## Bug zoo",
                f"`equiv.verify` on each bug of `equiv.zoo.bugs` (seed {findings.seed}, "
                f"at most {findings.bug_search_examples} cases; token-loss bugs searched with the token-level loss): "
                f"{findings.bugs_found} of {len(findings.bug_zoo)} found. 'cases to find' counts drawn cases up to the "
                "first counterexample; the shrunk case is the smallest Hypothesis reached.",
                markdown_table(findings.bug_zoo),
            ]
        ),
        "\n\n".join(
            [
                "## Reference accumulator: equivalent cases by model family and optimizer",
                f"`equiv.verify(accumulator_step)` over {findings.reference_examples} drawn cases (seed {findings.seed}, "
                f"sample and token losses): {verdict_of_search}. Each cell counts the drawn cases of that pair that "
                "were equivalent: every tensor at every step within its allowance in both tiers. (How far within is "
                "rounding noise, different on every CPU: `equiv verify --json` records it as `worst_ratio`.)",
                markdown_table(findings.equivalent_cases),
            ]
        ),
        "\n\n".join(
            [
                "## Inherent non-equivalences",
                "Layers whose train-mode behaviour depends on the batch a forward pass sees: reported with the "
                "reason, never as a pass or as a bug of the accumulator (split 2 + 4 of a batch of 6).",
                markdown_table(findings.inherent),
            ]
        ),
    ]


def render_equivalence(findings: EquivalenceFindings, *, properties_record: Path = PROPERTIES_RECORD) -> str:
    """The markdown of reports/equivalence.md, from :func:`equiv.findings.equivalence.measure_equivalence`.

    The standard cases and the MoE section always; the sections that search
    or spawn ranks (property record, bug zoo, family x optimizer, inherent
    non-equivalences, distributed, loss-scale, tensor and pipeline
    parallelism) where they were measured."""
    return (
        "\n\n".join(
            [
                "# Equivalence report",
                "Generated by `tox -e equivalence` (`equiv report equivalence`); do not edit by hand.",
                "Tolerances are derived per tensor: allowed = "
                f"{findings.floor_factor:g} x (the full-batch run's own distance from the float64 truth) + "
                f"{findings.roundoff_units_per_step:g} x steps x unit roundoff x the tensor's scale. "
                "Exact tier: float64 (floor: the float32 full-batch error scaled by u64/u32, or the float64 run on a "
                "shuffled batch, whichever is larger). Noise-floor tier: the working dtype.",
                _fixed_cases_section(findings),
                *(
                    []
                    if findings.searches is None
                    else search_sections(findings.searches, properties_record=properties_record)
                ),
                *_distributed_and_search_sections(findings),
                moe_section(findings.moe),
                *([] if findings.tensor_parallel is None else [tensor_parallel_section(findings.tensor_parallel)]),
                *([] if findings.pipeline is None else [pipeline_section(findings.pipeline)]),
            ]
        )
        + "\n"
    )


def _distributed_and_search_sections(findings: EquivalenceFindings) -> list[str]:
    """The sections measured only with searches on, in the report's order: distributed and loss-scale windows,
    the distributed search, torchrun, the context-parallel, aux-loss, packed and policy searches, and the
    precision section, which also reads the tables of the distributed searches that ran."""
    return [
        *([] if findings.distributed is None else [distributed_section(findings.distributed)]),
        *([] if findings.distributed_search is None else [distributed_search_section(findings.distributed_search)]),
        *([] if findings.torchrun is None else [torchrun_section(findings.torchrun)]),
        *(
            []
            if findings.context_parallel_search is None
            else [context_parallel_section(findings.context_parallel_search)]
        ),
        *([] if findings.aux_loss_search is None else [aux_loss_section(findings.aux_loss_search)]),
        *([] if findings.packed_search is None else [packed_section(findings.packed_search)]),
        *([] if findings.policy_search is None else [policy_section(findings.policy_search)]),
        *(
            []
            if findings.precision_search is None
            else [
                precision_section(
                    findings.precision_search,
                    [
                        search.table
                        for search in (
                            findings.distributed_search,
                            findings.context_parallel_search,
                            findings.aux_loss_search,
                        )
                        if search is not None
                    ],
                )
            ]
        ),
    ]

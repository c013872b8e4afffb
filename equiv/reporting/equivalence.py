"""reports/equivalence.md: the reference and the bug zoo, checked and searched.

Sections: the standard cases (reference and zoo), the property-suite record,
the zoo searched with :func:`equiv.verify`, the reference's worst error by
model family x optimizer, inherent non-equivalences, and the distributed and
loss-scale sections (:mod:`equiv.reporting.distributed`), the distributed
search and torchrun sections (:mod:`equiv.reporting.distributed_findings`), the MoE section
(:mod:`equiv.reporting.moe`), the tensor-parallel section (:mod:`equiv.reporting.tensor_parallel`)
and the pipeline section (:mod:`equiv.reporting.pipeline`).  Everything runs
with fixed seeds, rows are sorted, and only what holds on every machine is
printed (:mod:`equiv.checking.facts`: statuses, within or past the
allowance, first divergences with their relative error as an order of
magnitude, counts), never the digits of rounding noise, so the same code
gives the same report on any CPU: CI regenerates it and diffs it against the
committed one.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import pandas as pd

from equiv.accumulator import accumulator_step
from equiv.cases.case import Case
from equiv.cases.standard import STANDARD_CASES
from equiv.cases.strategies import ITEM_WEIGHTED_LOSSES
from equiv.checking.check import check
from equiv.checking.facts import Divergence, VerdictFacts
from equiv.checking.search_space import SearchSpace
from equiv.checking.tolerances import FLOOR_FACTOR, ROUNDOFF_UNITS_PER_STEP
from equiv.checking.verdict import Verdict
from equiv.checking.verify import VerifyResult, verify
from equiv.reporting.distributed import distributed_section
from equiv.reporting.distributed_findings import distributed_search_section, torchrun_section
from equiv.reporting.markdown import markdown_table
from equiv.reporting.moe import moe_section
from equiv.reporting.pipeline import pipeline_section
from equiv.reporting.tensor_parallel import tensor_parallel_section
from equiv.zoo.bugs import BUGS, ITEM_WEIGHTED_BUGS

__all__ = [
    "SEARCH_SEED",
    "bug_zoo_table",
    "equivalence_report",
    "equivalence_table",
    "equivalent_cases_table",
    "inherent_table",
    "run_standard_cases",
    "search_sections",
]

log = logging.getLogger(__name__)

#: The report's own searches use this seed, so the report is the same every run.
SEARCH_SEED = 0
#: Cases the report's search of the reference draws (its per family x optimizer table).
REFERENCE_SEARCH_EXAMPLES = 300
#: Cases each bug search may draw before giving up.
BUG_SEARCH_EXAMPLES = 100
PROPERTIES_RECORD = Path("reports/properties.json")


def run_standard_cases(
    candidates: Mapping[str, Callable[..., Any]],
    cases: Mapping[str, Case] = STANDARD_CASES,
) -> list[tuple[str, str, Verdict]]:
    """(case name, candidate name, verdict) for every pair."""
    out = []
    for case_name, case in cases.items():
        for candidate_name, candidate in candidates.items():
            out.append((case_name, candidate_name, check(candidate, case)))
            log.info("%d / %d checks: %s on %s", len(out), len(cases) * len(candidates), candidate_name, case_name)
    return out


def equivalence_table(results: Iterable[tuple[str, str, Verdict]]) -> pd.DataFrame:
    rows = []
    for case_name, candidate_name, verdict in results:
        facts = VerdictFacts.of(verdict)
        first = facts.first_divergence
        rows.append({
            "case": case_name,
            "candidate": candidate_name,
            "verdict": facts.kind.replace("_", " ") + (
                f" (precision note: {facts.precision.replace('_', ' ')})" if facts.precision else ""),
            "worst exact / allowed": facts.tiers.get("exact", "-"),
            "worst noise / allowed": facts.tiers.get("noise", "-"),
            "first divergence": "-" if first is None else first.describe(),
        })
    frame = pd.DataFrame(rows)
    return frame.sort_values(["candidate", "case"], kind="stable").reset_index(drop=True)


def _fixed_cases_section(results: list[tuple[str, str, Verdict]]) -> str:
    reference = [r for r in results if r[1] == "accumulator_step"]
    bugs = [r for r in results if r[1] != "accumulator_step"]
    return "\n\n".join([
        "## Fixed cases",
        "The reference accumulator (`equiv.Accumulator` via `accumulator_step`) on every standard case; "
        "'worst / allowed' is the largest difference from the float64 full-batch truth over its allowance, "
        "shown as the band every machine agrees on: within it (≤ 1) or past it (> 1). Its digits are rounding "
        "noise (they move ~2x between torch's CPU kernels); `equiv.check` prints them. A first divergence is "
        "the earliest step's tensor furthest off, with its greatest difference over the tensor's scale as an "
        "order of magnitude.",
        markdown_table(equivalence_table(reference)),
        "The bug zoo on the same cases: each must be found where the case exposes it "
        "(an unscaled sum is invisible with one micro-batch; a mean of means only with uneven splits).",
        markdown_table(equivalence_table(bugs)),
        "Cases:",
        markdown_table(pd.DataFrame([{"case": name, "reproduce": f"`{case!r}`"} for name, case in STANDARD_CASES.items()])),
    ])


def bug_zoo_table(results: Mapping[str, VerifyResult]) -> pd.DataFrame:
    """One row per bug: found?, the shrunk case, how many cases it took."""
    rows = []
    for name, result in sorted(results.items()):
        first = result.verdict.first_mismatch if result.verdict is not None else None
        rows.append({
            "bug": f"`{name}`",
            "found": "yes" if result.found else "NO",
            "cases to find": "-" if result.first_failure_at is None else str(result.first_failure_at),
            "checks incl. shrinking": str(result.examples),
            "first divergence": "-" if first is None else Divergence.of(first).describe(),
            "shrunk case": "-" if result.counterexample is None else f"`{result.counterexample!r}`",
        })
    return pd.DataFrame(rows)


def equivalent_cases_table(equivalent_cases: Mapping[str, int]) -> pd.DataFrame:
    """Model family x optimizer: how many drawn cases were equivalent ("-": none drawn)."""
    pairs = [key.split(" / ") for key in equivalent_cases]
    families = sorted({family for family, _ in pairs})
    optimizers = sorted({optimizer for _, optimizer in pairs})
    rows = []
    for family in families:
        row = {"model family": family}
        for optimizer in optimizers:
            count = equivalent_cases.get(f"{family} / {optimizer}")
            row[optimizer] = "-" if count is None else str(count)
        rows.append(row)
    return pd.DataFrame(rows, columns=["model family", *optimizers])


#: Models with layers no accumulation can reproduce, and what the checker says about each.
INHERENT_MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "MLP + BatchNorm1d": ("mlp", {"norm": "batch"}),
    "Conv2d + BatchNorm2d": ("conv2d", {"norm": "batch"}),
    "MLP + Dropout(0.25)": ("mlp", {"dropout": 0.25}),
    "GRU + Dropout(0.25)": ("gru", {"dropout": 0.25}),
    "attention with dropout 0.25": ("attention", {"dropout": 0.25}),
}


def inherent_table() -> pd.DataFrame:
    rows = []
    for label, (model, kwargs) in INHERENT_MODELS.items():
        case = Case(batch_size=6, micro_batch_sizes=(2, 4), model=model, model_kwargs=kwargs, steps=2)
        verdict = check(accumulator_step, case)
        rows.append({"model": label, "verdict": verdict.status.replace("_", " "),
                     "reason": " / ".join(verdict.inherent) or "-"})
    return pd.DataFrame(rows)


def _properties_section(record_path: Path) -> str:
    if not record_path.is_file():
        return "## Property suites\n\nNo record of a property run (`pytest properties` writes reports/properties.json)."
    record = json.loads(record_path.read_text())
    frame = pd.DataFrame([
        {"property": nodeid.split("::", 1)[-1], "suite": nodeid.split("::", 1)[0].removeprefix("properties/"),
         "outcome": result["outcome"]}
        for nodeid, result in record["tests"].items()
    ]).sort_values(["suite", "property"], kind="stable")
    mode = "derandomized" if record.get("derandomize") else "random"
    return "\n\n".join([
        "## Property suites",
        f"Hypothesis profile `{record['profile']}` ({mode}): up to {record['max_examples']} cases per property "
        "(a bug search stops at its first counterexample, then shrinks it).",
        markdown_table(frame),
    ])


def search_sections(*, properties_record: Path | None = PROPERTIES_RECORD) -> list[str]:
    """The sections that come from searches: property suites (left out when
    ``properties_record`` is None), bug zoo, equivalent cases of the reference
    per family x optimizer, inherent non-equivalences.

    The searches here are the report's own, with fixed seeds and steered by
    nothing but pass / fail, so the same code gives the same report on every
    machine; timings are left out for the same reason.
    """
    reference = verify(accumulator_step, SearchSpace(item_weighted=True), max_examples=REFERENCE_SEARCH_EXAMPLES, seed=SEARCH_SEED)
    log.info("searched the reference: %d cases", reference.examples)
    bugs = {}
    for name, bug in BUGS.items():
        item_weighted = name in ITEM_WEIGHTED_BUGS
        # No fresh-process replay of the shrunk case: the table shows nothing it decides.
        bugs[name] = verify(bug, SearchSpace(losses=ITEM_WEIGHTED_LOSSES if item_weighted else ()),
                            max_examples=BUG_SEARCH_EXAMPLES, seed=SEARCH_SEED, replay_in_fresh_process=False)
        log.info("searched %s: %s", name, "found" if bugs[name].found else "NOT found")
    found = sum(result.found for result in bugs.values())
    verdict_of_search = (
        f"no counterexample in {reference.examples} cases" if not reference.found
        else f"COUNTEREXAMPLE: `{reference.counterexample!r}`"
    )
    return [
        *([] if properties_record is None else [_properties_section(properties_record)]),
        "\n\n".join([
            "## Bug zoo",
            f"`equiv.verify` on each bug of `equiv.zoo.bugs` (seed {SEARCH_SEED}, at most {BUG_SEARCH_EXAMPLES} cases; "
            "token-loss bugs searched with the token-level loss): "
            f"{found} of {len(bugs)} found. 'cases to find' counts drawn cases up to the first counterexample; "
            "the shrunk case is the smallest Hypothesis reached.",
            markdown_table(bug_zoo_table(bugs)),
        ]),
        "\n\n".join([
            "## Reference accumulator: equivalent cases by model family and optimizer",
            f"`equiv.verify(accumulator_step)` over {reference.examples} drawn cases (seed {SEARCH_SEED}, "
            f"sample and token losses): {verdict_of_search}. Each cell counts the drawn cases of that pair that "
            "were equivalent: every tensor at every step within its allowance in both tiers. (How far within is "
            "rounding noise, different on every CPU: `equiv verify --json` records it as `worst_ratio`.)",
            markdown_table(equivalent_cases_table(reference.equivalent_cases)),
        ]),
        "\n\n".join([
            "## Inherent non-equivalences",
            "Layers whose train-mode behaviour depends on the batch a forward pass sees: reported with the "
            "reason, never as a pass or as a bug of the accumulator (split 2 + 4 of a batch of 6).",
            markdown_table(inherent_table()),
        ]),
    ]


def equivalence_report(*, searches: bool = True, properties_record: Path = PROPERTIES_RECORD) -> str:
    """The markdown of reports/equivalence.md.

    The standard cases always; with ``searches`` (default) also the sections
    that search or spawn ranks: property record, bug zoo, family x optimizer,
    inherent non-equivalences, distributed and loss-scale windows."""
    results = run_standard_cases({"accumulator_step": accumulator_step, **BUGS})
    return "\n\n".join([
        "# Equivalence report",
        "Generated by `tox -e equivalence` (`equiv report equivalence`); do not edit by hand.",
        "Tolerances are derived per tensor: allowed = "
        f"{FLOOR_FACTOR:g} x (the full-batch run's own distance from the float64 truth) + "
        f"{ROUNDOFF_UNITS_PER_STEP:g} x steps x unit roundoff x the tensor's scale. "
        "Exact tier: float64 (floor: the float32 full-batch error scaled by u64/u32, or the float64 run on a "
        "shuffled batch, whichever is larger). Noise-floor tier: the working dtype.",
        _fixed_cases_section(results),
        *(search_sections(properties_record=properties_record) if searches else []),
        *([distributed_section(), distributed_search_section(), torchrun_section()] if searches else []),
        moe_section(),
        *([tensor_parallel_section(), pipeline_section()] if searches else []),
    ]) + "\n"

"""The equivalence report's packed-sequence, RL-normaliser and precision sections:
measured by equiv.findings.sequence_search from the zoos as they stand, rendered by
equiv.reporting.sequence_search.  One search per section here (seconds); the whole
zoos are searched by `equiv report equivalence`."""

from __future__ import annotations

import pandas as pd

from equiv.findings.results import ZooSearchFindings
from equiv.findings.sequence_search import precision_rows, sequence_rows
from equiv.outcomes import Outcome
from equiv.reporting.sequence_search import packed_section, policy_section, precision_section
from equiv.zoo.correct import FLOAT32_ON_THE_GRADIENT
from equiv.zoo.precision import PRECISION_SEARCH
from equiv.zoo.sequence_bugs import PACKED_BUGS, POLICY_BUGS, SEQUENCE_BUG_REPORTS


def test_every_packed_and_policy_bug_names_its_report_entry() -> None:
    # A step added to either zoo is searched by the report; it must say what it reproduces ("" for none).
    assert set(SEQUENCE_BUG_REPORTS) == {*PACKED_BUGS, *POLICY_BUGS}


def test_the_packed_section_shows_the_reference_passing_and_swapped_dpo_pairs_found_and_shrunk() -> None:
    rows = sequence_rows({"dpo_pairs_swapped": PACKED_BUGS["dpo_pairs_swapped"]}, ["packed_dpo"])
    assert list(rows["step"]) == ["`accumulator_step`", "`dpo_pairs_swapped`"]
    assert list(rows["found"]) == ["nothing", "not equivalent"], rows.to_string()
    assert list(rows["as expected"]) == ["yes", "yes"]
    # The sign is wrong on any case: shrunk to one row holding one pair.
    assert "batch_size=1, micro_batch_sizes=(1,)" in rows["shrunk counterexample"][1]
    section = packed_section(ZooSearchFindings(rows, 60, 0))
    assert section.startswith("## Packed sequences") and "ms-swift #10144" in section
    assert "| `dpo_pairs_swapped`" in section and "max_examples=60, seed=0" in section


def test_the_policy_section_finds_skyrls_mean_of_micro_batch_token_means() -> None:
    name = "token_mean_of_micro_batch_means"
    rows = sequence_rows({name: POLICY_BUGS[name]}, [])
    assert list(rows["found"]) == ["not equivalent"] and list(rows["as expected"]) == ["yes"], rows.to_string()
    # Exact for one micro-batch: found with two.
    assert "micro_batch_sizes=(1, 1)" in rows["shrunk counterexample"][0]
    section = policy_section(ZooSearchFindings(rows, 60, 0))
    for report in ("SkyRL PR #925 / #1296", "#1504", "Trinity-RFT #336", "AReaL #1730"):
        assert report in section


def test_the_precision_zoo_holds_every_float32_step_for_both_precisions() -> None:
    names = set(PRECISION_SEARCH)
    for step in FLOAT32_ON_THE_GRADIENT:
        assert {f"{step} (float32 training)", f"{step} (float64 training)"} <= names
        assert PRECISION_SEARCH[f"{step} (float64 training)"].expected is Outcome.PRECISION


def test_the_precision_section_states_a_bfloat16_buffer_and_the_checks_sensitivity() -> None:
    name = "low_precision_buffer (float32 training)"
    rows = precision_rows({name: PRECISION_SEARCH[name]})
    row = rows.iloc[0]
    assert row["found"] == "precision (bfloat16 arithmetic)" and row["as expected"] == "yes", rows.to_string()
    # The constant part of the smallest allowance, per dtype judged: 16 x u(float64) and 16 x u(float32).
    assert row["sensitivity (smallest relative difference resolved)"] == (
        "≥ 1.8e-15 in float64, 9.5e-07 in float32; below one bfloat16 rounding (0.0039): yes"
    )
    # A distributed search's precision entry is picked up by its expected outcome; others are not.
    distributed = pd.DataFrame(
        [
            {"step": "bf16_buffer_ddp", "engine": "DDP", "expected": "precision", "found": "precision"},
            {"step": "accumulator_step (DDP)", "engine": "DDP", "expected": "nothing", "found": "nothing"},
        ]
    )
    section = precision_section(ZooSearchFindings(rows, 30, 0), [distributed])
    assert section.startswith("## Precision of the accumulation buffer") and "ISEEKYAN #149" in section
    assert "| bf16_buffer_ddp" in section and "accumulator_step (DDP)" not in section
    assert "distributed searches' precision entries" not in precision_section(ZooSearchFindings(rows, 30, 0))

"""What tests/test_portability.py runs in a fresh process under forced CPU kernels.

``python tests/portability_probe.py OUT.json`` writes, for the kernels and
thread count this process runs with (``ATEN_CPU_CAPABILITY``,
``OMP_NUM_THREADS``): the capability torch actually picked, its thread count,
the facts of every pinned verdict, the markdown of the report's search
sections (the bug zoo searched, the reference searched, the inherent
non-equivalences, packed sequences, RL normalisers, precision), and what the ``ci`` Hypothesis profile's search of each
zoo bug (as the quality suites run it) finds and shrinks to: all of which must
be the same whatever the kernels.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

from equiv import strategies as eqst
from equiv.checking.search_space import SearchSpace
from equiv.checking.verify import verify
from equiv.findings.equivalence import measure_searches
from equiv.findings.sequence_search import measure_packed_search, measure_policy_search, measure_precision_search
from equiv.reporting.equivalence import search_sections
from equiv.reporting.sequence_search import packed_section, policy_section, precision_section
from equiv.results.facts import VerdictFacts
from equiv.zoo.bugs import BUGS, ITEM_WEIGHTED_BUGS

HERE = Path(__file__).parent


def ci_searches() -> dict[str, Any]:
    """Each zoo bug searched as properties/test_quality_*.py search it, under equiv's ci profile."""
    out = {}
    for name, bug in sorted(BUGS.items()):
        item_weighted = name in ITEM_WEIGHTED_BUGS
        result = verify(
            bug,
            SearchSpace(losses=eqst.ITEM_WEIGHTED_LOSSES if item_weighted else ()),
            profile="ci",
            replay_in_fresh_process=False,
        )
        out[name] = {
            "found": result.found,
            "shrunk case": None if result.counterexample is None else result.counterexample.to_dict(),
            "facts": None if result.verdict is None else VerdictFacts.of(result.verdict).to_dict(),
        }
    return out


def main(out: str) -> None:
    sys.path.insert(0, str(HERE))  # run as a script, beside the test module that owns the pins
    from test_pinned_verdicts import facts_of, pinned_rows

    rows = pinned_rows()
    Path(out).write_text(
        json.dumps(
            {
                "capability": torch.backends.cpu.get_cpu_capability(),
                "threads": torch.get_num_threads(),
                "facts": {f"{row['candidate']} | {row['case_name']}": facts_of(row) for row in rows},
                "search_sections": [
                    *search_sections(measure_searches(), properties_record=None),
                    packed_section(measure_packed_search()),
                    policy_section(measure_policy_search()),
                    precision_section(measure_precision_search()),
                ],
                "ci_searches": ci_searches(),
            },
            ensure_ascii=False,
        )
    )


if __name__ == "__main__":
    main(sys.argv[1])

"""What tests/test_portability.py runs in a fresh process under forced CPU kernels.

``python tests/portability_probe.py OUT.json`` writes, for the kernels and
thread count this process runs with (``ATEN_CPU_CAPABILITY``,
``OMP_NUM_THREADS``): the capability torch actually picked, its thread count,
the facts of every pinned verdict, and the markdown of the report's search
sections (the bug zoo searched, the reference searched, the inherent
non-equivalences), which must be the same whatever the kernels.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from test_pinned_verdicts import facts_of, pinned_rows

from equiv.reporting.equivalence import search_sections


def main(out: str) -> None:
    rows = pinned_rows()
    facts = {f"{row['candidate']} | {row['case_name']}": facts_of(row) for row in rows}
    sections = search_sections(properties_record=None)
    Path(out).write_text(json.dumps({
        "capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "facts": facts,
        "search_sections": sections,
    }, ensure_ascii=False))


if __name__ == "__main__":
    main(sys.argv[1])

"""``equiv report equivalence|peers|benchmarks``: a markdown report written.  The findings and
reporting modules import pandas, so each handler imports them only when its report is asked for.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from equiv.cli.common import UsageError, log
from equiv.cli.inputs import _output


def _write(out: Path, text: str) -> None:
    out.write_text(text)
    log.info("wrote %s", out)


# The findings and reporting modules import pandas: loaded only when a report is asked for.
def _cmd_report_equivalence(args: argparse.Namespace) -> int:
    from equiv.findings.equivalence import measure_equivalence
    from equiv.reporting.equivalence import render_equivalence

    out = _output(args.out, "--out")
    assert out is not None
    _write(out, render_equivalence(measure_equivalence(searches=not args.no_search)))
    return 0


def _cmd_report_peers(args: argparse.Namespace) -> int:
    from equiv.peers.survey import survey
    from equiv.reporting.peers import render_peers
    from equiv.reporting.sweeps import sweeps_section
    from equiv.reporting.trl import torchtune_section, trl_section

    out = _output(args.out, "--out")
    assert out is not None
    # TRL's and torchtune's rows are measured in tox envs of their own (their pins clash with the peers
    # extra's) and saved beside the report; a missing file is said in its section, never left out silently.
    saved = out.parent
    sections = [
        trl_section(saved / "peers-trl.json"),
        torchtune_section(saved / "peers-torchtune.json"),
        sweeps_section([saved / "sweep-transformers.json", saved / "sweep-trl.json"]),
    ]
    _write(out, render_peers(survey(), trainer_sections=sections))
    return 0


def _cmd_report_benchmarks(args: argparse.Namespace) -> int:
    from equiv.reporting.benchmarks import render_report

    _output(args.out, "--out")

    try:
        raw = json.loads(args.json.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UsageError(f"cannot read benchmark JSON {str(args.json)!r}: {exc}") from None
    scaling_full = []
    for path in args.scaling_full or []:
        try:
            scaling_full.append((_shown_path(path), json.loads(path.read_text())))
        except (OSError, json.JSONDecodeError) as exc:
            raise UsageError(f"cannot read the full scaling run {str(path)!r}: {exc}") from None
    try:
        text = render_report(raw, source=str(args.json), scaling_full=scaling_full)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    _write(args.out, text)
    return 0


def _shown_path(path: Path) -> str:
    """``path`` as a report names it: relative to where equiv runs (tox passes absolute paths)."""
    try:
        return os.path.relpath(path)
    except ValueError:  # another drive (Windows)
        return str(path)

"""A sweep's report (issue 45): rows of :class:`~equiv.peers.sweep_rows.SweepRow`, any sweep's
(``equiv sweep transformers``, ``equiv sweep trl``), rendered as markdown; renders, measures nothing.

Summary first (subjects, equivalent, not, could not run, in all and per family), then a row per subject
with its verdict and, for a failing one, the witness's clause of its first failing window (the weights each
micro-batch got, the normaliser named, the trainer's setting at fault), or the reason it could not run; then
for every NOT a reproduction from the row's ``setup``.  Only deterministic content: no timings, no dates.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from typing import Any

from equiv.peers.sweep_rows import COULD_NOT_RUN, SweepRow
from equiv.reporting.markdown import markdown_table as _frame_table

__all__ = ["render_sweep", "rows_json", "witness_clause"]


def markdown_table(lines: list[dict[str, Any]]) -> str:
    import pandas as pd

    return _frame_table(pd.DataFrame(lines))


_COLUMNS = ("equivalent", "not_equivalent", COULD_NOT_RUN)


def _bucket(row: SweepRow) -> str:
    return row.outcome if row.outcome in _COLUMNS else "other"


def _summary(rows: Sequence[SweepRow]) -> str:
    families = sorted({row.family for row in rows})
    lines = []
    for family in [*families, None]:
        chosen = [row for row in rows if family is None or row.family == family]
        counts = Counter(_bucket(row) for row in chosen)
        lines.append(
            {
                "family": family or "**all**",
                "subjects": len(chosen),
                "equivalent": counts["equivalent"],
                "not equivalent": counts["not_equivalent"],
                "could not run": counts[COULD_NOT_RUN],
                "other": counts["other"],
            }
        )
    return markdown_table(lines)


def _first_failing(row: SweepRow) -> dict[str, Any] | None:
    windows = (row.audit or {}).get("windows", [])
    return next((window for window in windows if window.get("status") != "equivalent"), None)


def witness_clause(row: SweepRow) -> str:
    """What the row's verdict rests on, one line: a failing window's witness (weights, normaliser, setting at
    fault), a passing run's window count, or why it could not run."""
    if row.audit is None:
        return row.reason
    failing = _first_failing(row)
    windows = row.audit.get("windows", [])
    if failing is None:
        return f"{len(windows)} of {row.audit.get('steps', len(windows))} steps audited, every one equivalent"
    weights = failing.get("weights")
    at = f"step {failing['step']} (items {failing['items']})"
    if not weights:
        return f"{at}: {failing['status']}"
    run = weights.get("run")
    shown = "not identifiable" if run is None else "[" + ", ".join(f"{weight:.4g}" for weight in run) + "]"
    full = "[" + ", ".join(f"{weight:.4g}" for weight in weights["full_batch"]) + "]"
    setting = f"; setting: {failing['setting']}" if failing.get("setting") else ""
    means = (failing.get("failure_kind") or {}).get("means")
    meaning = f" ({means})" if means else ""
    return f"{at}: weights {shown} vs full batch {full}: {weights['normaliser']}{meaning}{setting}"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _rows_table(rows: Sequence[SweepRow]) -> str:
    return markdown_table(
        [
            {
                "subject": f"`{row.subject}`",
                "family": row.family,
                "verdict": row.verdict,
                "windows": ""
                if row.audit is None
                else " ".join(
                    "✓" if window.get("status") == "equivalent" else "✗" for window in row.audit.get("windows", [])
                ),
                "witness or reason": _cell(witness_clause(row)),
            }
            for row in rows
        ]
    )


def _reproduction(row: SweepRow, command: str) -> str:
    failing = _first_failing(row) or {}
    return "\n".join(
        [
            f"### `{row.subject}`",
            "",
            "```",
            f"{command} --only '{row.subject}' --format json",
            "```",
            "",
            "What was run:",
            "",
            "```json",
            json.dumps(row.setup, indent=1, sort_keys=True),
            "```",
            "",
            f"First failing window: step {failing.get('step')}, items {failing.get('items')}; "
            + _cell(witness_clause(row)),
        ]
    )


def render_sweep(rows: Sequence[SweepRow], title: str, *, command: str, preamble: str = "") -> str:
    """The markdown report of a sweep's ``rows``: ``title``, the summary, a row per subject, a reproduction per
    NOT (``command``: the sweep's own command line, e.g. ``equiv sweep trl``)."""
    failing = [row for row in rows if row.outcome == "not_equivalent"]
    parts = [f"# {title}", ""]
    if preamble:
        parts += [preamble.strip(), ""]
    parts += ["## Summary", "", _summary(rows), "", "## Every subject", "", _rows_table(rows), ""]
    parts += ["## Reproductions (every NOT)", ""]
    parts += [_reproduction(row, command) + "\n" for row in failing] or ["None: no subject is NOT equivalent.", ""]
    return "\n".join(parts).rstrip() + "\n"


def rows_json(rows: Sequence[SweepRow]) -> str:
    """The rows as JSON (``--format json``): a list of ``SweepRow.to_dict()``, keys sorted."""
    return json.dumps([row.to_dict() for row in rows], indent=1, sort_keys=True) + "\n"

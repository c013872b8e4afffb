"""A sweep's rows (:class:`~equiv.peers.sweep_rows.SweepRow`) as a markdown report (issue 45): the summary
first (subjects, equivalent, not, could not run, per family), the reasons a subject could not run counted,
a row per subject, then for every NOT equivalent subject the reproduction a maintainer pastes and the
witness line.  Renders, measures nothing: the rows and the reproductions come from the sweep.

``exact=False`` leaves out what is not the same on every CPU (a window's line, with its allowance ratios
and cosines): the CI sample is rendered so, and diffed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import pandas as pd

from equiv.peers.sweep_rows import COULD_NOT_RUN, SweepRow
from equiv.reporting.markdown import markdown_table

__all__ = ["render_sweep", "row_verdict", "summary_frame"]

#: The summary's verdict columns, in order: (column, the row outcomes it counts).
_COLUMNS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("equivalent", ("equivalent",)),
    ("NOT equivalent", ("not_equivalent", "precision")),
    ("other verdict", ("inherently_non_equivalent", "not_applicable", "step_error")),
    ("could not run", (COULD_NOT_RUN,)),
)


def _cell(text: str) -> str:
    """A table cell: one line, its pipes escaped."""
    return " ".join(str(text).split()).replace("|", "\\|")


def summary_frame(rows: Sequence[SweepRow]) -> pd.DataFrame:
    """Subjects and outcomes per family, then all of them."""
    families = sorted({row.family for row in rows})
    records = []
    for family in [*families, "all"]:
        chosen = [row for row in rows if family in ("all", row.family)]
        record: dict[str, Any] = {"family": family, "subjects": str(len(chosen))}
        for column, outcomes in _COLUMNS:
            record[column] = str(sum(row.outcome in outcomes for row in chosen))
        records.append(record)
    return pd.DataFrame(records)


def _first_failing(row: SweepRow) -> dict[str, Any] | None:
    """The first window of a row's audit that was not equivalent."""
    windows = [] if row.audit is None else row.audit.get("windows", [])
    return next((window for window in windows if window["status"] != "equivalent"), None)


def row_verdict(row: SweepRow) -> str:
    """What a row's table cell says beside its outcome: the items per window, and for a failing window the
    normaliser the witness named and the Trainer setting it points at; a reason for a subject that did not run."""
    if row.audit is None:
        return row.reason
    windows = row.audit.get("windows", [])
    items = "; ".join(str(window["items"]) for window in windows)
    failing = _first_failing(row)
    if failing is None:
        return f"items {items}" if items else row.audit.get("line", "")
    weights = failing.get("weights") or {}
    named = f"weights: {weights['normaliser']}" if weights else "no witness"
    setting = failing.get("setting")
    return f"items {items}; {named}" + (f"; {setting.split(' (')[0]}" if setting else "")


def _reasons_frame(rows: Sequence[SweepRow]) -> pd.DataFrame:
    """The reasons subjects could not run, counted (stage and exception type; the message's first words)."""
    counted = Counter(_cell(row.reason)[:120] for row in rows if row.audit is None)
    return pd.DataFrame(
        [{"subjects": str(count), "reason": reason} for reason, count in sorted(counted.items(), key=lambda c: -c[1])]
    )


def _rows_frame(rows: Sequence[SweepRow]) -> pd.DataFrame:
    return pd.DataFrame(
        [
            {"subject": row.subject, "family": row.family, "verdict": row.outcome, "what": _cell(row_verdict(row))}
            for row in rows
        ]
    )


def _reproductions(rows: Sequence[SweepRow], reproduction: Callable[[SweepRow], str], exact: bool) -> list[str]:
    """For each NOT equivalent row: its heading, the pasteable code, the witness line (``exact``)."""
    out: list[str] = []
    for row in rows:
        failing = _first_failing(row)
        if failing is None or row.outcome not in ("not_equivalent", "precision"):
            continue
        out += [f"### {row.subject}", "", "```python", reproduction(row).rstrip(), "```", ""]
        setting = failing.get("setting")
        if exact:
            out += [f"Witness: `{failing['line']}`", ""]
        elif setting:
            out += [f"Setting named: {setting}", ""]
    return out


def render_sweep(
    rows: Sequence[SweepRow],
    *,
    title: str,
    preamble: Sequence[str],
    reproduction: Callable[[SweepRow], str],
    exact: bool = True,
) -> str:
    """The report: title, ``preamble`` (how it was made), the summary, the reasons, every row, the
    reproductions; ``exact=False`` for a sample that must read the same on every CPU."""
    lines = [f"# {title}", "", *preamble, "", "## Summary", "", markdown_table(summary_frame(rows)), ""]
    if any(row.audit is None for row in rows):
        lines += ["## Why a subject could not run (counted)", "", markdown_table(_reasons_frame(rows)), ""]
    lines += ["## Every subject", "", markdown_table(_rows_frame(rows)), ""]
    reproductions = _reproductions(rows, reproduction, exact)
    if reproductions:
        lines += ["## Reproductions (one per NOT equivalent subject)", "", *reproductions]
    return "\n".join(lines).rstrip() + "\n"

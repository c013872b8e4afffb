"""Markdown building blocks every report uses.

Tables come from pandas' ``DataFrame.to_markdown`` (tabulate underneath) with
number parsing off, so the strings the reports format (fixed significant
digits, "-" for missing) are printed exactly as formatted and diffs of
``reports/*.md`` between runs stay readable.
"""

from __future__ import annotations

import pandas as pd

__all__ = ["markdown_table", "read_markdown_table"]


def markdown_table(frame: pd.DataFrame) -> str:
    """``frame`` as a GitHub markdown table, cells exactly as given, no index."""
    return str(frame.to_markdown(index=False, disable_numparse=True))


def read_markdown_table(text: str) -> list[dict[str, str]]:
    """The rows of the first markdown table in ``text``, as {header: cell},
    cells stripped of padding: what a reader (or a test) compares, whatever
    widths tabulate chose."""
    lines = [line.strip() for line in text.splitlines()]
    start = next((i for i, line in enumerate(lines) if line.startswith("|")), None)
    if start is None or start + 1 >= len(lines) or not set(lines[start + 1]) <= set("|-: "):
        raise ValueError("no markdown table (a header row followed by a |---| row) in the text")

    def cells(line: str) -> list[str]:
        return [cell.strip() for cell in line.strip("|").split("|")]

    header = cells(lines[start])
    if len(set(header)) != len(header):
        raise ValueError(f"the table's headers repeat, so rows cannot be keyed by them: {header}")
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append(dict(zip(header, cells(line), strict=True)))
    return rows

"""The TRL section of the peers report, rendered from the rows ``equiv.peers.trl.write_results``
saved (``tox -e peers-trl``, reports/peers-trl.json): it renders only, it measures nothing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd

from equiv.reporting.markdown import markdown_table

__all__ = ["trl_section"]

_COLUMNS = {"trainer": "trainer", "loss_type": "loss_type", "setting": "setting", "trl": "trl",
            "verdict": "verdict", "kind": "kind", "magnitude": "magnitude", "upstream": "upstream issue"}


def _cells(row: dict[str, Any]) -> dict[str, str]:
    cells = {header: str(row.get(key) or "-") for key, header in _COLUMNS.items() if key != "trl"}
    cells["trl"] = str(row.get("versions", {}).get("trl", "-"))
    return {header: cells[header] for header in _COLUMNS.values()}


def trl_section(json_path: str | Path) -> str:
    """A markdown section (``## TRL: ...``) of every saved row, one table, the
    versions each row was measured with; a missing file says how to make it."""
    path = Path(json_path)
    head = ["## TRL: GRPOTrainer's loss types and SFTTrainer under gradient accumulation", ""]
    if not path.exists():
        return "\n".join([*head, f"Not measured: no {path.name} (run `tox -e peers-trl190` then `tox -e peers-trl`).",
                          ""])
    rows: list[dict[str, Any]] = json.loads(path.read_text())
    environments = sorted({", ".join(f"{k} {v}" for k, v in sorted(row.get("versions", {}).items())) for row in rows})
    text = [
        *head,
        "Each trainer is run as its users run it (a one-layer Llama from a config, float32, CPU, a reward of our own, "
        "SGD without clipping so an update is its gradient's scale) and every optimizer step is audited "
        "(`equiv.audit`): the window is replayed in float64 from its start against the full-batch objective the "
        "loss type documents, and the update the trainer applied is judged with equiv's derived allowances. "
        "A NOT row's kind is the normaliser under which the same judge finds every step equivalent; magnitude: "
        "the update's size along the full-batch one and its cosine, over the steps past their allowance.",
        "",
        markdown_table(pd.DataFrame([_cells(row) for row in rows], columns=list(_COLUMNS.values()))),
        "",
        "Measured with: " + "; ".join(environments) + ".",
        "",
    ]
    return "\n".join(text)

"""The sections of the peers report for the RL and fine-tuning trainers (TRL's
GRPOTrainer / SFTTrainer, torchtune's full fine-tune recipe), rendered from the
rows ``equiv.peers.trl.write_results`` and ``equiv.peers.torchtune.write_results``
saved (``tox -e peers-trl190``, ``peers-trl``, ``peers-torchtune``;
reports/peers-trl.json, reports/peers-torchtune.json): it renders only, it
measures nothing."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from equiv.reporting.markdown import markdown_table

__all__ = ["load_rows", "torchtune_section", "trl_glance", "trl_section"]

_COLUMNS = {
    "trainer": "trainer",
    "loss_type": "loss_type",
    "setting": "setting",
    "trl": "trl",
    "verdict": "verdict",
    "kind": "kind",
    "magnitude": "magnitude",
    "upstream": "upstream issue",
}

#: A glance cell's short name for a saved kind, by the start of its text (first match wins:
#: the rescaled normaliser's text starts like the generation-batch one).
_SHORT_KINDS = (
    ("normaliser is the generation batch's token count ×", "expected window tokens"),
    ("normaliser is the generation batch's token count", "generation-batch tokens"),
    ("not a full-batch objective by design", "by design: local batch"),
)


def load_rows(json_path: str | Path) -> list[dict[str, Any]] | None:
    """The saved rows, or None when the file is missing (not measured)."""
    path = Path(json_path)
    return json.loads(path.read_text()) if path.exists() else None


def _measured_with(rows: Sequence[dict[str, Any]]) -> str:
    """The package versions each distinct environment measured its rows with."""
    environments = sorted({", ".join(f"{k} {v}" for k, v in sorted(row.get("versions", {}).items())) for row in rows})
    return "Measured with: " + "; ".join(environments) + "."


def _cells(row: dict[str, Any]) -> dict[str, str]:
    cells = {header: str(row.get(key) or "-") for key, header in _COLUMNS.items() if key != "trl"}
    cells["trl"] = str(row.get("versions", {}).get("trl", "-"))
    return {header: cells[header] for header in _COLUMNS.values()}


def _mark(row: dict[str, Any]) -> str:
    """✓ / ✗ (kind) / by design / not measured, as the report's first table writes them."""
    verdict, failure = row.get("verdict", ""), str(row.get("kind") or "")
    short = next((name for start, name in _SHORT_KINDS if failure.startswith(start)), failure or "unexplained")
    if verdict == "equivalent":
        return "✓"
    if verdict == "NOT equivalent":
        return f"✗ ({short})"
    if verdict == "by design not full-batch":
        return "by design"
    return verdict or "-"


def trl_glance(rows: Sequence[dict[str, Any]]) -> str:
    """One line per trainer, loss type and trl release; one column per setting measured."""
    settings = list(dict.fromkeys(str(row["setting"]) for row in rows if row.get("setting") not in (None, "-")))
    lines: dict[str, dict[str, str]] = {}
    for row in rows:
        name = f"{row['trainer']} {row['loss_type']} (trl {row.get('versions', {}).get('trl', '?')})"
        line = lines.setdefault(name, {"trainer, loss type (release)": name, **dict.fromkeys(settings, "-")})
        if row.get("setting") in (None, "-"):
            line.update(dict.fromkeys(settings, _mark(row)))
        else:
            line[str(row["setting"])] = _mark(row)
    return markdown_table(pd.DataFrame(list(lines.values())))


def trl_section(json_path: str | Path) -> str:
    """A markdown section (``## TRL: ...``): a glance table, then every saved row with the
    versions it was measured with; a missing file says how to make it."""
    rows = load_rows(json_path)
    head = ["## TRL: GRPOTrainer's loss types and SFTTrainer under gradient accumulation", ""]
    if rows is None:
        return "\n".join(
            [*head, f"Not measured: no {Path(json_path).name} (run `tox -e peers-trl190` then `tox -e peers-trl`).", ""]
        )
    text = [
        *head,
        "Each trainer is run as its users run it (a one-layer Llama from a config, float32, CPU, a reward of our own, "
        "SGD without clipping so an update is its gradient's scale) and every optimizer step is audited "
        "(`equiv.audit`): the window is replayed in float64 from its start against the full-batch objective the "
        "loss type documents, and the update the trainer applied is judged with equiv's derived allowances. "
        "A NOT row's kind is the normaliser under which the same judge finds every step equivalent; magnitude: "
        "the update's size along the full-batch one and its cosine, over the steps past their allowance. "
        '"by design": the loss type documents a normaliser of the local batch, not of the full batch.',
        "",
        trl_glance(rows),
        "",
        markdown_table(pd.DataFrame([_cells(row) for row in rows], columns=list(_COLUMNS.values()))),
        "",
        _measured_with(rows),
        "",
    ]
    return "\n".join(text)


def torchtune_section(json_path: str | Path) -> str:
    """A markdown section (``## torchtune: ...``) of the saved recipe rows."""
    rows = load_rows(json_path)
    head = ["## torchtune: the full fine-tune recipe's train() loop", ""]
    if rows is None:
        return "\n".join([*head, f"Not measured: no {Path(json_path).name} (run `tox -e peers-torchtune`).", ""])
    columns = ["setting", "verdict", "kind", "magnitude", "upstream"]
    return "\n".join(
        [
            *head,
            "torchtune 0.6.1's `FullFinetuneRecipeSingleDevice` (the last release), built by its own `__init__` with "
            "torchtune's components set as its `setup` would make them (a one-layer `llama3`, "
            "`CEWithChunkedOutputLoss`, `padded_collate_sft`, SGD; nothing downloaded), its `train()` run unmodified "
            "with `gradient_accumulation_steps=2` over sequences of unequal length, every optimizer step audited "
            "against the window's next-token mean. torchao 0.15.0 is the release whose names torchtune 0.6.1 imports "
            "on torch 2.13 (0.17 and 0.18 lack them, 0.12 does not import).",
            "",
            markdown_table(pd.DataFrame([{c: str(row.get(c) or "-") for c in columns} for row in rows])),
            "",
            _measured_with(rows),
            "",
        ]
    )

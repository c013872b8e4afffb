"""A sweep's rows (:class:`~equiv.peers.sweep_rows.SweepRow`) as a markdown report (issue 45): the summary
first (subjects, equivalent, not, could not run, per family), the reasons a subject could not run counted,
a row per subject, then for every NOT equivalent subject the reproduction a maintainer pastes and the
witness line.  Renders, measures nothing: the rows and the reproductions come from the sweep.

``exact=False`` leaves out what is not the same on every CPU (a window's line, with its allowance ratios
and cosines): the CI sample is rendered so, and diffed.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from equiv.peers.sweep_rows import COULD_NOT_RUN, SweepRow
from equiv.reporting.markdown import markdown_table

__all__ = [
    "command_reproduction",
    "render_sweep",
    "render_transformers_sweep",
    "row_verdict",
    "rows_json",
    "summary_frame",
]

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


def row_verdict(row: SweepRow, *, exact: bool = True) -> str:
    """What a row's table cell says beside its outcome: for a failing window, its step and items, the weights
    the run gave each micro-batch beside the full batch's (``exact``; a CPU-independent sample names the
    normaliser alone), the normaliser and the trainer setting it points at; a passing run's windows; a reason
    for a subject that did not run."""
    if row.audit is None:
        return row.reason
    windows = row.audit.get("windows", [])
    failing = _first_failing(row)
    if failing is None:
        items = "; ".join(str(window["items"]) for window in windows if "items" in window)
        return f"{len(windows)} of {row.audit.get('steps', len(windows))} steps audited, every one equivalent" + (
            f" (items {items})" if items else ""
        )
    at = f"step {failing['step']} (items {failing['items']})"
    weights = failing.get("weights") or {}
    if not weights:
        said = f"{at}: {failing['status']}, no witness"
    elif exact and weights.get("run") is not None:
        run = "[" + ", ".join(f"{weight:.4g}" for weight in weights["run"]) + "]"
        full = "[" + ", ".join(f"{weight:.4g}" for weight in weights["full_batch"]) + "]"
        said = f"{at}: weights {run} vs full batch {full}: {weights['normaliser']}"
    else:
        said = f"{at}: weights: {weights['normaliser']}"
    means = (failing.get("failure_kind") or {}).get("means") if exact else None
    setting = failing.get("setting")
    return said + (f" ({means})" if means else "") + (f"; setting: {setting}" if setting else "")


def _reasons_frame(rows: Sequence[SweepRow]) -> pd.DataFrame:
    """The reasons subjects could not run, counted (stage and exception type; the message's first words)."""
    counted = Counter(_cell(row.reason)[:120] for row in rows if row.audit is None)
    return pd.DataFrame(
        [{"subjects": str(count), "reason": reason} for reason, count in sorted(counted.items(), key=lambda c: -c[1])]
    )


def _rows_frame(rows: Sequence[SweepRow], *, exact: bool) -> pd.DataFrame:
    return pd.DataFrame(
        [
            {
                "subject": row.subject,
                "family": row.family,
                "verdict": row.verdict,
                "what": _cell(row_verdict(row, exact=exact)),
            }
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
            out += [f"Witness: `{failing.get('line') or row_verdict(row)}`", ""]
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
    lines += ["## Every subject", "", markdown_table(_rows_frame(rows, exact=exact)), ""]
    reproductions = _reproductions(rows, reproduction, exact)
    if reproductions:
        lines += ["## Reproductions (one per NOT equivalent subject)", "", *reproductions]
    return "\n".join(lines).rstrip() + "\n"


def command_reproduction(command: str) -> Callable[[SweepRow], str]:
    """A reproduction for a sweep whose subjects a command reruns one at a time (TRL's trainers): the command,
    then what was run (the row's setup) as a comment."""

    def reproduction(row: SweepRow) -> str:
        setup = json.dumps(row.setup, indent=1, sort_keys=True).splitlines()
        return "\n".join([f"# {command} --only '{row.subject}'", "# what was run:", *(f"# {line}" for line in setup)])

    return reproduction


def rows_json(rows: Sequence[SweepRow], *, library: str, version: str, preamble: str = "") -> str:
    """The rows as JSON (``--format json``; ``--rows`` renders them again): the library, its version, how the
    rows were measured (``preamble``, where the sweep words it), the rows."""
    saved: dict[str, Any] = {"library": library, "version": version}
    if preamble:
        saved["preamble"] = preamble
    return json.dumps({**saved, "rows": [row.to_dict() for row in rows]}, indent=1) + "\n"


def _transformers_reproduction(row: SweepRow) -> str:
    """The code a maintainer pastes to see a transformers class's verdict: the tiny config, the rows, the
    Trainer's arguments and the audit, as the sweep ran them."""
    setup = row.setup
    config_class = setup.get("config_class", "AutoConfig")
    arguments = ", ".join(f"{key}={value!r}" for key, value in setup.get("trainer_arguments", {}).items())
    zeroed = setup.get("dropout_modules_zeroed")
    lines = [
        "import torch",
        "import equiv",
        f"from transformers import {config_class}, {row.subject}, Trainer, TrainingArguments",
        "from equiv.peers.transformers_tiny import family_rows",
        "",
        f"config = {config_class}(**{setup.get('config', {})!r})",
        f"torch.manual_seed({setup.get('seed', 0)})",
        f"model = {row.subject}(config)",
        *(
            [f"for name in {zeroed!r}:  # dropout no config field reaches", "    model.get_submodule(name).p = 0.0"]
            if zeroed
            else []
        ),
        f"rows = family_rows({row.family!r}, seed={setup.get('seed', 0)})  # uneven label counts per micro-batch",
        f'args = TrainingArguments(output_dir="sweep-out", {arguments})',
        f"callback = equiv.auditing.transformers_callback({setup.get('callback', 'loss=...')})",
        "Trainer(model=model, args=args, train_dataset=rows, callbacks=[callback]).train()",
        "print(callback.audit.summary())",
    ]
    return "\n".join(lines)


def render_transformers_sweep(rows: Sequence[SweepRow], *, version: str, exact: bool = True) -> str:
    """The transformers sweep's report (``reports/sweep-transformers.md``; ``exact=False``: the CI sample)."""
    steps = next((row.setup["trainer_arguments"]["gradient_accumulation_steps"] for row in rows if row.setup), 2)
    preamble = [
        f"Every model class of transformers {version} whose forward computes a loss from its labels (the auto "
        "mappings of causal LM, masked LM, seq2seq LM, token and sequence classification, question answering, "
        "multiple choice and pre-training heads), built tiny from its config class (dropout off, no download), "
        "trained by the real `Trainer` on default `TrainingArguments` but "
        f"`gradient_accumulation_steps={steps}` (3 epochs of one "
        "optimizer step, 8 rows a micro-batch) over uneven label counts, and audited by "
        "`equiv.auditing.transformers_callback` (steps 1 and 3). Generated by `equiv sweep transformers` "
        "(`tox -e sweep-transformers`); see docs/sweeps.md.",
        "",
        "How each verdict was made: the head's own loss on a micro-batch, computed in float64 without "
        "`num_items_in_batch`, must equal the loss its family declares (next-token cross-entropy over the label "
        "tokens, cross-entropy over the label tokens, over the labelled sequences, a question-answering head's "
        "start and end cross-entropies over the examples), else the class is a reason row, never judged by a loss "
        "it does not train. Each audited window is then replayed as the float64 full-batch step of that loss over "
        "the window's items, and the Trainer's update compared with it within allowances derived from "
        "floating-point error; a failing window's witness is the weight the run gave each micro-batch's loss "
        "sum, recovered by float64 least squares, named, with the Trainer setting involved.",
    ]
    return render_sweep(
        rows,
        title=f"transformers {version}: every loss-computing head, through the Trainer's gradient accumulation",
        preamble=preamble,
        reproduction=_transformers_reproduction,
        exact=exact,
    )


def _normalisers(rows: Sequence[SweepRow]) -> str:
    """The normalisers the NOT rows' first failing windows were named by, counted, commonest first."""
    named = Counter(
        ((_first_failing(row) or {}).get("weights") or {}).get("normaliser", "no witness")
        for row in rows
        if row.outcome == "not_equivalent"
    )
    return "; ".join(f"{name} ({count})" for name, count in named.most_common())


def sweeps_section(json_paths: Sequence[Path]) -> str:
    """A markdown section for the peers report (``## Sweeps: ...``): each sweep saved beside it (its
    ``--format json`` rows) in one line with a link to its own report, then the families where the installed
    release is not equivalent, with the normalisers the witness named; a missing file says how to make it."""
    lines = [
        "## Sweeps: every subject of a library through its own trainer",
        "",
        "Each subject built tiny, trained by the library's own trainer with gradient accumulation over uneven "
        "item counts and audited (`equiv sweep`); a NOT is the float64 replay's finding, with the weights each "
        "micro-batch got (docs/sweeps.md).",
        "",
    ]
    for path in json_paths:
        if not path.exists():
            lines += [f"- Not measured: no {path.name} (`equiv sweep ... --format json --out {path.name}`).", ""]
            continue
        saved = json.loads(path.read_text())
        rows = [SweepRow.from_dict(row) for row in saved["rows"]]
        counts = Counter(_bucket_of(row) for row in rows)
        report = path.with_suffix(".md").name
        lines.append(
            f"- **{saved['library']} {saved['version']}** ([{report}]({report})): {len(rows)} subjects, "
            + ", ".join(f"{counts[column]} {column}" for column, _ in _COLUMNS)
        )
        failing = sorted({row.family for row in rows if row.outcome == "not_equivalent"})
        frame = pd.DataFrame(
            [
                {
                    "family": family,
                    "NOT equivalent": f"{sum(row.outcome == 'not_equivalent' for row in chosen)} of {len(chosen)}",
                    "named by the witness": _normalisers(chosen),
                }
                for family in failing
                for chosen in [[row for row in rows if row.family == family]]
            ]
        )
        lines += ["", markdown_table(frame) if failing else "Every subject that ran is equivalent.", ""]
    return "\n".join(lines)


def _bucket_of(row: SweepRow) -> str:
    """The summary column a row is counted in."""
    return next(column for column, outcomes in _COLUMNS if row.outcome in outcomes)

"""``equiv sweep transformers``: a sweep's rows (issue 45) as a markdown report or JSON, on stdout or in
``--out``, a progress line on stderr per subject.  The sweep and the reporting modules import transformers and
pandas: loaded only when a sweep is asked for.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from equiv.cli.common import UsageError, log
from equiv.cli.inputs import _output
from equiv.peers.sweep_rows import SweepRow

#: The CI sample of the transformers sweep: both verdicts and a reason row, a few classes, under two minutes;
#: its report (``--sample``) is diffed against reports/sweep-transformers-sample.md.
TRANSFORMERS_SAMPLE = (
    "BertForMaskedLM",
    "BertForPreTraining",
    "BertForQuestionAnswering",
    "GPT2ForTokenClassification",
    "LlamaForCausalLM",
    "LlamaForSequenceClassification",
    "T5ForConditionalGeneration",
)


def _progress(done: int, total: int, label: str) -> None:
    log.info("sweep: %d/%d %s", done, total, label)


def _saved_rows(path: Path) -> list[SweepRow]:
    """The rows a ``--format json`` run wrote, to render again without running the sweep."""
    try:
        return [SweepRow.from_dict(row) for row in json.loads(path.read_text())["rows"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UsageError(f"--rows {str(path)!r} is not a sweep's JSON (equiv sweep ... --format json): {exc}") from None


def _cmd_sweep_transformers(args: argparse.Namespace) -> int:
    import transformers

    from equiv.peers.transformers_sweep import subjects, sweep
    from equiv.reporting.sweeps import render_transformers_sweep

    out = _output(args.out, "--out")
    if args.rows is not None:
        rows = _saved_rows(args.rows)
    else:
        only = list(TRANSFORMERS_SAMPLE if args.sample else args.only or [])
        options: dict[str, Any] = {"only": only}
        try:
            subjects(options)  # an unknown --only name: one line, before any class is built
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        rows = sweep(options, progress=_progress)
    if args.format == "json":
        text = (
            json.dumps(
                {
                    "library": "transformers",
                    "version": transformers.__version__,
                    "rows": [row.to_dict() for row in rows],
                },
                indent=1,
            )
            + "\n"
        )
    else:
        text = render_transformers_sweep(rows, version=transformers.__version__, exact=not args.sample)
    if out is None:
        sys.stdout.write(text)
    else:
        out.write_text(text)
        log.info("wrote %s", out)
    return 0

"""``equiv sweep transformers|trl``: a sweep's rows (issue 45) as a markdown report or JSON, on stdout or in
``--out``, a progress line on stderr per subject.  The sweep modules import their library (and the reports
pandas): each is loaded only when its sweep is asked for.
"""

from __future__ import annotations

import argparse
import importlib
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


def _saved_rows(path: Path) -> tuple[list[SweepRow], str, str]:
    """The rows a ``--format json`` run wrote, to render again without running the sweep, the version of the
    library they were measured with, and how they were measured (the sweep's preamble, where it has one)."""
    try:
        saved = json.loads(path.read_text())
        rows = [SweepRow.from_dict(row) for row in saved["rows"]]
        return rows, str(saved["version"]), str(saved.get("preamble", ""))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UsageError(f"--rows {str(path)!r} is not a sweep's JSON (equiv sweep ... --format json): {exc}") from None


def _rows(args: argparse.Namespace, sweep: Any) -> list[SweepRow]:
    """The rows the sweep gives over ``--only`` (an unknown name refused in one line before anything is
    built), the sample, or every subject."""
    only = list(TRANSFORMERS_SAMPLE if getattr(args, "sample", False) else args.only or [])
    options: dict[str, Any] = {"only": only}
    try:
        chosen = sweep.subjects(options)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    from equiv.distributed.fanout import fan_out

    arguments = [(name, {**options, "family": family}) for name, family in chosen]
    return fan_out(sweep.run_subject, arguments, address=args.ray, workers=args.workers, progress=_progress)


def _cmd_sweep(args: argparse.Namespace) -> int:
    from equiv.reporting import sweeps as report

    library = args.sweep  # "transformers" or "trl": the module equiv.peers.<library>_sweep and the package
    out = _output(args.out, "--out")
    if args.rows is not None:  # rendered again: neither the library nor its sweep is imported
        rows, version, preamble = _saved_rows(args.rows)
    else:
        sweep = importlib.import_module(f"equiv.peers.{library}_sweep")
        rows, version = _rows(args, sweep), importlib.import_module(library).__version__
        preamble = sweep.preamble() if hasattr(sweep, "preamble") else ""  # the releases it ran with, in words
    if args.format == "json":
        text = report.rows_json(rows, library=library, version=version, preamble=preamble)
    elif library == "transformers":
        text = report.render_transformers_sweep(rows, version=version, exact=not args.sample)
    else:
        text = report.render_sweep(
            rows,
            title=f"TRL {version}: its trainers under gradient accumulation",
            preamble=[preamble],
            reproduction=report.command_reproduction("equiv sweep trl"),
        )
    if out is None:
        sys.stdout.write(text)
    else:
        out.write_text(text)
        log.info("wrote %s", out)
    return 0

"""What every subcommand shares: the exit codes (one per meaning, :data:`EXIT_CODES` keyed by a
result's status), the usage error, the ``equiv`` logger and its elapsed-time lines, what the command is
doing now (the line a Ctrl-C prints), and how a result is shown (``--format``, ``--json``).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

from equiv.outcomes import Outcome
from equiv.results.annotations import github_annotations, step_location
from equiv.results.protocol import Result

log = logging.getLogger("equiv")

EXIT_EQUIVALENT = 0
EXIT_COUNTEREXAMPLE = 1
EXIT_USAGE = 2
EXIT_STEP_FAILED = 3
EXIT_INTERNAL_ERROR = 4
#: Ctrl-C: the shell's code for a command ended by SIGINT (128 + 2), never a verdict's.
EXIT_INTERRUPTED = 130
#: What ``--format`` takes: how check, verify and their distributed forms show a result.
FORMATS = ("text", "github", "json")
#: A result's status -> the command's exit code (usage errors and equiv's own failures have no status).
EXIT_CODES: dict[Outcome, int] = {
    Outcome.EQUIVALENT: EXIT_EQUIVALENT,
    # Neither a pass nor a failure, and no counterexample: nothing fails the command.
    Outcome.NOT_APPLICABLE: EXIT_EQUIVALENT,
    Outcome.INHERENTLY_NON_EQUIVALENT: EXIT_EQUIVALENT,
    Outcome.NOT_EQUIVALENT: EXIT_COUNTEREXAMPLE,
    Outcome.PRECISION: EXIT_COUNTEREXAMPLE,
    Outcome.STEP_ERROR: EXIT_STEP_FAILED,
}


class UsageError(Exception):
    """Bad command-line input: exit code 2 with this message."""


#: What the command is doing now, in words ("during case 'toy 2.04, 4 x 2'"): the line a Ctrl-C prints.
_doing: dict[str, str] = {"now": ""}


def _now_doing(text: str) -> None:
    _doing["now"] = text


def _interrupted(signum: int, frame: FrameType | None) -> None:
    """SIGINT: note what was being done at that moment (progress callbacks may run as the
    interrupt unwinds, moving on what ``_doing`` says), then interrupt as Python does."""
    _doing.setdefault("at_interrupt", _doing["now"])
    raise KeyboardInterrupt


def _progress(args: argparse.Namespace, text: str) -> None:
    """A line shown as a command goes (a case's row): on stdout, or on stderr under
    ``--format json`` (stdout then holds the JSON alone)."""
    print(text, file=sys.stderr if args.format == "json" else sys.stdout, flush=True)


def _finish(
    args: argparse.Namespace, result: Result, text: str, step: Callable[..., Any] | None, json_out: Path | None
) -> int:
    """Show ``result`` as ``--format`` says (text: ``text``; github: ``text``, then a workflow
    annotation per failing case at ``step``'s definition; json: ``result.to_dict()`` alone),
    write its JSON to ``--json`` (when given), and return the exit code of its status."""
    if args.format == "json":
        print(json.dumps(result.to_dict(), indent=2, sort_keys=True))
    else:
        print(text)
    if args.format == "github":
        where = step_location(step) if step is not None else None
        for line in github_annotations(result, where, command=f"equiv {args.command}", message=text):
            print(line)
    if json_out is not None:
        try:
            json_out.write_text(json.dumps(result.to_dict(), indent=2, sort_keys=True) + "\n")
        except OSError as exc:  # writable when checked, not now (a full disk, a folder removed meanwhile)
            raise UsageError(
                f"--json {str(json_out)!r} could not be written after the check: "
                f"{exc.strerror or exc} (the result is printed above)"
            ) from None
    return EXIT_CODES[result.status]


class _ElapsedFormatter(logging.Formatter):
    """``[equiv] message (12 s)``: seconds since the command started."""

    def __init__(self) -> None:
        super().__init__()
        self.started = time.perf_counter()

    def format(self, record: logging.LogRecord) -> str:
        return f"[equiv] {record.getMessage()} ({time.perf_counter() - self.started:.0f} s)"


def _version() -> str:
    try:
        return importlib.metadata.version("equiv")
    except importlib.metadata.PackageNotFoundError:
        return "(not installed)"

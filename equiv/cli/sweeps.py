"""``equiv sweep transformers|trl``: a sweep of another library's subjects, each trained by its real trainer
with gradient accumulation and audited (issue 45); the rows as JSON or a markdown report, progress on stderr.
The sweep modules import their library, so each handler imports its sweep only when asked for.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any

from equiv.cli.common import UsageError, log
from equiv.cli.inputs import _output


def fan_out(
    function: Callable[..., Any],
    arguments: Sequence[tuple[Any, ...]],
    *,
    address: str | bool | None = False,
    workers: int | None = None,
    progress: Callable[[int, int, str], None] | None = None,
) -> list[Any]:
    """In-process stand-in for ``equiv.distributed.fanout.fan_out`` (same signature): ``function(*args)`` for each
    of ``arguments`` in order, ``progress(done, total, label)`` after each; ``address`` other than False is refused."""
    if address is not False:
        raise UsageError("--ray needs equiv.distributed.fanout, not in this build")
    results = []
    for done, args in enumerate(arguments, start=1):
        results.append(function(*args))
        if progress is not None:
            progress(done, len(arguments), str(args[0]))
    return results


def _progress(done: int, total: int, label: str) -> None:
    print(f"[{done}/{total}] {label}", file=sys.stderr, flush=True)


def _cmd_sweep_trl(args: argparse.Namespace) -> int:
    from equiv.peers import trl_sweep
    from equiv.reporting.sweeps import render_sweep, rows_json

    out = _output(args.out, "--out")
    names = [name for name, _ in trl_sweep.subjects({})]
    if args.only:
        unknown = [name for name in args.only if name not in names]
        if unknown:
            raise UsageError(f"--only: unknown subject(s) {', '.join(unknown)}; expected some of: {', '.join(names)}")
        names = [name for name in names if name in args.only]
    rows = fan_out(trl_sweep.run_subject, [(name, {}) for name in names], progress=_progress)
    if args.format == "json":
        text = rows_json(rows)
    else:
        title = "TRL's trainers under gradient accumulation"
        text = render_sweep(rows, title, command="equiv sweep trl", preamble=trl_sweep.preamble())
    if out is None:
        sys.stdout.write(text)
    else:
        out.write_text(text)
        log.info("wrote %s", out)
    return 0

"""The ``equiv`` command's entry points: :func:`main` (parse, run the subcommand's handler, turn what it
raised into an exit code) and :func:`console` (the installed command and ``python -m equiv``).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import traceback
from collections.abc import Sequence
from typing import NoReturn

from equiv.cli.common import (
    EXIT_INTERNAL_ERROR,
    EXIT_INTERRUPTED,
    EXIT_STEP_FAILED,
    EXIT_USAGE,
    UsageError,
    _doing,
    _ElapsedFormatter,
    _interrupted,
    _now_doing,
    _version,
    log,
)
from equiv.cli.parser import build_parser
from equiv.host_memory import keep_freed_host_memory
from equiv.judging.contract import CandidateError

#: Commands that build and free model copies run after run: glibc keeps the freed memory for them.
_CHECKING_COMMANDS = ("check", "verify", "check-distributed", "verify-distributed")


def main(argv: Sequence[str] | None = None) -> int:
    """Run one ``equiv`` command line.

    Args:
        argv: the arguments after ``equiv`` (None: ``sys.argv[1:]``).

    Returns:
        The exit code: :data:`EXIT_CODES` of the result's status, 2 for a usage error, 3 for a step that
        failed outside a case, 4 for equiv's own failure, 130 when interrupted.
    """
    args = build_parser().parse_args(argv)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_ElapsedFormatter())
    previous_level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    if args.command in _CHECKING_COMMANDS:
        keep_freed_host_memory()  # a check builds and frees model copies: reuse their pages (EQUIV_KEEP_FREED_MEMORY=0: off)
    _now_doing("before the first case")
    _doing.pop("at_interrupt", None)
    on_main_thread = threading.current_thread() is threading.main_thread()
    previous_sigint = signal.signal(signal.SIGINT, _interrupted) if on_main_thread else None
    try:
        return int(args.handler(args))
    except KeyboardInterrupt:
        # The user's Ctrl-C (a KeyboardInterrupt the step raised itself is a raised step, judged
        # where the step is called): one line, the shell's code, no traceback.  Spawned ranks
        # were ended on the way out (the launcher's clean-up runs as the interrupt unwinds).
        print(
            f"equiv: interrupted (Ctrl-C) {_doing.get('at_interrupt', _doing['now'])}; nothing judged after it",
            file=sys.stderr,
        )
        return EXIT_INTERRUPTED
    except UsageError as exc:
        print(f"equiv: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except CandidateError as exc:  # a step that raised or hung outside the per-case handling
        print(f"equiv: the step failed: {exc}", file=sys.stderr)
        return EXIT_STEP_FAILED
    except Exception:
        traceback.print_exc()
        print(
            f"equiv: internal error: equiv {_version()} failed on its own (not your step): please report it "
            f"with the command line: equiv {' '.join(sys.argv[1:] if argv is None else argv)}",
            file=sys.stderr,
        )
        return EXIT_INTERNAL_ERROR
    finally:
        if on_main_thread:
            signal.signal(signal.SIGINT, previous_sigint)
        log.removeHandler(handler)
        log.setLevel(previous_level)


def console() -> NoReturn:
    """The ``equiv`` command: :func:`main`, then exit even if the user's step left
    non-daemon threads running (Python would wait for them at exit, forever).

    Returns:
        Never: the process exits with :func:`main`'s code.
    """
    code = main()
    strays = [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon and t.is_alive()]
    if strays:
        names = ", ".join(repr(t.name) for t in strays)
        print(
            f"equiv: the step left {len(strays)} non-daemon thread(s) running ({names}); exiting without "
            "waiting for them",
            file=sys.stderr,
        )
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)

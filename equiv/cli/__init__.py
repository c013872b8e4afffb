"""The ``equiv`` command line: every subcommand, and the only place that
knows about argparse, stdout/stderr and exit codes.

    equiv check MODULE:FUNC [--case JSON]        check a step on the standard cases (or one case)
    equiv verify MODULE:FUNC [--seed S] ...      search drawn cases for a counterexample (shrunk)
    equiv check-distributed MODULE:FUNC ...      check a step on W ranks (spawned, or under torchrun)
    equiv verify-distributed MODULE:FUNC ...     search rank splits for a distributed counterexample
    equiv plan WORKLOAD|MODULE:FUNC --budget B   recommend N for a memory budget
    equiv report equivalence|peers|benchmarks    write a markdown report

Exit codes, each meaning one thing:

    0  equivalent (or no counterexample, or a plan that fits)
    1  a counterexample: not equivalent on an applicable case (or nothing fits)
    2  usage error: bad flags, case, paths or device, checked before any work
    3  the user's step raised or hung (past --timeout) on a case: no verdict there
    4  equiv itself failed: a bug in equiv (the traceback is printed)
  130  interrupted (Ctrl-C): one line says during what; nothing is judged after it, no process is left

The codes are one table keyed by the result's status (:data:`EXIT_CODES`,
an :class:`~equiv.outcomes.Outcome`); every result is printed through its
``message()`` / rows and written by ``--json`` as its ``to_dict()`` (the
schema ``equiv/results/schema.json``).  A counterexample wins over a step that
raised elsewhere (1, not 3): it is a definite answer.  Library code raises ``ValueError`` and typed errors; this
module turns them into codes.  Progress goes to stderr through the ``equiv``
logger.  The ``equiv`` command exits even if the step left a non-daemon
thread running (:func:`console`).

``--format github`` adds a GitHub Actions annotation per failing case on the
step's definition line, ``--format json`` prints the JSON alone on stdout
(:mod:`equiv.results.annotations`).  ``check`` and ``verify`` run small cases
on one CPU thread unless ``OMP_NUM_THREADS`` is set or ``--threads N`` is given
(:mod:`equiv.checking.threads`: torch's default threads wait on each other on
tiny steps, many times slower on a busy machine).
"""

from __future__ import annotations

from equiv.cli.common import (
    EXIT_CODES,
    EXIT_COUNTEREXAMPLE,
    EXIT_EQUIVALENT,
    EXIT_INTERNAL_ERROR,
    EXIT_INTERRUPTED,
    EXIT_STEP_FAILED,
    EXIT_USAGE,
    UsageError,
)
from equiv.cli.entry import console, main
from equiv.cli.inputs import load_target, parse_bytes
from equiv.cli.parser import build_parser

__all__ = [
    "EXIT_CODES",
    "EXIT_COUNTEREXAMPLE",
    "EXIT_EQUIVALENT",
    "EXIT_INTERNAL_ERROR",
    "EXIT_INTERRUPTED",
    "EXIT_STEP_FAILED",
    "EXIT_USAGE",
    "UsageError",
    "build_parser",
    "console",
    "load_target",
    "main",
    "parse_bytes",
]

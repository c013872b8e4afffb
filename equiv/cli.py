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

import argparse
import dataclasses
import importlib.metadata
import json
import logging
import math
import os
import re
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import fields
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn

import torch
from hypothesis.errors import InvalidArgument
from torch import Tensor, nn

from equiv.batches import Batch
from equiv.cases import strategies as eqst
from equiv.cases.case import Case, InvalidCase, check_device
from equiv.cases.standard import STANDARD_CASES
from equiv.checking.check import check_cases
from equiv.checking.distributed import DistributedCase
from equiv.checking.distributed_cases import CaseLoop, check_distributed_cases
from equiv.checking.distributed_search import (
    DATA_PARALLEL_ENGINES,
    ENGINES,
    MODELS,
    standard_distributed_cases,
    verify_distributed,
)
from equiv.checking.profiles import profile_name
from equiv.checking.search_space import AUTOCAST_DTYPES, SearchSpace
from equiv.checking.threads import SMALL_MODEL_PARAMETERS
from equiv.checking.verify import verify
from equiv.cost.planner import NothingFitsError, format_plan, plan
from equiv.cost.workloads import WORKLOADS, CountItems, LossSum, build_workload_model
from equiv.distributed.engines import DEFAULT_ENGINE
from equiv.distributed.launcher import Launcher, run_on_ranks
from equiv.distributed.torchrun import TorchrunEnv, TorchrunRanks
from equiv.host_memory import keep_freed_host_memory
from equiv.judging.contract import CandidateError, ContractError, bind, load_candidate
from equiv.judging.deadline import DEFAULT_TIMEOUT_S, CheckTimeout
from equiv.judging.runs import NonFiniteLossError
from equiv.names import on_sys_path, target_folder
from equiv.outcomes import Outcome
from equiv.results.annotations import github_annotations, step_location
from equiv.results.protocol import Result
from equiv.results.verdict import CaseVerdicts

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


# ------------------------------------------------------------------ targets
def load_target(spec: str) -> Callable[..., Any]:
    """``package.module:func`` or ``path/to/file.py:func`` -> the callable
    (:func:`equiv.judging.contract.load_candidate`; a bad spec is a usage error)."""
    try:
        return load_candidate(spec)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc


def _parse_case(text: str, allow_imports: Sequence[str] = ()) -> Case:
    if text.startswith("@"):
        try:
            text = Path(text[1:]).read_text()
        except OSError as exc:
            raise UsageError(f"cannot read the --case file {text[1:]!r}: {exc.strerror or exc}") from None
    try:
        return Case.from_dict(json.loads(text), allow_imports=allow_imports)
    except json.JSONDecodeError as exc:
        raise UsageError(f"--case is not valid JSON ({exc}): {text[:80]!r}") from None
    except (InvalidCase, TypeError, KeyError) as exc:
        raise UsageError(f"--case does not describe a case: {exc}") from None


def _output(path: str | Path | None, flag: str) -> Path | None:
    """An output path checked before any work (a run must not end on a path it cannot write):
    its folder exists, it is not itself a folder, and it opens for writing.  Opening it is the
    only honest test: ``os.access`` says yes to root everywhere, and ``/proc`` or a read-only
    mount refuses a file its permission bits would allow.  A file that was not there is
    removed again; one that was is opened for appending, its content untouched."""
    if path is None:
        return None
    out = Path(path)
    folder = out.parent if str(out.parent) else Path(".")
    if out.is_dir():
        raise UsageError(f"{flag} {str(out)!r} is a folder; give a file path")
    if not folder.is_dir():
        raise UsageError(f"{flag} {str(out)!r}: the folder {str(folder)!r} does not exist (create it first)")
    existed = out.exists()
    try:
        with out.open("a" if existed else "x"):
            pass
    except OSError as exc:
        what = "opened for writing" if existed else f"created in the folder {str(folder)!r}"
        raise UsageError(f"{flag} {str(out)!r} cannot be {what}: {exc.strerror or exc}") from None
    if not existed:
        out.unlink()
    return out


def _timeout(seconds: float) -> float | None:
    if math.isnan(seconds) or seconds < 0:
        raise UsageError(f"--timeout must be a number of seconds >= 0 (0: no limit), got {seconds:g}")
    return seconds or None


def _names(text: str) -> tuple[str, ...]:
    """A comma-separated list flag (``--families mlp,conv1d``); an empty one is refused
    (leaving the flag out is how to ask for the default, never an empty value)."""
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    if not names:
        raise argparse.ArgumentTypeError(f"expected comma-separated names, got {text!r}")
    return names


def _positive_int(text: str) -> int:
    """A count flag (``--global-batch-size 64``): a whole number of at least 1.  Zero is
    refused, never read as "the default" (leave the flag out for that)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {value}")
    return value


def _positive_seconds(text: str) -> float:
    """A time limit that must be finite and above zero (the ranks' own deadline)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}")
    return value


# -------------------------------------------------------------------- check
def _cmd_check(args: argparse.Namespace) -> int:
    # The step's folder stays on sys.path for the whole check: a case's own model, loss or
    # data beside the step (my_lm.py:LogitsOnly) imports as the step did.
    with on_sys_path(target_folder(args.target)):
        return _check_on_path(args)


def _check_on_path(args: argparse.Namespace) -> int:
    json_out = _output(args.json, "--json")
    timeout = _timeout(args.timeout)
    candidate = load_target(args.target)
    # A case's own factories may come from the step's module or those the user names; nothing else runs.
    allowed = [getattr(candidate, "__module__", None) or "", *args.allow_import]
    cases = {"--case": _parse_case(args.case, [name for name in allowed if name])} if args.case else STANDARD_CASES
    if args.autocast is not None:
        cases = {name: _under_autocast(name, case, args.autocast) for name, case in cases.items()}
    try:
        step = bind(candidate)
    except ContractError as exc:
        raise UsageError(str(exc)) from None

    def show(name: str, so_far: CaseVerdicts) -> None:
        log.info("[%d/%d] %s", len(so_far.order), len(cases), name)
        rest = [other for other in cases if other not in so_far.order]
        _now_doing(f"during case {rest[0]!r}" if rest else f"after the last case ({name!r})")
        _progress(args, so_far.row(name))
        if args.tb and name in so_far.tracebacks:
            _progress(args, "      " + so_far.tracebacks[name].rstrip().replace("\n", "\n      "))

    _now_doing(f"during case {next(iter(cases))!r}")
    try:
        verdicts = check_cases(
            step,
            cases,
            timeout=timeout,
            on_case=show,
            train_dtype=args.train_dtype,
            strict=args.strict_precision,
            threads=args.threads,
        )
    except NonFiniteLossError as exc:
        raise UsageError(f"the case itself diverges, so nothing can be compared with it: {exc}") from None
    except InvalidCase as exc:
        raise UsageError(f"the case cannot be run: {exc}") from None
    except CheckTimeout as exc:
        raise UsageError(f"{exc} (--timeout SECONDS, 0 for none)") from None
    # Only an applicable case that failed fails the command as a counterexample;
    # a step that raised or hung, with no counterexample elsewhere, is told apart (the status says which).
    return _finish(args, verdicts, verdicts.summary(), candidate, json_out)


def _under_autocast(name: str, case: Case, autocast: str) -> Case:
    """``case`` with its forward under ``--autocast``; a ``--case`` naming another autocast is refused."""
    if case.autocast not in (None, autocast):
        raise UsageError(f"--autocast {autocast} and the {name} autocast={case.autocast!r} disagree: give one")
    return dataclasses.replace(case, autocast=autocast)


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


# ------------------------------------------------------------------- verify
def _cmd_verify(args: argparse.Namespace) -> int:
    json_out = _output(args.json, "--json")
    timeout = _timeout(args.timeout)
    try:
        check_device(args.device)
    except InvalidCase as exc:
        raise UsageError(f"--device: {exc}") from None
    candidate = load_target(args.target)
    if args.profile is not None:
        try:
            profile_name(args.profile)
        except InvalidArgument as exc:
            raise UsageError(str(exc)) from None
    last_shown = [-math.inf]

    def show(examples: int, elapsed: float) -> None:
        _now_doing(f"during the search, after {examples} case(s) checked")
        if elapsed - last_shown[0] >= args.progress_every:  # the first check, then every few seconds
            last_shown[0] = elapsed
            log.info("%d cases checked", examples)

    _now_doing("during the search's first case")
    try:
        # The search-space flags are named after SearchSpace's fields: one type, no renaming.
        space = SearchSpace(**{item.name: getattr(args, item.name) for item in fields(SearchSpace)})
        result = verify(
            candidate,
            space,
            max_examples=args.max_examples,
            seed=args.seed,
            profile=args.profile,
            reproduce=args.reproduce,
            train_dtype=args.train_dtype,
            strict=args.strict_precision,
            progress=show,
            timeout=timeout,
            threads=args.threads,
        )
    except (InvalidArgument, ContractError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    text = result.message(args.target)
    if args.tb and result.error_traceback:
        text += "\nThe step's traceback:\n" + result.error_traceback.rstrip()
    return _finish(args, result, text, candidate, json_out)


def _cmd_verify_distributed(args: argparse.Namespace) -> int:
    json_out = _output(args.json, "--json")
    candidate = load_target(args.target)
    last_shown = [-math.inf]

    def show(examples: int, elapsed: float) -> None:
        _now_doing(f"during the distributed search, after {examples} case(s) checked")
        if elapsed - last_shown[0] >= 2.0:  # the first case, then every few seconds
            last_shown[0] = elapsed
            log.info("%d distributed cases checked", examples)

    _now_doing("during the distributed search's first case")
    try:
        result = verify_distributed(
            candidate,
            engines=args.engines or (DEFAULT_ENGINE,),
            models=args.models or MODELS,
            max_examples=args.max_examples,
            seed=args.seed,
            max_world_size=args.max_world_size,
            timeout_s=args.timeout,
            progress=show,
            train_dtype=args.train_dtype,
            strict=args.strict_precision,
        )
    except (InvalidArgument, ContractError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    return _finish(args, result, result.message(), candidate, json_out)


# -------------------------------------------------------- check-distributed
def _split(text: str) -> list[list[int]]:
    """``--split "1,2;3"``: rank 0 holds micro-batches of 1 and 2 samples, rank 1 one of 3."""
    try:
        ranks = [[int(size) for size in rank.split(",")] for rank in text.split(";")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"a split is each rank's micro-batch sizes, ranks separated by ';' (e.g. \"1,2;3\"), got {text!r}"
        ) from None
    return ranks


def _distributed_cases(
    args: argparse.Namespace, candidate: Callable[..., Any], world_size: int
) -> dict[str, DistributedCase]:
    if args.split is None and args.case is None:
        return standard_distributed_cases(world_size, args.engine)
    allowed = [getattr(candidate, "__module__", None) or "", *args.allow_import]
    base = (
        _parse_case(args.case, [name for name in allowed if name])
        if args.case
        else Case(batch_size=4, micro_batch_sizes=(2, 2))
    )
    split = args.split if args.split is not None else [list(base.micro_batch_sizes)] * world_size
    if len(split) != world_size:
        raise UsageError(
            f"--split gives {len(split)} rank(s), {split}; the check runs {world_size} (torchrun's "
            "world size, or --nproc)"
        )
    try:
        return {"--split" if args.split is not None else "--case on every rank": DistributedCase.of(base, split)}
    except InvalidCase as exc:
        raise UsageError(f"--split: {exc}") from None


def _cmd_check_distributed(args: argparse.Namespace) -> int:
    try:
        env = TorchrunEnv.read()
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if env is not None and args.nproc is not None and args.nproc != env.world_size:
        raise UsageError(f"--nproc {args.nproc}: torchrun started {env.world_size} ranks (leave --nproc out)")
    json_out = _output(args.json, "--json") if env is None or env.rank == 0 else None
    with on_sys_path(target_folder(args.target)):
        # Every rank loads the step: the tasks rank 0 posts name it, and a rank unpickles them.
        candidate = load_target(args.target)
        cases = _distributed_cases(
            args, candidate, (2 if args.nproc is None else args.nproc) if env is None else env.world_size
        )
        if env is None:
            return _check_distributed_cases(args, candidate, cases, run_on_ranks, json_out)
        with TorchrunRanks(env) as ranks:
            if env.rank != 0:
                return _exit_now(ranks.serve(), ranks)
            code = EXIT_INTERNAL_ERROR
            try:
                code = _check_distributed_cases(args, candidate, cases, ranks.run, json_out, stop_on_fault=True)
            except UsageError:
                code = EXIT_USAGE
                raise
            except CandidateError:
                code = EXIT_STEP_FAILED
                raise
            except KeyboardInterrupt:
                code = EXIT_INTERRUPTED
                raise
            finally:
                ranks.end(code)
            return _exit_now(code, ranks)


def _exit_now(code: int, ranks: TorchrunRanks) -> int:
    """A rank whose task is stuck in a collective (after a fault elsewhere) exits
    without waiting for it: torchrun would otherwise wait until its own timeout."""
    if ranks.task_running:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _check_distributed_cases(
    args: argparse.Namespace,
    candidate: Callable[..., Any],
    cases: dict[str, DistributedCase],
    launcher: Launcher,
    json_out: Path | None,
    stop_on_fault: bool = False,
) -> int:
    current = [""]  # the case being checked, to name it when it is refused

    def starting(index: int, name: str, dcase: DistributedCase) -> None:
        current[0] = name
        log.info("[%d/%d] %s: %s", index, len(cases), name, dcase)
        _now_doing(f"during case {name!r}")

    loop = CaseLoop(
        engine=args.engine,
        timeout_s=args.timeout,
        train_dtype=args.train_dtype,
        strict=args.strict_precision,
        launcher=launcher,
        stop_on_fault=stop_on_fault,
    )
    try:
        result = check_distributed_cases(
            candidate, cases, args.target, loop, starting=starting, shown=lambda text: _progress(args, text)
        )
    except (InvalidCase, ContractError, TypeError) as exc:
        raise UsageError(f"{current[0]}: {exc}") from None
    except NonFiniteLossError as exc:
        raise UsageError(f"{current[0]}: the case itself diverges, so nothing can be compared with it: {exc}") from None
    return _finish(args, result, result.summary(), candidate, json_out)


# --------------------------------------------------------------------- plan
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_bytes(text: str) -> int:
    """'512MiB', '1.5GB', '1000000' -> bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(
            f"memory budget must be a number with an optional unit among B, KB, MB, GB, KiB, MiB, GiB; got {text!r}"
        )
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def _load_plan_target(spec: str) -> tuple[nn.Module, Batch, LossSum | None, CountItems | None, int | None]:
    """A built-in workload name, or ``MODULE:FUNC`` / ``path/to/file.py:FUNC``
    where ``FUNC()`` returns ``(model, (inputs, targets))`` or
    ``(model, (inputs, targets), loss_sum)``.  Returns the model, the example
    batch, the loss and item count (None: defaults) and a default global batch."""
    if spec in WORKLOADS:
        workload = WORKLOADS[spec]
        generator = torch.Generator().manual_seed(0)
        return (
            build_workload_model(workload),
            workload.make_batch(workload.global_batch_size, generator),
            workload.loss_sum,
            workload.count_items,
            workload.global_batch_size,
        )
    if ":" not in spec:
        raise UsageError(f"target must be a built-in workload {sorted(WORKLOADS)} or MODULE:FUNC, got {spec!r}")
    func = load_target(spec)
    try:
        result = func()
    except Exception as exc:  # the user's code: say which call failed, keep the cause
        raise UsageError(f"{spec}() raised {type(exc).__name__}: {exc}") from exc
    if not (isinstance(result, tuple) and len(result) in (2, 3) and isinstance(result[0], nn.Module)):
        raise UsageError(
            f"{spec}() must return (model, (inputs, targets)[, loss_sum]) with an nn.Module first, "
            f"got {type(result).__name__}"
        )
    model, batch = result[0], result[1]
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2 and all(isinstance(t, Tensor) for t in batch)):
        raise UsageError(f"{spec}(): the batch must be (inputs, targets) tensors, got {type(batch).__name__}")
    return model, (batch[0], batch[1]), (result[2] if len(result) == 3 else None), None, None


def _cmd_plan(args: argparse.Namespace) -> int:
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    model, batch, loss_sum, count_items, default_batch = _load_plan_target(args.target)
    global_batch_size = next(
        size for size in (args.global_batch_size, default_batch, int(batch[0].shape[0])) if size is not None
    )
    try:
        result = plan(
            model,
            batch,
            global_batch_size=global_batch_size,
            memory_budget_bytes=args.budget,
            loss_sum=loss_sum,
            count_items=count_items,
            device=args.device,
            candidates=args.candidates,
            repeats=args.repeats,
        )
    except NothingFitsError as exc:
        print(f"equiv plan: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    print(json.dumps(result.to_dict(), indent=2) if args.json else format_plan(result))
    return 0 if result.recommended_n is not None else 1


# ------------------------------------------------------------------- report
def _write(out: Path, text: str) -> None:
    out.write_text(text)
    log.info("wrote %s", out)


# The findings and reporting modules import pandas: loaded only when a report is asked for.
def _cmd_report_equivalence(args: argparse.Namespace) -> int:
    from equiv.findings.equivalence import measure_equivalence
    from equiv.reporting.equivalence import render_equivalence

    out = _output(args.out, "--out")
    assert out is not None
    _write(out, render_equivalence(measure_equivalence(searches=not args.no_search)))
    return 0


def _cmd_report_peers(args: argparse.Namespace) -> int:
    from equiv.peers.survey import survey
    from equiv.reporting.peers import render_peers
    from equiv.reporting.trl import torchtune_section, trl_section

    out = _output(args.out, "--out")
    assert out is not None
    # TRL's and torchtune's rows are measured in tox envs of their own (their pins clash with the peers
    # extra's) and saved beside the report; a missing file is said in its section, never left out silently.
    saved = out.parent
    sections = [trl_section(saved / "peers-trl.json"), torchtune_section(saved / "peers-torchtune.json")]
    _write(out, render_peers(survey(), trainer_sections=sections))
    return 0


def _cmd_report_benchmarks(args: argparse.Namespace) -> int:
    from equiv.reporting.benchmarks import render_report

    _output(args.out, "--out")

    try:
        raw = json.loads(args.json.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UsageError(f"cannot read benchmark JSON {str(args.json)!r}: {exc}") from None
    scaling_full = []
    for path in args.scaling_full or []:
        try:
            scaling_full.append((_shown_path(path), json.loads(path.read_text())))
        except (OSError, json.JSONDecodeError) as exc:
            raise UsageError(f"cannot read the full scaling run {str(path)!r}: {exc}") from None
    try:
        text = render_report(raw, source=str(args.json), scaling_full=scaling_full)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    _write(args.out, text)
    return 0


def _shown_path(path: Path) -> str:
    """``path`` as a report names it: relative to where equiv runs (tox passes absolute paths)."""
    try:
        return os.path.relpath(path)
    except ValueError:  # another drive (Windows)
        return str(path)


# ------------------------------------------------------------------- parser
def _format_flag(parser: argparse.ArgumentParser) -> None:
    """``--format``: how the result is shown on stdout."""
    parser.add_argument(
        "--format",
        choices=FORMATS,
        default="text",
        help="text (default); github: the text, then a GitHub Actions ::error annotation per "
        "failing case on the step's definition line (a ::notice when it passes); json: the "
        "result's JSON (equiv/results/schema.json) alone on stdout, progress on stderr",
    )


def _threads_flag(parser: argparse.ArgumentParser) -> None:
    """``--threads``: torch's CPU threads during the check (the rule: :mod:`equiv.checking.threads`)."""
    parser.add_argument(
        "--threads",
        type=_positive_int,
        default=None,
        metavar="N",
        help="torch CPU threads while checking (default: 1 on small models such as every standard "
        "and drawn case, where more threads only wait on each other, many times slower on a "
        "busy machine; torch's own count if OMP_NUM_THREADS is set or a model has over "
        f"{SMALL_MODEL_PARAMETERS:,} parameters); restored afterwards",
    )


def _precision_flags(parser: argparse.ArgumentParser) -> None:
    """When a float32-sized difference inside the float64 run fails (it passes with a note otherwise)."""
    parser.add_argument(
        "--train-dtype",
        choices=["float64", "float32", "bfloat16", "float16"],
        default=None,
        help="the dtype you train in (default: float32 or lower); with float64, float32-sized "
        "differences inside the float64 run fail as a precision finding; with bfloat16 or "
        "float16, a step computing its gradient in bfloat16 (an accumulation buffer) passes "
        "with a note",
    )
    parser.add_argument(
        "--strict-precision",
        action="store_true",
        help="fail float32-sized differences inside the float64 run whatever you train in",
    )


def _autocast_flag(parser: argparse._ActionsContainer) -> None:
    """``--autocast``: every case's forward under ``torch.autocast`` to that dtype (``Case.autocast``)."""
    parser.add_argument(
        "--autocast",
        choices=AUTOCAST_DTYPES,
        default=None,
        help="run every case's forward under torch.autocast to this dtype, as AMP does, and judge "
        "it in that precision (default: none, unless the step enters torch.autocast itself: "
        "then each case is judged in the step's own autocast dtype)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="equiv",
        description="Is your gradient accumulation full-batch training?",
        epilog="exit codes: 0 equivalent, 1 counterexample, 2 usage error, 3 the step raised or hung, 4 equiv failed, "
        "130 interrupted (Ctrl-C)",
    )
    parser.add_argument("--version", action="version", version=f"equiv {_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    contract = "MODULE:FUNC or path/to/file.py:FUNC following the candidate contract"

    check_parser = commands.add_parser("check", help="check a step on the standard cases (or one --case)")
    check_parser.add_argument("target", help=contract)
    check_parser.add_argument("--case", help="one case as JSON (Case.to_dict()), or @file.json")
    check_parser.add_argument("--json", help="also write the verdicts as JSON to this path")
    check_parser.add_argument(
        "--allow-import",
        action="append",
        default=[],
        metavar="MODULE",
        help="a module the --case may import its model, loss or data from, besides the step's "
        "own (repeatable; a case pasted from a log imports nothing else)",
    )
    check_parser.add_argument("--tb", action="store_true", help="where the step raised, also print its own traceback")
    check_parser.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        help=f"seconds one case's check may take (default {DEFAULT_TIMEOUT_S:g}; 0: no limit); "
        "a step still running then is reported as hung (exit 3)",
    )
    _precision_flags(check_parser)
    _autocast_flag(check_parser)
    _threads_flag(check_parser)
    _format_flag(check_parser)
    check_parser.set_defaults(handler=_cmd_check)

    verify_parser = commands.add_parser(
        "verify",
        help="search drawn cases for a counterexample to a step (Hypothesis, shrunk)",
        description="Hypothesis draws cases (models x splits x optimizers), checks the step on each and shrinks "
        "the first mismatch to the smallest case that still shows it.",
    )
    verify_parser.add_argument("target", help=contract)
    verify_parser.add_argument(
        "--max-examples", type=_positive_int, default=None, help="cases to draw (default: the profile's)"
    )
    verify_parser.add_argument("--seed", type=int, default=None, help="fix the search (default: drawn and printed)")
    verify_parser.add_argument(
        "--profile",
        default=None,
        help="Hypothesis profile: equiv's dev, ci or thorough (shipped in the package), or one you registered",
    )
    verify_parser.add_argument("--json", help="also write the result as JSON to this path")
    verify_parser.add_argument("--tb", action="store_true", help="where the step raised, also print its own traceback")
    verify_parser.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        help=f"seconds one case's check may take (default {DEFAULT_TIMEOUT_S:g}; 0: no limit); "
        "a step still running then ends the search (exit 3)",
    )
    space = verify_parser.add_argument_group("what cases are drawn from (equiv.checking.search_space.SearchSpace)")
    space.add_argument(
        "--families", type=_names, default=(), help=f"comma-separated model families ({','.join(eqst.MODEL_FAMILIES)})"
    )
    space.add_argument(
        "--optimizers", type=_names, default=(), help=f"comma-separated optimizers ({','.join(eqst.OPTIMIZERS)})"
    )
    space.add_argument(
        "--losses",
        type=_names,
        default=(),
        help="comma-separated losses ("
        + ",".join((*eqst.SAMPLE_LOSSES, *eqst.ITEM_WEIGHTED_LOSSES, *eqst.SEQUENCE_LOSS_FAMILIES))
        + "; the packed_* and policy_* ones only when named)",
    )
    space.add_argument("--item-weighted", action="store_true", help="also search the token-level loss")
    space.add_argument("--allow-inherent", action="store_true", help="also draw BatchNorm and dropout models")
    space.add_argument(
        "--max-batch-size",
        type=_positive_int,
        default=None,
        help="largest batch drawn (default: its micro-batch count plus up to 8 samples)",
    )
    space.add_argument(
        "--max-micro-batches", type=_positive_int, default=None, help="most micro-batches per window drawn (default 32)"
    )
    space.add_argument("--device", default="cpu", help="where to run the cases (default cpu; e.g. cuda)")
    _autocast_flag(space)
    verify_parser.add_argument("--reproduce", metavar="BLOB", help="replay the shrunk draw an earlier search printed")
    verify_parser.add_argument("--progress-every", type=float, default=2.0, help=argparse.SUPPRESS)
    _precision_flags(verify_parser)
    _threads_flag(verify_parser)
    _format_flag(verify_parser)
    verify_parser.set_defaults(handler=_cmd_verify)

    ddp_parser = commands.add_parser(
        "check-distributed",
        help="check a step on W ranks: spawned here, or the ranks torchrun started",
        description="Runs the step on W data-parallel ranks (DDP or FSDP2; gloo on CPU, NCCL on GPU) and compares "
        "every rank with the single-process full-batch step in both tiers. Under torchrun (torchrun --standalone "
        "--nproc-per-node 2 -m equiv check-distributed MODULE:FUNC) every rank reads torchrun's environment, rank 0 "
        "checks and prints the verdict; without torchrun, --nproc ranks are spawned here. With no --split or --case, "
        "standard splits are checked (ranks holding different samples, micro-batch counts and real tokens).",
    )
    ddp_parser.add_argument("target", help=contract)
    ddp_parser.add_argument(
        "--split",
        type=_split,
        default=None,
        help="each rank's micro-batch sizes, ranks separated by ';' (e.g. \"1,2;3\"): one entry per rank",
    )
    ddp_parser.add_argument(
        "--case",
        help="the case as JSON (Case.to_dict()), or @file.json; its batch and "
        "micro-batch sizes come from --split (default: its split on every rank)",
    )
    # The standard splits are data-parallel ones: tensor-parallel engines are for equiv.check_distributed
    # with DistributedCase.of(..., tensor_parallel=T), and for verify-distributed.
    ddp_parser.add_argument(
        "--engine", choices=DATA_PARALLEL_ENGINES, default=DEFAULT_ENGINE, help="DDP (default) or FSDP2 (fully_shard)"
    )
    ddp_parser.add_argument(
        "--nproc",
        type=_positive_int,
        default=None,
        help="ranks to spawn without torchrun (default 2); under torchrun, its world size",
    )
    ddp_parser.add_argument(
        "--timeout",
        type=_positive_seconds,
        default=120.0,
        help="seconds the ranks may take per case once started (default 120)",
    )
    ddp_parser.add_argument("--json", help="also write the verdicts as JSON to this path (rank 0)")
    ddp_parser.add_argument(
        "--allow-import",
        action="append",
        default=[],
        metavar="MODULE",
        help="a module the --case may name factories from (besides the step's own)",
    )
    _precision_flags(ddp_parser)
    _format_flag(ddp_parser)
    ddp_parser.set_defaults(handler=_cmd_check_distributed)

    search_parser = commands.add_parser(
        "verify-distributed",
        help="search rank splits for a distributed counterexample (spawned gloo/NCCL ranks, shrunk)",
        description="Hypothesis draws world sizes, each rank's micro-batches, sample or token models (ranks with "
        "different real-token counts), optimizers and clipping, checks the step on spawned ranks and shrinks the "
        "first mismatch to the smallest split. The step must be importable by name (MODULE:FUNC): the ranks import it.",
    )
    search_parser.add_argument("target", help=contract)
    search_parser.add_argument(
        "--engines", type=_names, default=(), help=f"comma-separated engines to draw ({','.join(ENGINES)}; default ddp)"
    )
    search_parser.add_argument(
        "--models", type=_names, default=(), help=f"comma-separated models to draw ({','.join(MODELS)}; default both)"
    )
    search_parser.add_argument(
        "--max-examples", type=_positive_int, default=25, help="distributed cases to draw (default 25)"
    )
    search_parser.add_argument("--max-world-size", type=int, default=3, help="most ranks drawn (default 3)")
    search_parser.add_argument("--seed", type=int, default=None, help="fix the search (default: drawn and printed)")
    search_parser.add_argument(
        "--timeout",
        type=_positive_seconds,
        default=20.0,
        help="seconds one case's ranks may take (default 20); a hung rank ends the search",
    )
    search_parser.add_argument("--json", help="also write the result as JSON to this path")
    _precision_flags(search_parser)
    _format_flag(search_parser)
    search_parser.set_defaults(handler=_cmd_verify_distributed)

    plan_parser = commands.add_parser(
        "plan",
        help="recommend the number of micro-batches N for a memory budget",
        description="Measure a few micro-batch sizes, fit memory and time, and recommend the "
        "fastest N whose step fits the budget (no trial beyond the budget's reach).",
    )
    plan_parser.add_argument(
        "target",
        help=f"a built-in workload ({', '.join(sorted(WORKLOADS))}) or MODULE:FUNC "
        "returning (model, (inputs, targets)[, loss_sum])",
    )
    plan_parser.add_argument("--budget", type=parse_bytes, required=True, help="memory budget, e.g. 256MiB or 8GB")
    plan_parser.add_argument(
        "--global-batch-size",
        type=_positive_int,
        default=None,
        help="samples per optimizer step (default: the workload's, or the example batch's size)",
    )
    plan_parser.add_argument("--device", default="cpu", help="cpu or cuda[:index] (default: cpu)")
    plan_parser.add_argument(
        "--candidates",
        type=lambda text: [_positive_int(x) for x in text.split(",")],
        default=None,
        help="comma-separated N to consider (default: powers of two up to the batch)",
    )
    plan_parser.add_argument("--repeats", type=_positive_int, default=3, help="timed steps per measured N (default: 3)")
    plan_parser.add_argument(
        "--threads", type=_positive_int, default=None, help="torch.set_num_threads for the measurement"
    )
    plan_parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan_parser.set_defaults(handler=_cmd_plan)

    report_parser = commands.add_parser("report", help="write a markdown report (equivalence, peers, benchmarks)")
    reports = report_parser.add_subparsers(dest="report", required=True, metavar="REPORT")
    equivalence = reports.add_parser(
        "equivalence", help="standard cases, searches, distributed and loss-scale sections (tox -e equivalence)"
    )
    equivalence.add_argument("--out", type=Path, default=Path("reports/equivalence.md"))
    equivalence.add_argument(
        "--no-search", action="store_true", help="only the fixed cases (skip the seeded searches and spawned ranks)"
    )
    equivalence.set_defaults(handler=_cmd_report_equivalence)
    peers = reports.add_parser("peers", help="Accelerate, Lightning and hand-written loops under equiv (tox -e peers)")
    peers.add_argument("--out", type=Path, default=Path("reports/peers.md"))
    peers.set_defaults(handler=_cmd_report_peers)
    benchmarks = reports.add_parser("benchmarks", help="pytest --benchmark-json output as markdown (tox -e bench)")
    benchmarks.add_argument("--json", type=Path, required=True, help="pytest --benchmark-json output")
    benchmarks.add_argument("--out", type=Path, default=Path("reports/benchmarks.md"), help="markdown file to write")
    benchmarks.add_argument(
        "--full-run",
        "--scaling-full",
        dest="scaling_full",
        type=Path,
        action="append",
        default=None,
        help="a committed full run of a benchmark too long for CI (benchmarks/"
        "test_check_scaling.py, benchmarks/test_audit_false_alarms.py) to show beside this "
        "one (repeat it for several, e.g. a CPU and a GPU run)",
    )
    benchmarks.set_defaults(handler=_cmd_report_benchmarks)
    return parser


#: Commands that build and free model copies run after run: glibc keeps the freed memory for them.
_CHECKING_COMMANDS = ("check", "verify", "check-distributed", "verify-distributed")


class _ElapsedFormatter(logging.Formatter):
    """``[equiv] message (12 s)``: seconds since the command started."""

    def __init__(self) -> None:
        super().__init__()
        self.started = time.perf_counter()

    def format(self, record: logging.LogRecord) -> str:
        return f"[equiv] {record.getMessage()} ({time.perf_counter() - self.started:.0f} s)"


def main(argv: Sequence[str] | None = None) -> int:
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


def _version() -> str:
    try:
        return importlib.metadata.version("equiv")
    except importlib.metadata.PackageNotFoundError:
        return "(not installed)"


def console() -> NoReturn:
    """The ``equiv`` command: :func:`main`, then exit even if the user's step left
    non-daemon threads running (Python would wait for them at exit, forever)."""
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

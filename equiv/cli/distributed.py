"""``equiv check-distributed`` (a step on W ranks: spawned here, or the ranks torchrun started)
and ``equiv verify-distributed`` (a search of rank splits for a distributed counterexample).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hypothesis.errors import InvalidArgument

from equiv.cases.case import Case, InvalidCase
from equiv.checking.distributed import DistributedCase
from equiv.checking.distributed_cases import CaseLoop, check_distributed_cases
from equiv.checking.distributed_search import (
    MODELS,
    standard_distributed_cases,
    verify_distributed,
)
from equiv.cli.common import (
    EXIT_INTERNAL_ERROR,
    EXIT_INTERRUPTED,
    EXIT_STEP_FAILED,
    EXIT_USAGE,
    UsageError,
    _finish,
    _now_doing,
    _progress,
    log,
)
from equiv.cli.inputs import _output, _parse_case, load_target
from equiv.distributed.engines import DEFAULT_ENGINE
from equiv.distributed.launcher import Launcher, run_on_ranks
from equiv.distributed.torchrun import TorchrunEnv, TorchrunRanks
from equiv.judging.contract import CandidateError, ContractError
from equiv.judging.runs import NonFiniteLossError
from equiv.names import on_sys_path, target_folder


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

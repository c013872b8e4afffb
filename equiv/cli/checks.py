"""``equiv check`` (a step on the standard cases, or one ``--case``) and ``equiv verify`` (a
Hypothesis search for a counterexample, shrunk).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import fields

from hypothesis.errors import InvalidArgument

from equiv.cases.case import Case, InvalidCase, check_device
from equiv.cases.standard import STANDARD_CASES
from equiv.checking.check import check_cases
from equiv.checking.profiles import profile_name
from equiv.checking.search_space import SearchSpace
from equiv.checking.verify import verify
from equiv.cli.common import UsageError, _finish, _now_doing, _progress, log
from equiv.cli.inputs import _output, _parse_case, _timeout, load_target
from equiv.judging.contract import ContractError, bind
from equiv.judging.deadline import CheckTimeout
from equiv.judging.runs import NonFiniteLossError
from equiv.names import on_sys_path, target_folder
from equiv.results.verdict import CaseVerdicts


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

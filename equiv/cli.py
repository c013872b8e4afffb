"""The ``equiv`` command line.

    equiv check MODULE:FUNC [--case JSON]   check a step on the standard cases (or one case)
    equiv report [--out PATH]               write reports/equivalence.md

Exit codes: 0 equivalent, 1 a mismatch was found, 2 usage or import error.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from equiv.cases import Case, InvalidCase
from equiv.check import check
from equiv.standard_cases import STANDARD_CASES
from equiv.trajectory import CandidateError

__all__ = ["UsageError", "load_target", "main"]


class UsageError(Exception):
    """Bad command-line input: exit code 2 with this message."""


def load_target(spec: str) -> Callable[..., Any]:
    """``package.module:func`` or ``path/to/file.py:func`` -> the callable."""
    module_part, sep, attr = spec.rpartition(":")
    if not sep or not module_part or not attr:
        raise UsageError(f"expected MODULE:FUNC or path/to/file.py:FUNC, got {spec!r}")
    try:
        if module_part.endswith(".py"):
            path = Path(module_part)
            if not path.is_file():
                raise UsageError(f"no such file {str(path)!r} (from {spec!r})")
            module_spec = importlib.util.spec_from_file_location(path.stem, path)
            assert module_spec is not None and module_spec.loader is not None
            module = importlib.util.module_from_spec(module_spec)
            sys.path.insert(0, str(path.resolve().parent))
            module_spec.loader.exec_module(module)
        else:
            sys.path.insert(0, str(Path.cwd()))
            module = importlib.import_module(module_part)
    except UsageError:
        raise
    except Exception as exc:
        raise UsageError(f"could not import {module_part!r}: {type(exc).__name__}: {exc}") from exc
    target = getattr(module, attr, None)
    if target is None:
        raise UsageError(f"module {module_part!r} has no attribute {attr!r}")
    if not callable(target):
        raise UsageError(f"{spec!r} is a {type(target).__name__}, not a callable step")
    return target


def _parse_case(text: str) -> Case:
    if text.startswith("@"):
        text = Path(text[1:]).read_text()
    try:
        return Case.from_dict(json.loads(text))
    except json.JSONDecodeError as exc:
        raise UsageError(f"--case is not valid JSON ({exc}): {text[:80]!r}") from None
    except (InvalidCase, TypeError, KeyError) as exc:
        raise UsageError(f"--case does not describe a case: {exc}") from None


def _cmd_check(args: argparse.Namespace) -> int:
    candidate = load_target(args.target)
    cases = {"--case": _parse_case(args.case)} if args.case else STANDARD_CASES
    started = time.perf_counter()
    results, failed = [], 0
    for index, (name, case) in enumerate(cases.items(), 1):
        print(f"[{index}/{len(cases)}] {name} ({time.perf_counter() - started:.1f} s)", file=sys.stderr)
        try:
            verdict = check(candidate, case)
        except CandidateError as exc:
            print(f"ERROR {name}: {exc}")
            failed += 1
            results.append({"case_name": name, "status": "candidate_error", "error": str(exc)})
            continue
        results.append({"case_name": name, **verdict.to_dict()})
        if verdict:
            print(f"ok    {name}")
        else:
            failed += 1
            print(f"FAIL  {name}\n" + "\n".join("      " + line for line in verdict.message().splitlines()))
    print(f"{len(cases) - failed} equivalent, {failed} not, of {len(cases)} case(s)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    return 1 if failed else 0


def _cmd_report(args: argparse.Namespace) -> int:
    from equiv.report import write_equivalence_report

    write_equivalence_report(args.out)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="equiv", description="Is your gradient accumulation full-batch training?")
    commands = parser.add_subparsers(dest="command", required=True)

    check_parser = commands.add_parser("check", help="check a step on the standard cases (or one --case)")
    check_parser.add_argument("target", help="MODULE:FUNC or path/to/file.py:FUNC following the candidate contract")
    check_parser.add_argument("--case", help="one case as JSON (Case.to_dict()), or @file.json")
    check_parser.add_argument("--json", help="also write the verdicts as JSON to this path")
    check_parser.set_defaults(handler=_cmd_check)

    report_parser = commands.add_parser("report", help="write the equivalence report")
    report_parser.add_argument("--out", type=Path, default=Path("reports/equivalence.md"))
    report_parser.set_defaults(handler=_cmd_report)

    # Subcommands of optional modules register themselves (e.g. `equiv plan`).
    for module_name in ("equiv.planner", "equiv.verify"):
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            continue
        module.register_cli(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.handler(args))
    except UsageError as exc:
        print(f"equiv: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())

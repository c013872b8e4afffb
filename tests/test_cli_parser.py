"""The ``equiv`` command's parser (issue 43, item 3): a small builder per subcommand, and an option several
subcommands share reads the same in each.  (Sizes for the whole package: tests/test_layout.py.)"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

import pytest

import equiv.cli
from equiv.cli import build_parser

#: The CLI's source files: the package's modules (or the one module it was).
_CLI = Path(equiv.cli.__file__)
SOURCES = sorted(_CLI.parent.glob("*.py")) if _CLI.name == "__init__.py" else [_CLI]


def _functions() -> list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    return [
        (f"{path.name}:{node.name}", node)
        for path in SOURCES
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    ]


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """Every subcommand's parser by its command line (``report benchmarks``), nested ones too."""
    found: dict[str, argparse.ArgumentParser] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found[name] = sub
                found |= {f"{name} {nested}": parser for nested, parser in _subparsers(sub).items()}
    return found


def test_the_sources_are_read() -> None:
    # The tests below can only fail if they see the code: build_parser and main are among what they read.
    assert {"build_parser", "main"} <= {node.name for _, node in _functions()}


def test_each_subcommand_is_built_by_a_function_of_its_own() -> None:
    # One small builder per subcommand: no function adds two subcommands' parsers.
    adders = {
        name: sum(
            isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "add_parser"
            for call in ast.walk(node)
        )
        for name, node in _functions()
    }
    assert sum(adders.values()) == len(_subparsers(build_parser()))
    assert {name: count for name, count in adders.items() if count > 1} == {}


@pytest.mark.parametrize("flag", ["--format", "--train-dtype", "--strict-precision", "--autocast", "--tb", "--seed"])
def test_an_option_several_subcommands_share_reads_the_same_in_each(flag: str) -> None:
    # Written once (a helper per option group), so the same words, choices and default wherever it appears
    # (--threads is not among them: plan's sets the measurement's threads, not a check's).
    seen = {
        command: (action.help, repr(action.choices), action.default, action.metavar, type(action).__name__)
        for command, parser in _subparsers(build_parser()).items()
        for action in parser._actions
        if flag in action.option_strings
    }
    assert len(seen) > 1, f"{flag} is in only {sorted(seen)}"
    # A sweep's --format is a report's (markdown or json), written once for every sweep: the same among them.
    for is_sweep in (False, True):
        group = {command: read for command, read in seen.items() if command.startswith("sweep ") == is_sweep}
        assert len(set(group.values())) <= 1, group

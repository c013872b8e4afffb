"""Issue 43, item 3 ("sizes that fit a screen"): the distributed front doors, the
launchers, the peers' runs and the audit's window judge stay under 60 lines each.

A function's size is its whole ``def`` span, docstring included, decorators not
(as the issue counts it).  ``check_distributed`` is not pinned: its public
docstring (the engines, the precision reruns, what it raises) alone is longer.
"""

from __future__ import annotations

import ast
import importlib
import inspect

import pytest

MAX_LINES = 60

#: module -> the functions (``Class.method`` for a method) held to MAX_LINES.
FUNCTIONS = {
    "equiv.checking.distributed_search": ("verify_distributed",),
    "equiv.checking.distributed_cases": ("check_distributed_cases",),
    "equiv.findings.distributed": ("measure_distributed",),
    "equiv.distributed.launcher": ("run_on_ranks",),
    "equiv.distributed.torchrun": ("TorchrunRanks.run",),
    "equiv.peers.torchtune": ("full_finetune_run",),
    "equiv.peers.trl": ("grpo_run",),
    "equiv.peers.catalogue": ("peers",),
    "equiv.auditing.replay": ("judge_window",),
}


def _definition(tree: ast.Module, qualname: str) -> ast.FunctionDef:
    """The ``def`` of ``qualname`` (``name`` or ``Class.name``) at the top of ``tree``."""
    body: list[ast.stmt] = tree.body
    *classes, name = qualname.split(".")
    for class_name in classes:
        body = next(node for node in body if isinstance(node, ast.ClassDef) and node.name == class_name).body
    return next(node for node in body if isinstance(node, ast.FunctionDef) and node.name == name)


@pytest.mark.parametrize(
    ("module", "qualname"), [(module, name) for module, names in FUNCTIONS.items() for name in names]
)
def test_the_distributed_functions_fit_a_screen(module: str, qualname: str) -> None:
    source = inspect.getsource(importlib.import_module(module))
    node = _definition(ast.parse(source), qualname)
    assert node.end_lineno is not None
    lines = node.end_lineno - node.lineno + 1
    assert lines <= MAX_LINES, f"{module}.{qualname} is {lines} lines (at most {MAX_LINES}: issue 43)"

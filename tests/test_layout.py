"""The package's shape: imports flow one way (down :data:`equiv.layers.LAYERS`), nothing below
the CLI imports it, no cycle, one floor recipe, no private name imported across packages.

(``distributed``: the launcher, the FSDP2 sharding helpers and the counted
collectives, below both ``checking`` and ``cost``, which share them.  ``findings``
measures what reports/equivalence.md shows and ``peers`` other libraries, both with
the checker; ``reporting`` renders what they measured and imports nothing that
measures.  The peers' adapters need only the loss protocol, so the audit's runs drive them.)

The graph is read from the source (every ``import``, module level or inside
a function), so a lazy import cannot hide a cycle.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import importlib.util
import inspect
import pkgutil
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import equiv
from equiv.cli import build_parser
from equiv.layers import FACADE, layer_of  # the layer table, stated once, in the package

PACKAGE = Path(equiv.__file__).resolve().parent
#: The checkout (CONTRIBUTING.md): not PACKAGE's parent where equiv is installed as a wheel (tox).
REPOSITORY = Path(__file__).resolve().parents[1]

#: What a report may import besides other reporting modules: measured results as plain data, and the cost
#: model's least-squares fits (pure numpy: the benchmarks report fits lines to numbers the benchmark run
#: measured, arithmetic on a JSON file, as its docstring says).  Every other equiv module measures or
#: imports something that does (checking, distributed, accumulator, zoo, cost, cases, peers, findings).
RENDERING_INPUTS = {"equiv.findings.results", "equiv.peers.results", "equiv.peers.sweep_rows", "equiv.cost.costmodel"}


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _layer(module: str) -> int:
    return layer_of(module)


def _imports(module: str, path: Path) -> set[str]:
    """The equiv modules ``module`` imports (``from pkg import sub`` counts as ``pkg.sub``)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.split(".")[0] == "equiv"}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "equiv":
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                found.add(submodule if submodule in MODULES else node.module)
    found.discard(module)
    return found


GRAPH = {module: _imports(module, path) for module, path in MODULES.items()}


def test_every_module_is_placed_in_a_layer() -> None:
    assert {module for module in MODULES if _layer(module) == FACADE} == {
        "equiv",
        "equiv.strategies",
        "equiv.testing",
        "equiv.pytest_plugin",
        "equiv.__main__",
    }


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_flow_down_the_layers(module: str) -> None:
    upward = sorted(target for target in GRAPH[module] if _layer(target) > _layer(module))
    assert not upward, f"{module} (layer {_layer(module)}) imports higher layers: {upward}"


def _subpackage(module: str) -> str:
    return module.split(".")[1] if module.count(".") else ""


def test_checking_and_cost_do_not_import_each_other() -> None:
    crossing = [
        (module, target)
        for module, targets in GRAPH.items()
        for target in targets
        if {_subpackage(module), _subpackage(target)} == {"checking", "cost"}
    ]
    assert crossing == []


def test_the_peers_report_only_renders() -> None:
    # Measurement lives in equiv.peers; the report renders its results and imports nothing that measures.
    assert GRAPH["equiv.reporting.peers"] <= {"equiv.peers.results", "equiv.reporting.markdown"}, GRAPH[
        "equiv.reporting.peers"
    ]
    assert GRAPH["equiv.reporting.trl"] <= {"equiv.reporting.markdown"}, GRAPH["equiv.reporting.trl"]
    assert not [
        module
        for module in GRAPH
        if module.startswith("equiv.peers") and any(target.startswith("equiv.reporting") for target in GRAPH[module])
    ]


REPORTING = sorted(module for module in MODULES if module.startswith("equiv.reporting."))


@pytest.mark.parametrize("module", REPORTING)
def test_a_report_imports_nothing_that_measures(module: str) -> None:
    measuring = sorted(
        target
        for target in GRAPH[module]
        if not target.startswith("equiv.reporting") and target not in RENDERING_INPUTS
    )
    assert not measuring, f"{module} renders only, but imports {measuring}: measure in equiv.findings (or equiv.peers)"
    tree = ast.parse(MODULES[module].read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    assert not {name for name in imported if name.split(".")[0] in ("torch", "subprocess")}, imported


@pytest.mark.parametrize("module", sorted(RENDERING_INPUTS))
def test_what_a_report_imports_imports_nothing_that_measures(module: str) -> None:
    # Plain data and pure arithmetic: no equiv module but the one vocabulary (equiv.outcomes, a plain
    # enum), so nothing that measures comes in with them.
    assert GRAPH[module] <= {"equiv.outcomes"}, GRAPH[module]


def test_findings_do_not_render() -> None:
    assert not [
        (module, target)
        for module, targets in GRAPH.items()
        if module.startswith("equiv.findings")
        for target in targets
        if target.startswith("equiv.reporting")
    ]


def test_only_the_entry_point_imports_the_cli() -> None:
    importers = sorted(module for module, targets in GRAPH.items() if "equiv.cli" in targets)
    assert importers == ["equiv.__main__"]


def test_the_import_graph_has_no_cycle() -> None:
    state: dict[str, str] = {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for target in sorted(GRAPH.get(module, ())):
            if state.get(target) == "open":
                cycle = [*path[path.index(target) :], target] if target in path else [module, target]
                pytest.fail(f"import cycle: {' -> '.join(cycle)}")
            if target not in state:
                visit(target, [*path, target])
        state[module] = "done"

    for module in sorted(GRAPH):
        if module not in state:
            visit(module, [module])


def test_every_module_imports_in_a_fresh_interpreter_in_dependency_order() -> None:
    order: list[str] = []
    # The optional peers' adapters need their extras (their importers guard the import).
    optional = {"equiv.adapters.accelerate": "accelerate", "equiv.adapters.lightning": "pytorch_lightning"}
    missing = {module for module, extra in optional.items() if importlib.util.find_spec(extra) is None}

    def place(module: str) -> None:
        if module in order or module in missing:
            return
        for target in sorted(GRAPH[module]):
            place(target)
        order.append(module)

    for module in sorted(MODULES):
        if module != "equiv.__main__":  # it runs the command line
            place(module)
    script = f"import importlib\nfor name in {order!r}:\n    importlib.import_module(name)\n"
    subprocess.run([sys.executable, "-c", script], check=True, timeout=300)


def test_the_cli_lists_every_subcommand() -> None:
    help_text = build_parser().format_help()
    for command in ("check", "verify", "plan", "report"):
        assert f"    {command} " in help_text, command
    report_parser = build_parser().parse_args(["report", "benchmarks", "--json", "x.json"])
    assert report_parser.report == "benchmarks"


def test_the_public_api_is_exactly_all() -> None:
    # "@py_builtins", "@pytest_ar": pytest's assertion rewriting, which covers every module of a distribution
    # that ships a pytest11 plugin (equiv's does) when it is installed as a wheel.
    public = {name for name in vars(equiv) if not name.startswith(("_", "@"))} - {
        # subpackages and modules reachable as attributes once imported
        "accumulator",
        "batches",
        "cases",
        "distributed",
        "checking",
        "cost",
        "losses",
        "reporting",
        "zoo",
        "cli",
        "peers",
        "pytest_plugin",
        "testing",
        "names",
        "outcomes",
        "host_memory",
        "auditing",
        "findings",
        "judging",
        "results",
        "adapters",
        "layers",
    }
    assert public == set(equiv.__all__) - {"__version__"}


def test_the_loss_families_live_in_one_package() -> None:
    # Sample and token losses, packed rows, RL policies: one protocol, one package (equiv.losses), every one
    # registered by name in its LOSSES, not a top-level module per family.
    from equiv.losses import LOSSES, Loss

    def subclasses(cls: type) -> set[type]:
        return {sub for direct in cls.__subclasses__() for sub in {direct} | subclasses(direct)}

    for module in MODULES:
        if module.startswith(("equiv.losses", "equiv.cases", "equiv.zoo")):
            importlib.import_module(module)
    # A peer's own objectives (equiv.peers.trl*: TRL's documented losses, declared to replay its trainers) live with
    # the peer they describe; whether a test imported them first must not decide this test.
    defined = {
        cls
        for cls in subclasses(Loss)
        if cls.__module__.startswith("equiv.") and not cls.__module__.startswith("equiv.peers.")
    }
    assert {cls.__module__ for cls in defined} <= {"equiv.losses.items", "equiv.losses.packed", "equiv.losses.policy"}
    named = {cls for cls in defined if "name" in vars(cls)}
    assert named == set(LOSSES.values()), "a loss with a name that LOSSES does not register, or the reverse"


def test_the_layer_table_names_every_top_level_module_and_package() -> None:
    # A key of LAYERS that names no module (one moved into a package) is a stale word; so is a module no key names.
    from equiv.layers import LAYERS

    top = {".".join(module.split(".")[:2]) for module in MODULES}
    assert set(LAYERS) == top


def _short(key: str) -> str:
    """A key of LAYERS as the prose writes it: ``equiv.losses`` -> ``losses``, the package itself ``equiv``."""
    return key.removeprefix("equiv.")


def _is_package(key: str) -> bool:
    return MODULES[key].name == "__init__.py"


def _layers_by_number() -> dict[int, set[str]]:
    from equiv.layers import LAYERS

    grouped: dict[int, set[str]] = {}
    for key, layer in LAYERS.items():
        grouped.setdefault(layer, set()).add(_short(key))
    return grouped


def test_contributings_layer_table_is_the_layer_table() -> None:
    # CONTRIBUTING.md's table, row by row: the layer, and in it every package (``name/``) and module (``name``).
    from equiv.layers import LAYERS

    text = (REPOSITORY / "CONTRIBUTING.md").read_text()
    rows = re.findall(r"^\| (\d+) \| ([^|]+) \|", text, flags=re.MULTILINE)
    assert rows, "CONTRIBUTING.md has no layer table"
    written = {int(layer): set(re.findall(r"`([^`]+)`", names)) for layer, names in rows}
    expected: dict[int, set[str]] = {}
    for key, layer in LAYERS.items():
        name = _short(key) + ("/" if _is_package(key) and key != "equiv" else "")
        expected.setdefault(layer, set()).add(name)
    assert written == expected


def test_contributings_tree_names_every_module_and_package() -> None:
    # The tree under "## Layout": every top-level module (``name.py``) and package (``name/``), none that is gone.
    text = (REPOSITORY / "CONTRIBUTING.md").read_text()
    tree = text.split("## Layout", 1)[1].split("```", 2)[1]
    lines = tree.splitlines()
    start = lines.index("equiv/")
    body = []
    for line in lines[start + 1 :]:
        if line and not line.startswith(" "):
            break
        body.append(line)
    written = re.findall(r"(?<!\S)(\w+(?:/|\.py))(?!\S)", "\n".join(body))
    expected = [_short(key) + ("/" if _is_package(key) else ".py") for key in MODULES if key.count(".") == 1]
    assert sorted(written) == sorted(expected)


def test_the_packages_docstring_draws_the_layer_table() -> None:
    # equiv/__init__'s flow (top layer first, ``->`` between layers) and its list name exactly LAYERS.
    doc = equiv.__doc__ or ""
    flow = doc.split("::\n", 1)[1].split("\n\n", 1)[0]
    drawn = [{name.strip() for name in group.split(",")} for group in flow.split("->")]
    grouped = _layers_by_number()
    assert drawn == [grouped[layer] for layer in sorted(grouped, reverse=True)]
    listed = [
        name
        for line in doc.splitlines()
        if line.startswith("- ")
        for name in re.findall(r"``(\w+)``", line.split(":", 1)[0])
    ]
    assert sorted(listed) == sorted(name for names in grouped.values() for name in names)


def test_micro_batches_have_one_type() -> None:
    # equiv.batches.MicroBatches is the type the candidate contract hands a step; no module writes its own copy.
    copies = []
    for module, path in MODULES.items():
        if module == "equiv.batches":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Assign) and ast.unparse(node.value) in (
                "list[tuple[Tensor, Tensor]]",
                "list[Batch]",
            ):
                copies.append(f"{module}: {ast.unparse(node)}")
            elif (
                isinstance(node, ast.arg)
                and node.arg == "micro_batches"
                and node.annotation is not None
                and ast.unparse(node.annotation) == "list[tuple[Tensor, Tensor]]"
            ):
                copies.append(f"{module}: micro_batches: {ast.unparse(node.annotation)}")
    assert copies == [], "use equiv.batches.MicroBatches"


def test_an_outcome_is_put_in_words_in_one_place() -> None:
    # A report's "not equivalent", a count's "collective mismatch": equiv.outcomes.outcome_words, not a
    # .replace("_", " ") of each module's own.
    own = []
    for module, path in MODULES.items():
        if module == "equiv.outcomes":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "replace"
                and [ast.unparse(arg) for arg in node.args] in (["'_'", "' '"], ['"_"', '" "'])
            ):
                own.append(f"{module}:{node.lineno}")
    assert own == [], "use equiv.outcomes.outcome_words"


def test_the_distributed_machinery_is_still_reachable_where_it_was_published() -> None:
    # It moved below checking and cost (equiv.distributed); the judge re-exports
    # the names users import from it, as the very same objects.
    import equiv.checking.distributed as judge
    from equiv.distributed import launcher, sharding

    assert judge.run_on_ranks is launcher.run_on_ranks
    assert judge.DistributedCheckError is launcher.DistributedCheckError
    assert judge.fully_shard_layers is sharding.fully_shard_layers
    assert {"run_on_ranks", "fully_shard_layers", "DistributedCheckError"} <= set(judge.__all__)


def _calls(tree: ast.AST, name: str) -> list[int]:
    """Lines calling ``name`` as a bare name or an attribute."""
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and (
            (isinstance(node.func, ast.Name) and node.func.id == name)
            or (isinstance(node.func, ast.Attribute) and node.func.attr == name)
        )
    ]


#: What only the engine may call: an allowance, a floor's distances, a truth, a comparer.
ENGINE_ONLY = (
    "allowance",
    "FloorErrors",
    "FloorRun",
    "TruthTrajectory",
    "StepComparer",
    "compare_trajectories",
    "floor_plan",
)


def test_one_floor_recipe_nothing_outside_the_engine_computes_an_allowance() -> None:
    # Every verdict's floors and allowances come from equiv.judging (its floor plan, its Judge): a front door
    # that measured a floor or called tolerances.allowance itself would be a second judge.
    outside = {
        f"{module}:{name}": lines
        for module, path in MODULES.items()
        if not module.startswith("equiv.judging")
        for name in ENGINE_ONLY
        if (lines := _calls(ast.parse(path.read_text()), name))
    }
    assert outside == {}, f"the engine's work done outside equiv.judging: {outside}"


def test_no_module_imports_a_private_name_of_another_package() -> None:
    private = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("equiv"):
                source_package = node.module.split(".")[:2]
                for alias in node.names:
                    hidden = alias.name.startswith("_") or any(
                        part.startswith("_") and part != "__init__" for part in node.module.split(".")
                    )
                    if hidden and source_package != module.split(".")[:2]:
                        private.append(f"{module} imports {node.module}.{alias.name}")
    assert private == []


#: Every ``__all__`` of the package: the facade's and each subpackage's that states one.
PUBLIC_NAMESPACES = [
    "equiv",
    *sorted(
        module
        for module, path in MODULES.items()
        if path.name == "__init__.py" and module != "equiv" and "__all__" in path.read_text()
    ),
]


def _public_functions() -> list[str]:
    found = []
    for namespace in PUBLIC_NAMESPACES:
        module = importlib.import_module(namespace)
        found += [f"{namespace}.{name}" for name in module.__all__ if inspect.isfunction(getattr(module, name))]
    return sorted(found)


def _public_function(dotted: str) -> Any:
    namespace, name = dotted.rsplit(".", 1)
    return getattr(importlib.import_module(namespace), name)


def test_every_subpackage_with_a_public_api_is_read() -> None:
    assert {"equiv", "equiv.adapters", "equiv.auditing", "equiv.losses"} <= set(PUBLIC_NAMESPACES)


@pytest.mark.parametrize("dotted", _public_functions())
def test_every_public_function_documents_its_args_and_what_it_returns(dotted: str) -> None:
    # The API reference (mkdocstrings, docs/api.md) is these docstrings: what each argument is and what comes back.
    function = _public_function(dotted)
    doc = inspect.getdoc(function) or ""
    signature = inspect.signature(function)
    if signature.parameters:
        assert "\nArgs:\n" in doc, f"{dotted}'s docstring needs an Args: section"
        documented = {
            name.strip()
            for line in doc.split("\nArgs:\n", 1)[1].split("\n\n", 1)[0].splitlines()
            if line.startswith("    ") and not line.startswith("     ") and ":" in line
            for name in line.split(":", 1)[0].split(",")
        }
        documented = {name.strip("*") for name in documented}
        missing = [name for name in signature.parameters if name not in documented]
        assert missing == [], f"{dotted}'s Args: does not name {missing}"
    if signature.return_annotation not in (None, "None", inspect.Signature.empty):
        assert "\nReturns:\n" in doc, f"{dotted}'s docstring needs a Returns: section"


def _raised(dotted: str) -> list[tuple[str, Any]]:
    """The exceptions a public function's ``Raises:`` section names: each entry's leading names, and any
    ``:class:`` it refers to, resolved where the function's module sees them (or by their dotted path)."""
    function = _public_function(dotted)
    doc = inspect.getdoc(function) or ""
    if "\nRaises:\n" not in doc:
        return []
    section = doc.split("\nRaises:\n", 1)[1].split("\n\n", 1)[0]
    names = [
        name.strip()
        for line in section.splitlines()
        if line.startswith("    ") and not line.startswith("     ") and ":" in line
        for name in line.split(":", 1)[0].split(",")
    ]
    found = []
    for name in names:
        found.append((name, function.__globals__.get(name, getattr(builtins, name, None))))
    for name in re.findall(r":class:`~?([\w.]+)`", section):  # an exception named in an entry's words
        referred = pkgutil.resolve_name(name)
        if isinstance(referred, type) and issubclass(referred, BaseException):  # not a value it carries (Fault)
            found.append((name, referred))
    return found


@pytest.mark.parametrize("dotted", _public_functions())
def test_every_exception_a_public_function_raises_is_importable_from_equiv(dotted: str) -> None:
    # A user catches what a front door raises without knowing where in the package it is defined.
    for name, error in _raised(dotted):
        if error is None:
            continue  # another library's (Hypothesis's InvalidArgument), not imported where the function is
        assert isinstance(error, type) and issubclass(error, BaseException), f"{dotted} raises {name}: not an exception"
        if error.__module__.split(".")[0] == "equiv":
            assert getattr(equiv, error.__name__, None) is error and error.__name__ in equiv.__all__, (
                f"{dotted} raises {error.__module__}.{error.__name__}, which is not importable from equiv"
            )


def test_the_raises_sections_are_read() -> None:
    # The test above can only fail if it finds the exceptions: check's and plan's are named and resolved.
    assert {error.__name__ for _, error in _raised("equiv.check")} >= {
        "CandidateError",
        "CandidateTimeout",
        "CheckTimeout",
    }
    assert any(error is not None and error.__name__ == "NothingFitsError" for _, error in _raised("equiv.plan"))


# -- Sizes that fit a screen ------------------------------------------------------------------------
# A module, a function and a parameter list each have a size past which a reader stops holding them in
# mind.  The limits are the issue-43 house rules: no module over 800 lines; at most 10 functions over 60
# lines (the whole ``def`` span, docstring included: a long public docstring is a cost too); at most 8
# functions taking more than 8 parameters (an options record where a keyword list grew).  ``python
# tests/test_layout.py`` prints the numbers this file enforces, with the import graph's.

MODULE_LINES, FUNCTION_LINES, PARAMETERS = 800, 60, 8
MOST_LONG_FUNCTIONS, MOST_WIDE_FUNCTIONS = 10, 8


def _typed_dict_fields() -> dict[str, int]:
    """Class name -> annotated fields of every class that subclasses ``TypedDict`` in the package."""
    fields = {}
    for path in MODULES.values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(ast.unparse(b).endswith("TypedDict") for b in node.bases):
                fields[node.name] = sum(isinstance(item, ast.AnnAssign) for item in node.body)
    return fields


def _functions() -> list[tuple[str, int, int]]:
    """(dotted name, lines of its ``def`` span, parameters) of every function.  Parameters leave out
    ``self``/``cls`` and count each key of a ``**options: Unpack[SomeTypedDict]``: a caller still
    passes them one by one, so a typed keyword record is no shorter a list than the keywords."""
    typed = _typed_dict_fields()
    found = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = node.args
                named = [*args.posonlyargs, *args.args, *args.kwonlyargs]
                bound = 1 if named and named[0].arg in ("self", "cls") else 0
                unpacked = args.kwarg.annotation if args.kwarg is not None else None
                keys = 0
                if isinstance(unpacked, ast.Subscript) and ast.unparse(unpacked.value).endswith("Unpack"):
                    keys = typed[ast.unparse(unpacked.slice).strip("'\"")]
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                found.append((f"{module}.{node.name}", lines, len(named) - bound + keys))
    return found


FUNCTIONS = _functions()


def _over(limit: int, column: int) -> list[tuple[str, int]]:
    return sorted(((row[0], row[column]) for row in FUNCTIONS if row[column] > limit), key=lambda r: -r[1])


def test_no_module_is_longer_than_800_lines() -> None:
    long = {module: n for module, path in MODULES.items() if (n := len(path.read_text().splitlines())) > MODULE_LINES}
    assert not long, f"modules over {MODULE_LINES} lines (split along an idea they hold): {long}"


def test_at_most_ten_functions_are_longer_than_60_lines() -> None:
    long = _over(FUNCTION_LINES, 1)
    assert len(long) <= MOST_LONG_FUNCTIONS, f"{len(long)} functions over {FUNCTION_LINES} lines: {long}"


def test_at_most_eight_functions_take_more_than_8_parameters() -> None:
    wide = _over(PARAMETERS, 2)
    assert len(wide) <= MOST_WIDE_FUNCTIONS, f"{len(wide)} functions over {PARAMETERS} parameters: {wide}"


def graph_numbers() -> dict[str, Any]:
    """The import graph's and the sizes' numbers, as the closing notes of the house issues state them."""
    between = [(a, b) for a, targets in GRAPH.items() for b in targets if _subpackage(a) != _subpackage(b)]
    return {
        "modules": len(MODULES),
        "top-level modules": sum(1 for m, p in MODULES.items() if m.count(".") == 1 and p.name != "__init__.py"),
        "imports between modules": sum(len(targets) for targets in GRAPH.values()),
        "imports between packages": len(between),
        "imports against the layer order": sum(1 for a, ts in GRAPH.items() for b in ts if _layer(b) > _layer(a)),
        f"modules over {MODULE_LINES} lines": sum(
            1 for path in MODULES.values() if len(path.read_text().splitlines()) > MODULE_LINES
        ),
        f"functions over {FUNCTION_LINES} lines": _over(FUNCTION_LINES, 1),
        f"functions over {PARAMETERS} parameters": _over(PARAMETERS, 2),
    }


#: The one meaning ``kind`` keeps as a name (issue 43, item 4) is which result a JSON envelope holds
#: (``ResultBase.KIND``, the ``"kind"`` key): a string, never an identifier.  An attribute may still be
#: named ``kind`` only as the alias of its new name, a property that says so (a result's ``outcome``,
#: a TensorDiff's ``quantity``, LossOptions' ``family``, a kind of failure's ``failure``), kept for
#: code written before the rename.
_ALIAS_DOC = re.compile(r"The same as :(attr|meth):`\w+`; kept for code written before it\.")


def _targets(statement: ast.AnnAssign | ast.Assign) -> list[ast.expr]:
    return statement.targets if isinstance(statement, ast.Assign) else [statement.target]


def _misnamed(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, what) for each function or parameter named ``judge`` and each parameter or attribute named
    ``kind`` that ``tree`` defines, the documented aliases apart."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            params = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs, node.args.vararg, node.args.kwarg]
            found += [
                (node.lineno, f"parameter {a.arg}") for a in params if a is not None and a.arg in ("judge", "kind")
            ]
            if node.name == "judge":
                found.append((node.lineno, "function judge"))
            if node.name == "kind" and not _ALIAS_DOC.fullmatch(ast.get_docstring(node) or ""):
                found.append((node.lineno, "attribute kind (not a documented alias)"))
        elif isinstance(node, ast.ClassDef):
            found += [
                (item.lineno, "attribute kind")
                for item in node.body
                if isinstance(item, ast.AnnAssign | ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "kind" for t in _targets(item))
            ]
        elif isinstance(node, ast.Attribute) and node.attr == "kind" and isinstance(node.ctx, ast.Store):
            found.append((node.lineno, "attribute kind"))
    return found


def test_kind_and_judge_each_mean_one_thing() -> None:
    # issue 43, item 4: a result's Outcome is .outcome, a tensor's update/buffer/state .quantity, a kind of
    # failure .failure/.failure_kind; a search asks decide(), verdicts come from verdict-named functions.
    misnamed = [
        f"{key}:{line}: {what}"
        for key, path in _modules().items()
        for line, what in _misnamed(ast.parse(path.read_text(), filename=str(path)))
    ]
    assert not misnamed, "names that mean another thing:\n" + "\n".join(misnamed)


def test_the_misnamed_check_finds_each_case() -> None:
    # The test above can only fail if the reader finds what it forbids.
    source = (
        "def judge(x): ...\n"
        "def f(kind): ...\n"
        "def g(*, judge): ...\n"
        "class A:\n    kind: str\n"
        "class B:\n    @property\n    def kind(self):\n        return 1\n"
        "self.kind = 1\n"
        "class C:\n    @property\n    def kind(self):\n"
        '        """The same as :attr:`outcome`; kept for code written before it."""\n'
    )
    assert [what for _, what in _misnamed(ast.parse(source))] == [
        "function judge",
        "parameter kind",
        "parameter judge",
        "attribute kind",
        "attribute kind (not a documented alias)",
        "attribute kind",
    ]


if __name__ == "__main__":
    for name, value in graph_numbers().items():
        print(f"{name}: {len(value)} {value}" if isinstance(value, list) else f"{name}: {value}")

"""The package's layers, stated once: lower layers never import higher ones.

Read bottom to top, the tree shows the flow of a verdict::

    facade      equiv, strategies, testing, pytest_plugin, __main__   (what a user types)
    cli         the equiv command: argparse and exit codes live only here
    reporting   renders results into markdown; measures nothing
    findings    what reports/equivalence.md shows, measured
    peers       other libraries' trainers driven as their users drive them
    auditing    a live run watched through hooks, windows replayed
    checking    front doors: check, verify, distributed, pipeline   |  cost: memory, planner
    judging     the engine: runs, the one floor plan, comparison, allowances, the Judge
    results     what every front door returns (rows, verdicts, facts)
    cases       what to run  |  zoo: known bugs  |  adapters: other libraries' steps
    base        accumulator, losses (items, packed, policy), batches, distributed (launcher, sharding),
                outcomes, names, host_memory, layers

``tests/test_layout.py`` reads every import in the source (lazy ones too) and
fails on one that points up this table.
"""

from __future__ import annotations

__all__ = ["FACADE", "LAYERS", "layer_of"]

#: Module (or package) prefix -> layer; the longest matching prefix decides.
LAYERS: dict[str, int] = {
    "equiv.batches": 0,
    "equiv.losses": 0,
    "equiv.accumulator": 0,
    "equiv.distributed": 0,
    "equiv.names": 0,
    "equiv.outcomes": 0,
    "equiv.host_memory": 0,
    "equiv.layers": 0,
    "equiv.cases": 1,
    "equiv.zoo": 1,
    "equiv.adapters": 1,
    "equiv.results": 2,
    "equiv.judging": 3,
    "equiv.checking": 4,
    "equiv.cost": 4,
    "equiv.auditing": 5,
    "equiv.peers": 6,
    "equiv.findings": 7,
    "equiv.reporting": 8,
    "equiv.cli": 9,
    "equiv.strategies": 10,
    "equiv.testing": 10,
    "equiv.pytest_plugin": 10,
    "equiv.__main__": 10,
    "equiv": 10,
}
#: The public facade sits above everything.
FACADE = 10


def layer_of(module: str) -> int:
    """The layer of a dotted module name inside equiv (``KeyError`` outside it)."""
    matches = [prefix for prefix in LAYERS if module == prefix or module.startswith(prefix + ".")]
    if not matches:
        raise KeyError(f"{module!r} is not an equiv module")
    return LAYERS[max(matches, key=len)]

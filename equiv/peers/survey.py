"""Measure every peer in every situation: the results reports/peers.md renders.

One window per call goes through :func:`equiv.check`; whole runs and the
transformers Trainer through :mod:`equiv.peers.runs` (the same checker, the
same derived allowances).  A NOT cell names the kind of failure, its magnitude
and the upstream report it matches.  :func:`survey` returns plain data
(:mod:`equiv.peers.results`); :mod:`equiv.reporting.peers` renders it.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import json
import logging
from pathlib import Path
from typing import Any

from equiv.auditing.runs import AUDIT_RUNS
from equiv.cases.case import Case
from equiv.checking.check import check
from equiv.outcomes import Outcome
from equiv.peers.catalogue import (
    CONFIGURATIONS,
    EPOCH_RUNS,
    KNOWN,
    SHORT,
    TRAINER_RUNS,
    Peer,
    not_measured,
    own,
    peers,
    versions,
)
from equiv.peers.results import (
    EQUIVALENT,
    NOT_APPLICABLE,
    NOT_EQUIVALENT,
    NOT_RUN,
    Cell,
    Chart,
    PeerRow,
    PeersResults,
    Situation,
)
from equiv.peers.runs import EpochRun, Measure, classify_step, measure, measure_epochs, windows
from equiv.peers.search import SEARCHABLE, smallest_counterexample
from equiv.zoo.kinds import KINDS, PER_MICRO_BATCH_CLIPPING, WINDOW_BOUNDARY

__all__ = ["survey", "trainer_results", "write_trainer_results"]

log = logging.getLogger(__name__)

_ALL_KINDS = (*KINDS, PER_MICRO_BATCH_CLIPPING, WINDOW_BOUNDARY)
#: The column whose per-window update scales are charted (the tail divided by N).
_CHARTED = "tail of a long epoch: 7 micro-batches, N=3 (Lightning #19987)"


def _cell(result: Measure, issues: dict[str, str]) -> Cell:
    """A cell from a measured run: equivalent (with its precision note), or NOT
    with the kind(s), the upstream report each matches, the magnitude."""
    if result.equivalent:
        return Cell(EQUIVALENT, note=result.note or "")
    failure = result.failure_name()
    upstream = "; ".join(issues[name] for name in failure.split(" + ") if issues.get(name))
    return Cell(NOT_EQUIVALENT, failure=failure, detail=result.magnitude(), upstream=upstream, checker=result.checker())


def _window_cell(peer: Peer, case: Case) -> tuple[Cell, str | None]:
    """The cell for one window per call, and the kind of failure to search for."""
    candidate = peer.build(None)
    verdict = check(candidate, case)
    if verdict.status is Outcome.NOT_APPLICABLE:
        return Cell(NOT_APPLICABLE, detail="; ".join(verdict.not_applicable)), None
    if verdict:
        return Cell(EQUIVALENT, note=verdict.precision_note or ""), None
    result = classify_step(peer.build(None), case, verdict=verdict)
    if result.gap is None:
        # The float64 runs agree: the mismatch is in the float32 tier (rounding beyond the noise floor).
        first = verdict.first_mismatch
        assert first is not None
        return Cell(
            NOT_EQUIVALENT,
            failure="float32 rounding",
            detail=f"step {first.step}, {first.label}",
            checker=result.checker(),
        ), "float32 rounding"
    cell = _cell(result, peer.issues)
    return cell, cell.failure


def _epoch_cell(peer: Peer, run: EpochRun) -> tuple[Cell, Measure | None]:
    if peer.epochs is None:
        return Cell(NOT_RUN, detail="no epoch loop of its own"), None
    result = measure_epochs(peer.epochs(run.n), run)
    return _cell(result, peer.issues), result


def trainer_cells(loss_kwargs: bool) -> dict[str, Cell]:
    """One cell per :data:`TRAINER_RUNS` column for the installed transformers' Trainer."""
    from equiv.adapters.transformers import TrainerRun

    before_fix = tuple(int(p) for p in importlib.metadata.version("transformers").split(".")[:2]) < (4, 46)
    issues = {
        "mean of means": "transformers #34191" if before_fix else "transformers #37766" if not loss_kwargs else ""
    }
    cells = {}
    for column, template in TRAINER_RUNS.items():
        run = dataclasses.replace(template, loss_kwargs=loss_kwargs)
        result = measure(
            lambda model, optimizer, micro, run=run: TrainerRun(run.n).train(  # type: ignore[misc]
                model, optimizer, micro, epochs=run.epochs
            ),
            run,
        )
        cells[column] = _cell(result, issues)
    return cells


#: The model's forward with ``**kwargs`` (5.x passes it ``num_items_in_batch``; 4.45.2 passes nothing), and without.
_TRAINER_VARIANTS = ((True, "model forward(**kwargs)"), (False, "model forward without **kwargs"))


def trainer_results() -> dict[str, Any]:
    """The installed transformers' Trainer measured: its version and one row of
    cells per model variant (with and without ``num_items_in_batch`` in forward)."""
    version = importlib.metadata.version("transformers")
    return {
        "transformers": version,
        "rows": [
            [
                f"transformers {version} Trainer: {what}",
                {column: cell.to_dict() for column, cell in trainer_cells(loss_kwargs).items()},
            ]
            for loss_kwargs, what in _TRAINER_VARIANTS
        ],
    }


def write_trainer_results(path: str | Path) -> None:
    """Measure the installed Trainer into ``path`` (JSON): how an older release,
    installed in a tox env of its own (``tox -e peers-transformers445``), reaches the report."""
    Path(path).write_text(json.dumps(trainer_results(), indent=1, sort_keys=True, ensure_ascii=False) + "\n")


def _trainer_rows(saved: Path) -> list[PeerRow]:
    """The installed transformers' Trainer, then releases measured in their own
    env (``peers-trainer-*.json`` in ``saved``), oldest first."""
    results = []
    if "the transformers Trainer" not in not_measured():
        results.append(trainer_results())
    results += [json.loads(path.read_text()) for path in sorted(saved.glob("peers-trainer-*.json"))]
    rows = []
    for result in sorted(results, key=lambda r: tuple(int(p) for p in r["transformers"].split(".")[:3])):
        for name, cells in result["rows"]:
            row = PeerRow(
                name,
                family="transformers",
                group="trainer",
                drives="Trainer(args=TrainingArguments(gradient_accumulation_steps=N)).train()",
            )
            for column in TRAINER_RUNS:
                saved_cell = cells.get(column)
                if isinstance(saved_cell, dict):
                    row.cells[column] = Cell.from_dict(saved_cell)
                else:  # missing, or a cell saved as text by an older equiv: no verdict to trust
                    why = "not in the saved results" if saved_cell is None else "saved by an older equiv as text"
                    row.cells[column] = Cell(NOT_RUN, detail=f"{why}: measure it again (tox -e peers-transformers445)")
            rows.append(row)
    return rows


def _evaluate(peer: Peer, group: str, charted: list[tuple[str, Measure]]) -> tuple[PeerRow, set[str]]:
    """The peer's row, and the kinds of failure seen one window per call (what the
    search can reach); the charted column's measure goes to ``charted``."""
    row = PeerRow(peer.name, family=peer.family, drives=peer.drives, documented=peer.documented, group=group)
    kinds: set[str] = set()
    for column, case in CONFIGURATIONS.items():
        row.cells[column], failure = _window_cell(peer, case)
        if failure is not None:
            kinds.update(failure.split(" + "))
    if group == "peer":
        for column, run in EPOCH_RUNS.items():
            row.cells[column], result = _epoch_cell(peer, run)
            if column == _CHARTED and result is not None:
                charted.append((peer.name, result))
    return row, kinds


def _counterexamples(peer: Peer, kinds_seen: set[str]) -> list[dict[str, str]]:
    out = []
    candidate = peer.build(None)
    kinds: list[str | None] = [k for k in SEARCHABLE if k in kinds_seen]
    for failure in kinds or [None]:
        found, tried = smallest_counterexample(candidate, failure=failure)
        log.info("%s, %s: %d search cases", peer.name, failure or "any failure", tried)
        out.append(
            {
                "implementation": peer.name,
                "kind of failure": failure or "any",
                "smallest counterexample (Hypothesis, shrunk)": f"`{found!r}`" if found else f"none in {tried} cases",
            }
        )
    return out


def _audits() -> list[dict[str, str]]:
    """The real runs of :mod:`equiv.auditing.runs`, audited (``equiv.audit``)."""
    rows = []
    for name, entry in AUDIT_RUNS.items():
        missing = [package for package in entry.needs if importlib.util.find_spec(package) is None]
        if missing:
            rows.append(
                {
                    "run": name,
                    "what": entry.what,
                    "audited steps": "-",
                    "not equivalent": "-",
                    "first flagged": f"not run: {missing[0]} is not installed (pip install equiv[peers])",
                    "reproduces": entry.reproduces,
                    "command": f"`pytest {entry.test}`",
                }
            )
            continue
        watched = entry.run()
        failures = watched.failures
        rows.append(
            {
                "run": name,
                "what": entry.what,
                "audited steps": str(len(watched.windows)),
                "not equivalent": ", ".join(str(w.step) for w in failures) or "none",
                "first flagged": failures[0].line() if failures else "-",
                "reproduces": entry.reproduces if failures else "-",
                "command": f"`pytest {entry.test}`",
            }
        )
    return rows


def _tail_chart(measured: list[tuple[str, Measure]]) -> Chart | None:
    """Each window's update against the full-batch one over the charted epoch, for
    every peer whose run there divides its tail by N, beside an equivalent one."""
    run = EPOCH_RUNS[_CHARTED]
    shrunk = [
        (name, m) for name, m in measured if m.failure_kind is not None and m.failure_kind.name == "tail divided by N"
    ]
    exact = [(name, m) for name, m in measured if m.equivalent]
    if not shrunk:
        return None
    sizes = [len(window) for window in windows(len(run.case.micro_batch_sizes), run.n)]
    series: list[tuple[str, tuple[float, ...]]] = []
    for group in (shrunk, exact[:1]):
        by_values: dict[tuple[float, ...], list[str]] = {}
        for name, m in group:
            by_values.setdefault(tuple(round(s, 3) for s in m.scales), []).append(name)
        series += [(" and ".join(names), values) for values, names in by_values.items()]
    return Chart(
        heading="Update per window over an epoch's tail",
        title=f"Update per window against the full-batch update, {SHORT[_CHARTED].removeprefix('run: ')} "
        f"({run.describe()})",
        x_label="window (micro-batches in it)",
        x=tuple(f"{position + 1} ({size})" for position, size in enumerate(sizes)),
        y_label="update / full-batch update",
        series=tuple(series),
    )


def _situations() -> list[Situation]:
    return [
        *(Situation(name, SHORT[name], "window", f"`{case!r}`") for name, case in CONFIGURATIONS.items()),
        *(Situation(name, SHORT[name], "run", f"{run.describe()}, `{run.case!r}`") for name, run in EPOCH_RUNS.items()),
        *(Situation(name, SHORT[name], "trainer", run.describe()) for name, run in TRAINER_RUNS.items()),
    ]


def survey(saved: Path = Path("reports")) -> PeersResults:
    """Measure every peer (``saved``: results measured in other environments, an
    older transformers release) and everything reports/peers.md shows."""
    peer_list, own_list = peers(), own()
    charted: list[tuple[str, Measure]] = []
    evaluated = [_evaluate(peer, "peer", charted) for peer in peer_list]
    own_evaluated = [_evaluate(peer, "own", charted) for peer in own_list]
    searches = [
        entry
        for (row, kinds), peer in zip([*evaluated, *own_evaluated], [*peer_list, *own_list], strict=True)
        for entry in _counterexamples(peer, kinds)
    ]
    chart = _tail_chart(charted)
    return PeersResults(
        versions=versions(),
        not_measured=not_measured(),
        situations=_situations(),
        rows=[row for row, _ in evaluated] + _trainer_rows(saved) + [row for row, _ in own_evaluated],
        kinds=[(failure.name, failure.means) for failure in _ALL_KINDS],
        known=list(KNOWN),
        searches=searches,
        audits=_audits(),
        charts=[chart] if chart is not None else [],
    )

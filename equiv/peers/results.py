"""What the peers survey measured, as plain data: what :mod:`equiv.reporting.peers` renders.

Nothing here measures; :mod:`equiv.peers.survey` fills these in (and reads
the rows of a transformers release measured in another environment from
JSON, :meth:`Cell.from_dict`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from equiv.outcomes import Outcome

__all__ = ["Cell", "Chart", "PeerRow", "PeersResults", "Situation"]

#: Outcomes a cell can have (the words reports/peers-*.json hold; :attr:`Cell.status` maps them to Outcome).
EQUIVALENT, NOT_EQUIVALENT, NOT_APPLICABLE, NOT_RUN = "equivalent", "not equivalent", "not applicable", "not run"
_STATUS = {
    EQUIVALENT: Outcome.EQUIVALENT,
    NOT_EQUIVALENT: Outcome.NOT_EQUIVALENT,
    NOT_APPLICABLE: Outcome.NOT_APPLICABLE,
}


@dataclass(frozen=True)
class Cell:
    """One peer in one situation."""

    #: one of EQUIVALENT, NOT_EQUIVALENT, NOT_APPLICABLE, NOT_RUN
    outcome: str
    #: the kind(s) of failure ("tail divided by N + window boundary"); "" unless not equivalent
    #: (saved as "kind", the key reports/peers-*.json hold)
    failure: str = ""
    #: what happened: the first failing step's magnitude, the reason it does not apply or was not run
    detail: str = ""
    #: the upstream report(s) the failure matches
    upstream: str = ""
    #: the checker's first tensor past its allowance (tier, how many times the allowance)
    checker: str = ""
    #: the precision note of an equivalent cell whose float64 run differs by float32 rounding only
    note: str = ""

    def __post_init__(self) -> None:
        if self.outcome not in (EQUIVALENT, NOT_EQUIVALENT, NOT_APPLICABLE, NOT_RUN):
            raise ValueError(
                f"outcome must be one of {EQUIVALENT!r}, {NOT_EQUIVALENT!r}, {NOT_APPLICABLE!r}, "
                f"{NOT_RUN!r}, got {self.outcome!r}"
            )

    @property
    def kind(self) -> str:
        """The same as :attr:`failure`; kept for code written before it."""
        return self.failure

    @property
    def failed(self) -> bool:
        return self.outcome == NOT_EQUIVALENT

    @property
    def status(self) -> Outcome | None:
        """The cell's outcome in the one vocabulary (None: not run for this peer)."""
        return _STATUS.get(self.outcome)

    def mark(self) -> str:
        """The cell at a glance: ✓, ✗ (kind), n/a, or - (not run for this peer)."""
        if self.outcome == EQUIVALENT:
            return "✓"
        if self.outcome == NOT_EQUIVALENT:
            return f"✗ ({self.failure})" if self.failure else "✗"
        return "n/a" if self.outcome == NOT_APPLICABLE else "-"

    def to_dict(self) -> dict[str, str]:
        # The saved key stays "kind" (reports/peers-*.json), in the field's place.
        return {("kind" if key == "failure" else key): value for key, value in asdict(self).items()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Cell:
        """A cell saved by :meth:`to_dict`; unknown keys are a ValueError naming them."""
        fields = {("failure" if key == "kind" else key): value for key, value in data.items()}
        unknown = sorted(set(data) - {("kind" if name == "failure" else name) for name in cls.__dataclass_fields__})
        if unknown:
            raise ValueError(f"a saved peers cell has unknown keys {unknown}: {data!r}")
        return cls(**fields)


@dataclass(frozen=True)
class Situation:
    """A column: one configuration or run every peer of its group is measured in."""

    name: str
    #: its name in the table read at a glance
    short: str
    #: "window" (one window per call), "run" (whole epochs), "trainer" (one Trainer.train())
    group: str
    #: the case or data, in words
    data: str


@dataclass
class PeerRow:
    name: str
    family: str = ""
    drives: str = ""
    documented: str = ""
    #: "peer", "trainer" or "own" (equiv's own loops, reference points)
    group: str = "peer"
    #: situation name -> cell
    cells: dict[str, Cell] = field(default_factory=dict)

    def equivalent_in(self) -> list[str]:
        return [name for name, cell in self.cells.items() if cell.outcome == EQUIVALENT]

    def failing_in(self) -> list[str]:
        return [name for name, cell in self.cells.items() if cell.failed]


@dataclass(frozen=True)
class Chart:
    """Measured series over one axis (an xychart)."""

    #: the section it opens
    heading: str
    title: str
    x_label: str
    x: tuple[str, ...]
    y_label: str
    #: (what the series is, its values), the first drawn as bars, the rest as lines
    series: tuple[tuple[str, tuple[float, ...]], ...]


@dataclass
class PeersResults:
    versions: dict[str, str]
    #: optional peer -> why this environment could not run it
    not_measured: dict[str, str]
    situations: list[Situation]
    rows: list[PeerRow]
    #: (kind of failure, what it is)
    kinds: list[tuple[str, str]]
    #: (repository, issue, what, how this report knows it)
    known: list[tuple[str, str, str, str]]
    #: rows of the counterexample search: implementation, kind of failure, the shrunk case
    searches: list[dict[str, str]] = field(default_factory=list)
    #: rows of the audited real runs
    audits: list[dict[str, str]] = field(default_factory=list)
    charts: list[Chart] = field(default_factory=list)

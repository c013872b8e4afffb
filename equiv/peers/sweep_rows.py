"""One row of a sweep (issue 45): a subject of another library (a transformers model class, a TRL trainer)
built tiny, trained by its real trainer with gradient accumulation, audited, and what came of it.

A sweep is a run source over many subjects: each subject's run is audited by :func:`equiv.audit`
(through the trainer's callback) and its :class:`~equiv.results.audit.AuditResult` is the verdict; a row
keeps that result's own ``to_dict()`` (the schema every result shares) beside the subject's name, or the one
line saying why the subject could not be built or run.  Rows are plain, picklable data, so a sweep fanned out
over processes or Ray tasks gives the same rows (and the same report, byte for byte) as one run in process.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from equiv.outcomes import Outcome, outcome_words

__all__ = ["COULD_NOT_RUN", "SweepRow"]

#: A row's outcome when its subject could not be built or run (its ``reason`` says why, in one line).
COULD_NOT_RUN = "could_not_run"


#: Tensor mismatches a row keeps of each window (the first says where; the rest, one per parameter of every
#: failing window of hundreds of subjects, made a report's rows tens of megabytes); their count is kept.
KEPT_MISMATCHES = 1


def _kept(audit: dict[str, Any]) -> dict[str, Any]:
    """The audit's dict with each window's ``mismatches`` cut to the first :data:`KEPT_MISMATCHES`, their
    number in ``mismatched`` (idempotent: a row read back from JSON is kept the same)."""
    windows = []
    for window in audit.get("windows", []):
        mismatches = window.get("mismatches")
        if isinstance(mismatches, list) and len(mismatches) > KEPT_MISMATCHES:
            window = {**window, "mismatches": mismatches[:KEPT_MISMATCHES], "mismatched": len(mismatches)}
        windows.append(window)
    return {**audit, "windows": windows} if "windows" in audit else audit


@dataclass(frozen=True)
class SweepRow:
    """One subject of a sweep: its verdict (the audit's result) or why it could not run."""

    #: the subject, as a user names it ("GPT2ForTokenClassification", "DPOTrainer")
    subject: str
    #: the family it belongs to ("causal LM", "token classification", "DPO")
    family: str
    #: the audit's ``AuditResult.to_dict()`` (each window's tensor mismatches cut to the first, their count in
    #: ``mismatched``); None when the subject could not run
    audit: dict[str, Any] | None = None
    #: why the subject could not be built or run, one line; "" when it ran
    reason: str = ""
    #: what was run, so a maintainer can reproduce it: the config's fields that were set, the trainer's
    #: arguments, the items per micro-batch (plain JSON values)
    setup: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if (self.audit is None) == (not self.reason):
            raise ValueError(
                f"a sweep row holds either an audit or a reason, got audit={'set' if self.audit else None} "
                f"and reason={self.reason!r} for {self.subject!r}"
            )
        if self.audit is not None:
            object.__setattr__(self, "audit", _kept(self.audit))

    @property
    def outcome(self) -> str:
        """The audit's status (``Outcome.value``: "equivalent", "not_equivalent", ...) or COULD_NOT_RUN."""
        if self.audit is None:
            return COULD_NOT_RUN
        return str(self.audit["status"])

    @property
    def verdict(self) -> str:
        """The outcome as a report's cell writes it ("not equivalent", "could not run")."""
        return outcome_words(self.outcome)

    @property
    def status(self) -> Outcome | None:
        """The audit's status as an Outcome; None when the subject could not run."""
        return None if self.audit is None else Outcome(self.audit["status"])

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON data (the report's ``--format json`` rows)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SweepRow:
        """The row :meth:`to_dict` wrote."""
        return cls(**data)

"""What an audit returns (:func:`equiv.audit`): the verdict on each audited optimizer step
(:class:`WindowAudit`, with each rank's part, :class:`RankVerdict`, in a multi-process run) and
the audit's own result over them (:class:`AuditResult`: every step counted, the summary, the
JSON of the schema's ``audit`` and ``window_audit`` kinds).

Plain data, below the hooks that fill it: :class:`equiv.auditing.watch.Audit` (what
``equiv.audit`` returns) is an :class:`AuditResult` whose hooks append the windows as the run
steps; the result reads only what it holds.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from equiv.outcomes import Outcome
from equiv.results.protocol import ResultBase, headed
from equiv.results.verdict import FailureKind, TensorDiff, Tier
from equiv.results.witness import NOT_A_REWEIGHTING, NOT_IDENTIFIABLE, UNEXPLAINED, Witness

__all__ = ["AuditFailure", "AuditResult", "RankVerdict", "WindowAudit"]


@dataclass(frozen=True, slots=True)
class RankVerdict:
    """One rank's verdict on a window, as the other ranks see it."""

    rank: int
    equivalent: bool
    #: the tensor furthest off (its label) and by how much of its scale, when not equivalent
    furthest: str | None = None
    relative_error: float = 0.0
    #: the worst ratio to the allowance over every tensor of the rank
    worst_ratio: float = 0.0
    #: whether this is the rank holding the window (set after the gather; not sent)
    mine: bool = False


@dataclass(frozen=True, slots=True)
class WindowAudit(ResultBase):
    """The verdict on one audited optimizer step: truthy only when equivalent."""

    KIND = "window_audit"

    step: int
    #: forward calls (micro-batches) in the window
    micro_batches: int
    #: items the loss counts in each micro-batch (real tokens, samples)
    items: tuple[int, ...]
    tier: Tier
    #: every tensor past its allowance (empty: equivalent)
    mismatches: tuple[TensorDiff, ...]
    #: the tensor closest to (or furthest past) its allowance
    worst: TensorDiff | None
    #: the micro-batch count of the run's usual window, when this one is shorter or longer
    usual_micro_batches: int | None = None
    #: why no accumulation can reproduce this model's full-batch step (Dropout, BatchNorm in
    #: train mode): then the window is not replayed, and is neither equivalent nor a failure
    inherent: tuple[str, ...] = ()
    #: where in the run the step fell, as the trainer tells it (e.g. "epoch 0, batch 6"), when it does
    position: str | None = None
    #: what the run may have done that the audit was not told (e.g. clipping), said after a failing
    #: line; for a window not replayed (``inherent``), what to change so the run can be audited
    hint: str | None = None
    #: a NaN or inf named: the run's gradient, update or optimizer state (step, tensor, first index;
    #: the window is then never equivalent), or, with ``full_batch_not_finite``, the full-batch step's
    not_finite: str | None = None
    #: the full-batch step of the window is itself not finite while the run's step is: the window's
    #: own data (NaN inputs or targets, no item to count) leaves nothing to judge against
    full_batch_not_finite: bool = False
    #: in a multi-process run, every rank's verdict on the window (this rank's among them), in rank order;
    #: the window is equivalent only when every rank's is
    ranks: tuple[RankVerdict, ...] = ()
    #: the optimizer's LR schedule advanced more than once in the window, changing a hyperparameter the
    #: step took (a scheduler stepped per micro-batch): named, with the count; the window is then not equivalent
    schedule: str | None = None
    #: what the loop did that is wrong but left this step the full-batch one (a constant schedule stepped per
    #: micro-batch), said after the verdict
    note: str | None = None
    #: for a failing window, the weights the run gave each micro-batch's loss beside the full batch's, named
    #: (issue 44); None for a passing window (never computed), an FSDP2 run, or a failure of another sort
    witness: Witness | None = None
    #: the trainer's setting the witness points at (e.g. "model_accepts_loss_kwargs=True but the model's loss
    #: ignored num_items_in_batch"), said before the witness's clause; a remedy of the whole run
    setting: str | None = None

    @property
    def equivalent(self) -> bool:
        return (
            not self.mismatches
            and not self.inherent
            and self.not_finite is None
            and self.schedule is None
            and all(rank.equivalent for rank in self.ranks)
        )

    @property
    def ranks_off(self) -> tuple[int, ...]:
        """The ranks whose step is not the global full-batch one (empty in one process)."""
        return tuple(rank.rank for rank in self.ranks if not rank.equivalent)

    @property
    def judged(self) -> bool:
        """Whether the window was judged: replayed, against a finite full-batch step."""
        return not self.inherent and not self.full_batch_not_finite

    @property
    def status(self) -> Outcome:
        """NOT_EQUIVALENT (past an allowance, or the run not finite), INHERENTLY_NON_EQUIVALENT (not
        replayed), NOT_APPLICABLE (the full-batch step not finite), else EQUIVALENT."""
        if self.not_finite is not None and not self.full_batch_not_finite:
            return Outcome.NOT_EQUIVALENT
        if self.inherent:
            return Outcome.INHERENTLY_NON_EQUIVALENT
        if self.full_batch_not_finite:
            return Outcome.NOT_APPLICABLE
        return Outcome.NOT_EQUIVALENT if self.mismatches or self.ranks_off or self.schedule else Outcome.EQUIVALENT

    def __bool__(self) -> bool:
        return self.equivalent

    @property
    def failure_kind(self) -> FailureKind | None:
        """The kind of this window's failure as the witness names it (one classifier: where its normaliser
        is one of ``equiv check``'s kinds, the same name), or unclassified with why; None without a witness."""
        if self.witness is None:
            return None
        if self.witness.normaliser in (NOT_A_REWEIGHTING, NOT_IDENTIFIABLE, UNEXPLAINED):
            return FailureKind.unclassified(self.witness.normaliser + ": " + self.witness.means)
        first, *also = self.witness.normaliser.split(" or ")
        return FailureKind(first, self.witness.means, tuple(also))

    def _failure(self) -> AssertionError:
        return AuditFailure(self)

    def _fields(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "position": self.position,
            "micro_batches": self.micro_batches,
            "items": list(self.items),
            "usual_micro_batches": self.usual_micro_batches,
            "tier": self.tier,
            "inherent": list(self.inherent),
            "mismatches": [d.to_dict() for d in self.mismatches],
            "worst": None if self.worst is None else self.worst.to_dict(),
            "hint": self.hint,
            "not_finite": self.not_finite,
            "full_batch_not_finite": self.full_batch_not_finite,
            "ranks": [dataclasses.asdict(rank) for rank in self.ranks],
            "schedule": self.schedule,
            "note": self.note,
            # only a failing window's witness: a passing window's JSON is as it was
            **({} if self.witness is None else {"weights": self.witness.to_dict()}),
            **({} if (kind := self.failure_kind) is None else {"failure_kind": kind.to_dict()}),
            **({} if self.setting is None else {"setting": self.setting}),
        }

    def line(self, *, remedies: bool = True) -> str:
        """One line: the step, the window, the verdict and its magnitude, and for a failing window what the
        run weighted each micro-batch by (the witness).  ``remedies=False`` leaves out what applies to the
        whole run (a not-replayed window's remedy, the trainer's setting at fault): the summary says it once."""
        at = f" ({self.position})" if self.position else ""
        where = (
            f"step {self.step}{at}: {self.micro_batches} micro-batch{'es' if self.micro_batches != 1 else ''}, "
            f"items {list(self.items)}"
        )
        advice = f"; {self.hint}" if self.hint and remedies else ""
        if self.not_finite is not None and not self.full_batch_not_finite:
            inherent = f" (and inherently not equivalent: {'; '.join(self.inherent)})" if self.inherent else ""
            return f"{where}: NOT equivalent, not finite: {self.not_finite}{inherent}"
        if self.inherent:
            return f"{where}: inherently not equivalent, not replayed ({'; '.join(self.inherent)}){advice}"
        if self.full_batch_not_finite:
            return f"{where}: not judged: {self.not_finite}"
        if self.ranks:
            where += f" on rank {self._own_rank()} of {len(self.ranks)}"
        if self.equivalent:
            worst = max((rank.worst_ratio for rank in self.ranks), default=None)
            worst = self.worst.ratio if worst is None and self.worst is not None else worst
            ratio = (
                f" (worst {worst:.2g} of its allowance{' on any rank' if self.ranks else ''})"
                if worst is not None
                else ""
            )
            return f"{where}: equivalent{ratio}" + (f"; note: {self.note}" if self.note else "")
        if not self.mismatches and self.schedule:  # the update is the one its hyperparameters give; they are not
            return f"{where}: NOT equivalent ({self.schedule})"
        witnessed = self._witnessed(remedies)
        if not self.mismatches:  # this rank's step is right, another's is not
            return f"{where}: NOT equivalent ({self._ranks_text()}{witnessed})"
        first = self.mismatches[0]
        magnitude = ""
        if not math.isnan(first.update_ratio) and not math.isnan(first.cosine):
            magnitude = f"; update {first.update_ratio:.4g}x the full-batch one, cosine {first.cosine:.4f}"
        elif first.update_ratio == 0:  # the run did not move it: no cosine to give
            magnitude = "; update 0x the full-batch one (not moved)"
        tail = ""
        if self.usual_micro_batches is not None and self.micro_batches != self.usual_micro_batches:
            tail = f"; a window of {self.micro_batches} where the run's others have {self.usual_micro_batches}"
        furthest = max(self.mismatches, key=lambda row: row.relative_error)
        furthest_text = (
            ""
            if furthest is first
            else f"; furthest off {furthest.label}, by {furthest.relative_error:.3g} of its scale"
        )
        hint = "".join(f"; {part}" for part in (self.schedule, self.hint) if part)
        ranks = f"; {self._ranks_text()}" if self.ranks else ""
        return (
            f"{where}: NOT equivalent ({len(self.mismatches)} tensors past their allowance, first "
            f"{first.label}, off by {first.relative_error:.3g} of its scale{magnitude}{furthest_text}{tail}"
            f"{ranks}{hint}{witnessed})"
        )

    def _witnessed(self, remedies: bool) -> str:
        """The witness's clause, after the trainer's setting it points at (a remedy of the whole run)."""
        if self.witness is None:
            return ""
        setting = f"{self.setting}: " if self.setting and remedies else ""
        return f"; {setting}{self.witness.clause()}"

    def _own_rank(self) -> int:
        return next((rank.rank for rank in self.ranks if rank.mine), 0)

    def _ranks_text(self) -> str:
        """Which ranks are off, and the one furthest off with its tensor."""
        off = [rank for rank in self.ranks if not rank.equivalent]
        if not off:
            return "every rank's step is off the same way" if self.mismatches else "every rank equivalent"
        furthest = max(off, key=lambda rank: rank.relative_error)
        return (
            f"off on rank{'s' if len(off) != 1 else ''} {[rank.rank for rank in off]} of {len(self.ranks)}, "
            f"furthest rank {furthest.rank}: {furthest.furthest}, by {furthest.relative_error:.3g} of its scale"
        )

    def message(self) -> str:
        """The line, and the first mismatch as ``assert_close`` would show it."""
        if not self.mismatches or self.full_batch_not_finite:
            return self.line()
        return self.line() + "\n" + self.mismatches[0].describe(self.micro_batches)


class AuditFailure(AssertionError):
    """An audited window was not equivalent (the audit was asked to stop there, or
    ``assert_ok()`` was called on it); carries the window."""

    def __init__(self, window: WindowAudit) -> None:
        super().__init__(window.message())
        self.window = window


class AuditResult(ResultBase):
    """The result of one audit: every optimizer step counted (:meth:`counts`), each audited window's
    verdict in order (:attr:`windows`).  A :class:`~equiv.results.protocol.Result`: truthy when every
    audited window was equivalent (and at least one was judged); an audit that judged nothing says
    why, and its :meth:`assert_ok` fails unless ``allow_nothing_judged``."""

    KIND = "audit"

    def __init__(self, *, every: int, allow_nothing_judged: bool) -> None:
        #: one optimizer step audited in every ``every``
        self.every = every
        self.allow_nothing_judged = allow_nothing_judged
        #: every audited window's verdict, in order
        self.windows: list[WindowAudit] = []
        #: optimizer steps seen inside the audit
        self.steps = 0
        #: steps a ``torch.amp.GradScaler`` skipped (inf or NaN gradients: no ``optimizer.step()``)
        self.skipped = 0
        #: training-mode forward calls the hooks saw (to say why nothing was judged)
        self.forward_calls = 0

    @property
    def failures(self) -> list[WindowAudit]:
        """The audited windows whose step is not the full-batch one (or is not finite)."""
        return [window for window in self.windows if window.status is Outcome.NOT_EQUIVALENT]

    def counts(self) -> dict[str, int]:
        """Every optimizer step of the audit, counted once: judged (``equivalent``,
        ``not_equivalent``) or not judged (``inherent``: not replayed; ``full_batch_not_finite``;
        ``not_sampled``: between the windows ``every`` audits); ``skipped``: steps a GradScaler
        skipped (no ``optimizer.step()``, so not among the optimizer steps)."""
        statuses = Counter(window.status for window in self.windows)
        return {
            "equivalent": statuses[Outcome.EQUIVALENT],
            "not_equivalent": statuses[Outcome.NOT_EQUIVALENT],
            "inherent": statuses[Outcome.INHERENTLY_NON_EQUIVALENT],
            "full_batch_not_finite": statuses[Outcome.NOT_APPLICABLE],
            "not_sampled": self.steps - len(self.windows),
            "skipped": self.skipped,
        }

    @property
    def judged(self) -> int:
        """Windows judged (equivalent or not)."""
        counts = self.counts()
        return counts["equivalent"] + counts["not_equivalent"]

    def nothing_judged(self) -> str | None:
        """Why no window was judged, in words, or None when one was."""
        if self.judged:
            return None
        if not self.steps:
            if self.skipped:
                return (
                    f"the GradScaler skipped every step ({self.skipped}): the gradients were inf or NaN each "
                    "time, so no optimizer step was taken"
                )
            if self.forward_calls:
                return (
                    f"the model made {self.forward_calls} training-mode forward call"
                    f"{'s' if self.forward_calls != 1 else ''} but optimizer.step() was never called inside "
                    "the audit (is the optimizer the one the loop steps, or does a GradScaler skip every step?)"
                )
            return (
                "no optimizer step was taken inside the audit and the model made no training-mode forward call "
                "(an empty loader, the loop outside the with block, or the model in eval mode?)"
            )
        counts = self.counts()
        if counts["inherent"]:
            advice = next((window.hint for window in self.windows if window.inherent and window.hint), "")
            return f"every audited window is inherently not equivalent (not replayed); {advice}"
        if counts["full_batch_not_finite"]:
            return "the full-batch step of every audited window is not finite (the windows' own data)"
        return f"no window sampled (every {self.every}, {self.steps} steps)"

    def __bool__(self) -> bool:
        """Every audited window equivalent (none inherently not, none failing), and at least one."""
        return bool(self.windows) and all(window.equivalent for window in self.windows)

    @property
    def status(self) -> Outcome:
        """NOT_EQUIVALENT when a window failed, else INHERENTLY_NON_EQUIVALENT when one
        could not be replayed, NOT_APPLICABLE when one was not judged otherwise (none
        audited, a full-batch step not finite), else EQUIVALENT."""
        if self.failures:
            return Outcome.NOT_EQUIVALENT
        if any(window.inherent for window in self.windows):
            return Outcome.INHERENTLY_NON_EQUIVALENT
        return Outcome.EQUIVALENT if self else Outcome.NOT_APPLICABLE

    def assert_ok(self) -> None:
        """Raise unless every audited window was equivalent and one was judged; with
        ``allow_nothing_judged``, an audit that judged nothing and flagged nothing passes."""
        __tracebackhide__ = True
        if self.allow_nothing_judged and not self.judged and not self.failures:
            return
        super().assert_ok()

    def message(self) -> str:
        return self.summary()

    def _counted(self) -> str:
        counts = self.counts()
        not_judged = [
            f"{counts['inherent']} inherently not equivalent (not replayed)" if counts["inherent"] else "",
            f"{counts['full_batch_not_finite']} whose full-batch step is not finite"
            if counts["full_batch_not_finite"]
            else "",
            f"{counts['not_sampled']} not sampled" if counts["not_sampled"] else "",
        ]
        reasons = ", ".join(part for part in not_judged if part)
        text = (
            f"{len(self.windows)} of {self.steps} optimizer steps audited (every {self.every}): {self.judged} "
            f"judged ({counts['equivalent']} equivalent, {counts['not_equivalent']} not equivalent), "
            f"{self.steps - self.judged} not judged" + (f" ({reasons})" if reasons else "")
        )
        if self.skipped:
            text += (
                f"; {self.skipped} step{' was' if self.skipped == 1 else 's were'} skipped by the GradScaler "
                "(inf or NaN gradients, no update: not judged)"
            )
        why = self.nothing_judged()
        return text + (f"; nothing judged: {why}" if why else "")

    def line(self) -> str:
        """One line: the outcome, every step counted, why nothing was judged, the first that failed."""
        first = self.failures[0].line() if self.failures else None
        return headed(self.status, self._counted() + (f"; first: {first}" if first else ""))

    def _failure(self) -> AssertionError:
        return AuditFailure(self.failures[0]) if self.failures else super()._failure()

    def _fields(self) -> dict[str, Any]:
        counts = self.counts()
        return {
            "steps": self.steps,
            "every": self.every,
            "audited": len(self.windows),
            "failures": len(self.failures),
            "judged": self.judged,
            "inherent": counts["inherent"],
            "full_batch_not_finite": counts["full_batch_not_finite"],
            "not_sampled": counts["not_sampled"],
            "skipped": self.skipped,
            "nothing_judged": self.nothing_judged(),
            "windows": [window.to_dict() for window in self.windows],
        }

    def remedies(self) -> list[str]:
        """What applies to the whole run, each said once: a not-replayed window's remedy (turn dropout off),
        the trainer's setting the witness points at."""
        said = [window.hint for window in self.windows if window.inherent and window.hint]
        said += [window.setting for window in self.windows if window.setting]
        return list(dict.fromkeys(said))

    def summary(self) -> str:
        """Every step counted, then every audited window, one line each, then what applies to the whole
        run, once (not on every window's line)."""
        counted = self._counted()  # says the remedy itself when no window was judged
        return "\n".join(
            [
                f"equiv audit: {counted}",
                *(f"  {window.line(remedies=False)}" for window in self.windows),
                *(f"  for the whole run: {remedy}" for remedy in self.remedies() if remedy not in counted),
            ]
        )

    def write_jsonl(self, path: str | Path) -> Path:
        """Write each audited window's ``to_dict()`` (the schema's ``window_audit``) as one JSON line
        of ``path`` (replaced); returns the path.  :func:`equiv.auditing.writers.jsonl_writer` appends
        them as they come."""
        path = Path(path)
        with path.open("w", encoding="utf-8") as out:
            for window in self.windows:
                out.write(json.dumps(window.to_dict()) + "\n")
        return path

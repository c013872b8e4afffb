"""The result of a check: per-tensor differences and a readable verdict.

Messages follow ``torch.testing.assert_close``: which step, which tensor, which
tier, the greatest difference and where, what was allowed (and why), and the
case that reproduces it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, TypeVar

from equiv.cases.case import Case
from equiv.outcomes import Fault, Outcome, outcome_words
from equiv.results.protocol import EquivalenceError, ResultBase, headed
from equiv.results.witness import Witness

__all__ = ["CaseVerdicts", "EquivalenceError", "FailureKind", "Judgement", "PrecisionFinding", "TensorDiff", "Verdict"]

Tier = Literal["exact", "noise"]
#: Relative errors this close are one tie (ten times the largest move of a
#: mathematical bug's exact-tier difference measured between CPU kernel sets).
_SAME_RELATIVE_ERROR = 1e-4


class Judgement(ResultBase):
    """What every verdict on one case shares (one process, or one per rank): a
    :class:`~equiv.results.protocol.Result` (truthy only when equivalent,
    :meth:`message`, :meth:`assert_ok`) that is also one row of several cases
    (:meth:`row`, what ``equiv check`` prints per case)."""

    __slots__ = ()

    def __bool__(self) -> bool:
        raise NotImplementedError

    @property
    def status(self) -> Outcome:
        raise NotImplementedError

    def note(self) -> str | None:
        """The precision note of a passing verdict (float32-sized differences inside the float64 run), or None."""
        raise NotImplementedError

    def reasons(self) -> tuple[str, ...]:
        """Why the case is neither a pass nor a failure (not applicable, inherently non-equivalent)."""
        raise NotImplementedError

    def row(self, name: str) -> str:
        """The case ``name``'s outcome as ``equiv check`` prints it (failures with the whole message)."""
        status = self.status
        if status is Outcome.EQUIVALENT:
            return f"ok    {name}" + (" (with a precision note, below)" if self.note() is not None else "")
        if status is Outcome.NOT_APPLICABLE:
            return f"n/a   {name}: {'; '.join(self.reasons())}"
        if status is Outcome.INHERENTLY_NON_EQUIVALENT:
            return f"inh.  {name}: {'; '.join(self.reasons())}"
        return f"FAIL  {name}\n" + "\n".join("      " + line for line in self.message().splitlines())


#: An update this close to the full batch's direction, and to a whole multiple
#: (or fraction) of its size, is named as that multiple.  Stepping twice with the
#: same gradient, or summing k micro-batch means, is exact to rounding under SGD
#: and Adam alike; a mean of uneven means is not a whole multiple.
_SAME_DIRECTION = 0.9999
_WHOLE = 0.005
_LARGEST_MULTIPLE = 64


def _multiple_causes(ratio: float, cosine: float, micro_batches: int | None) -> list[str]:
    """A "Likely:" line when the update is k x or 1/k of the full batch's, in its direction."""
    if not cosine > _SAME_DIRECTION or not ratio > 0:
        return []
    window = f" (this window has {micro_batches} micro-batches)" if micro_batches else ""
    for k in range(2, _LARGEST_MULTIPLE + 1):
        if abs(ratio - k) <= _WHOLE * k:
            summed = (
                f"the loss summed over the window's {k} micro-batches and never divided by {k}"
                if k == micro_batches
                else f"the loss counted {k} times (summed and not divided by {k})"
            )
            return [
                f"Likely: {k} x the full-batch update in its direction: optimizer.step() called {k} times "
                f"in the window, or {summed}{window}"
            ]
        if abs(ratio - 1 / k) <= _WHOLE / k:
            again = (
                f"the window's micro-batch count: a mean loss divided by {k} again"
                if k == micro_batches
                else f"a loss or gradient divided by {k} once too often"
            )
            return [f"Likely: 1/{k} of the full-batch update in its direction: {again}{window}"]
    return []


@dataclass(frozen=True, slots=True)
class TensorDiff:
    """One tensor at one step in one tier, against the float64 truth."""

    step: int  # 1-based: after the step-th optimizer step
    name: str
    #: what the tensor holds: a parameter's "update", a "buffer", or optimizer "state"
    quantity: Literal["update", "buffer", "state"]
    tier: Tier
    dtype: str
    max_abs_diff: float
    index: tuple[int, ...]
    max_rel_diff: float
    rel_index: tuple[int, ...]
    allowed: float
    explanation: str
    mismatched: int
    numel: int
    #: The magnitude the allowance is measured against: the tensor's own (for an
    #: update at least the largest update anywhere in the model).
    scale: float = 0.0
    # Diagnoses, on the rows a verdict shows (NaN / empty elsewhere):
    #: the full-batch value and the candidate's where the difference is greatest (at ``index``)
    expected: float = math.nan
    actual: float = math.nan
    #: elements of the candidate that are NaN, or infinite, and where the first one is
    nan_count: int = 0
    inf_count: int = 0
    first_not_finite: tuple[int, ...] = ()
    #: an update's size along the full batch's, <c, t> / <t, t> (1: the same; 0: no update), and its cosine
    update_ratio: float = math.nan
    cosine: float = math.nan

    @property
    def ratio(self) -> float:
        """Greatest difference over what was allowed (> 1 is a mismatch)."""
        if self.allowed > 0:
            return self.max_abs_diff / self.allowed
        return 0.0 if self.max_abs_diff == 0 else math.inf

    @property
    def relative_error(self) -> float:
        """Greatest difference over the tensor's scale: how far off the tensor is.

        Unlike :attr:`ratio` (whose allowance is sized by rounding noise, and so
        moves with the CPU's kernels), in the exact tier this is the size of a
        mathematical difference, the same on every machine to many digits."""
        if self.scale > 0:
            return self.max_abs_diff / self.scale
        return 0.0 if self.max_abs_diff == 0 else math.inf

    @property
    def ok(self) -> bool:
        # The greatest difference within the allowance (NaN counts as infinite
        # before it gets here): the same as "no element past it", and known
        # from the one maximum a comparison always computes.  A difference that
        # is not finite is never within one, even an allowance that is not
        # finite either (a NaN or inf truth's scale): a NaN run is never "ok".
        return math.isfinite(self.max_abs_diff) and self.max_abs_diff <= self.allowed

    @property
    def kind(self) -> Literal["update", "buffer", "state"]:
        """The same as :attr:`quantity`; kept for code written before it."""
        return self.quantity

    @property
    def label(self) -> str:
        what = {"update": "the update of", "buffer": "the buffer", "state": "the optimizer state"}[self.quantity]
        return f"{what} '{self.name}'"

    def describe(self, micro_batches: int | None = None) -> str:
        """The mismatch as ``assert_close`` would show it, with :meth:`diagnoses`
        (``micro_batches``: the window's count, when known, to name a multiple of it)."""
        share = 100.0 * self.mismatched / max(self.numel, 1)
        index = self.index if self.index else "()"
        lines = [f"Mismatched elements: {self.mismatched} / {self.numel} ({share:.1f}%) in {self.label}"]
        lines += self.diagnoses(micro_batches)
        lines += [
            f"Greatest absolute difference: {self.max_abs_diff:.4g} at index {index} (up to {self.allowed:.4g} allowed)",
            f"Greatest relative difference: {self.max_rel_diff:.4g} at index {self.rel_index or '()'}",
            f"Allowed = {self.explanation}",
        ]
        return "\n".join(lines)

    def diagnoses(self, micro_batches: int | None = None) -> list[str]:
        """What the numbers mean, in words: NaN / inf named, a missing update, an
        update's size and direction against the full batch's (a whole multiple or
        fraction of it named with its likely causes), the worst element."""
        out = []
        if self.nan_count or self.inf_count:
            found = " and ".join(f"{n} {what}" for n, what in ((self.nan_count, "NaN"), (self.inf_count, "inf")) if n)
            out.append(
                f"Not finite: {found} in {self.label} of the candidate, the first at index "
                f"{self.first_not_finite or '()'}"
            )
        elif not math.isnan(self.expected):
            what = {"update": "update", "buffer": "change", "state": "value"}[self.quantity]
            out.append(
                f"At index {self.index or '()'}: full-batch {what} {self.expected:.6g}, "
                f"the candidate's {self.actual:.6g}"
            )
        if self.quantity == "update" and not (self.nan_count or self.inf_count) and not math.isnan(self.update_ratio):
            if self.update_ratio == 0 and math.isnan(self.cosine):
                out.append(
                    "No update: the candidate did not move this parameter (is optimizer.step() called, "
                    "and is the parameter still the optimizer's?)"
                )
            elif not math.isnan(self.cosine):
                out.append(
                    f"The update is {self.update_ratio:.4g} x the full-batch update along it, cosine {self.cosine:.4f}"
                )
                out += _multiple_causes(self.update_ratio, self.cosine, micro_batches)
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "name": self.name,
            "kind": self.quantity,
            "tier": self.tier,
            "dtype": self.dtype,
            "max_abs_diff": self.max_abs_diff,
            "index": list(self.index),
            "max_rel_diff": self.max_rel_diff,
            "allowed": self.allowed,
            "ratio": self.ratio,
            "scale": self.scale,
            "mismatched": self.mismatched,
            "numel": self.numel,
        }


#: Why a float64 run's differences are float32-sized (see :class:`PrecisionFinding`).
PrecisionCause = Literal["default_dtype", "float32_sized", "bfloat16_arithmetic"]


@dataclass(frozen=True, slots=True)
class PrecisionFinding:
    """The only differences are float32-sized, inside a float64 run, and every run in a
    lower precision matched: mathematically the full-batch step as far as float32,
    bfloat16 or float16 training can tell.  Whether that fails depends on the precision
    the user trains in (:func:`equiv.check`'s ``train_dtype`` and ``strict``)."""

    #: "default_dtype": a tensor made without a dtype is float32 (torch's default):
    #: with the default set to float64 the step matches.  "float32_sized": the
    #: default dtype is not why: float32 written into the step (``dtype=torch.float32``,
    #: ``.float()``), or a difference smaller than float32 rounding can show.
    cause: PrecisionCause
    #: Why it fails ("you train in float64", "strict precision"), or "" when it passes.
    fails_because: str = ""
    #: "bfloat16_arithmetic": bfloat16 (or float16) computed inside the step, an accumulation buffer:
    #: with it lifted to the run's dtype the step matches.  Bfloat16-sized differences in the float32
    #: and float64 runs.  ``resolves``: per dtype judged, the smallest relative difference the check
    #: resolves there (its smallest allowance relative to the tensor's scale), smallest first.
    resolves: tuple[tuple[str, float], ...] = ()

    @property
    def fails(self) -> bool:
        return bool(self.fails_because)

    def describe(self, largest: TensorDiff) -> str:
        """What, where, how large, why, and when it would matter."""
        where = f"{largest.label} at step {largest.step}"
        if self.cause == "bfloat16_arithmetic":
            return self._describe_low_precision(largest, where)
        size = (
            f"up to {largest.relative_error:.2g} of its scale ({where}); float32 rounds at {FLOAT32_UNIT_ROUNDOFF:.2g}"
        )
        if self.cause == "default_dtype":
            why = (
                "a tensor made without a dtype is float32, torch's default (e.g. torch.zeros(1), "
                "torch.tensor(1 / n), 1.0 / a tensor of counts): with the default dtype set to float64 the "
                "step matches the full batch"
            )
        else:
            why = (
                "not torch's default dtype (setting it to float64 leaves the difference): float32 arithmetic "
                "written into the step (dtype=torch.float32, .float()), or a difference smaller than float32 "
                "rounding can show"
            )
        if self.fails:
            effect = f"it fails because {self.fails_because}: in float64 training this costs that much precision"
        else:
            effect = (
                "harmless in float32, bfloat16 or float16 training, where the same step matched; it costs "
                "precision only in float64 training (equiv check --train-dtype float64, or --strict-precision, "
                "fails it)"
            )
        return f"float32-sized differences inside the float64 run, {size}. Cause: {why}. Effect: {effect}."

    def _describe_low_precision(self, largest: TensorDiff, where: str) -> str:
        resolved = ", ".join(f"{relative:.2g} in {dtype}" for dtype, relative in self.resolves)
        sensitivity = f" The check resolves relative differences down to {resolved}." if resolved else ""
        effect = (
            f"it fails because {self.fails_because}"
            if self.fails
            else "harmless in bfloat16 or float16 training, whose own rounding is this size; it costs precision "
            "with float32 master weights and gradients (equiv check --train-dtype float32 fails it)"
        )
        return (
            f"bfloat16-sized differences in the float32 and float64 runs, up to {largest.relative_error:.2g} of "
            f"its scale ({where}); bfloat16 rounds at {BFLOAT16_UNIT_ROUNDOFF:.2g}, float32 at "
            f"{FLOAT32_UNIT_ROUNDOFF:.2g}. Cause: bfloat16 or float16 arithmetic inside the step (an "
            f"accumulation buffer in bfloat16, or a gradient all-reduce compressed to it): with it lifted to the "
            f"run's dtype the step matches the full batch.{sensitivity} Effect: {effect}."
        )


@dataclass(frozen=True, slots=True)
class FailureKind:
    """What kind of failure a mathematical mismatch is: the known wrong step it
    amounts to (:mod:`equiv.checking.failure_kinds`: "mean of means", "sum without
    division", ...), or "unclassified" with why none fits (never the nearest guess)."""

    #: the kind's name, or "unclassified"
    name: str
    #: what it means (with the upstream reports it matches), or why no kind fits
    means: str
    #: other kinds whose steps make the same updates on this case (the case cannot tell them apart)
    also: tuple[str, ...] = ()

    #: The name of a mismatch no known kind reproduces.
    UNCLASSIFIED = "unclassified"

    @classmethod
    def unclassified(cls, why: str) -> FailureKind:
        """No known kind fits: ``why`` says what was tried, or what the difference is instead."""
        return cls(cls.UNCLASSIFIED, why)

    @property
    def classified(self) -> bool:
        return self.name != self.UNCLASSIFIED

    def describe(self) -> str:
        """One line: the name and what it means."""
        if not self.classified:
            return f"unclassified ({self.means})"
        also = (
            f" (or {' or '.join(self.also)}: the same updates on this case, which cannot tell them apart)"
            if self.also
            else ""
        )
        return f"{self.name}{also}: {self.means}"

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "means": self.means, "also": list(self.also)}


#: float32's unit roundoff: the size of one float32 rounding, relative.
FLOAT32_UNIT_ROUNDOFF = 2.0**-24
#: bfloat16's (8 significant bits).
BFLOAT16_UNIT_ROUNDOFF = 2.0**-8


@dataclass(frozen=True, slots=True)
class Verdict(Judgement):
    """Truthy only when the candidate is equivalent to full-batch training."""

    KIND = "verdict"

    case: Case
    candidate: str
    #: Every tensor that exceeded its allowance, in step order.
    mismatches: tuple[TensorDiff, ...]
    #: Per tier, the tensor that came closest to (or furthest past) its allowance.
    worst: dict[str, TensorDiff] = field(default_factory=dict)
    #: Why this case cannot be equivalent however it is accumulated (BatchNorm, dropout).
    inherent: tuple[str, ...] = ()
    #: Why the case does not apply to the candidate (it needs a keyword the
    #: candidate does not take); nothing was run.  Neither a pass nor a failure.
    not_applicable: tuple[str, ...] = ()
    #: The mismatches are float32-sized, inside float64 runs only (see equiv.check):
    #: a precision note (passing) or, for float64 training or strict precision, a failure.
    precision: PrecisionFinding | None = None
    #: What the step did to the model besides training it (a parameter replaced, a dtype changed).
    notes: tuple[str, ...] = ()
    #: The kind of a mathematical mismatch (mean of means, ... or unclassified), named by
    #: :func:`equiv.check`; None for a verdict that is not one (or made without its details).
    failure_kind: FailureKind | None = None
    #: The weight the step gave each micro-batch's loss at its first failing step, named (issue 44), read by
    #: :func:`equiv.check` after a mathematical mismatch; None for a verdict that is not one (or made without
    #: its details, or a step that never stepped its optimizer there).
    witness: Witness | None = None

    @property
    def status(self) -> Outcome:
        """EQUIVALENT, NOT_EQUIVALENT, INHERENTLY_NON_EQUIVALENT or NOT_APPLICABLE."""
        if self.not_applicable:
            return Outcome.NOT_APPLICABLE
        if self.inherent:
            return Outcome.INHERENTLY_NON_EQUIVALENT
        if not self.mismatches or (self.precision is not None and not self.precision.fails):
            return Outcome.EQUIVALENT
        return Outcome.NOT_EQUIVALENT

    @property
    def outcome(self) -> Outcome:
        """What kind of result: the status, with a failing precision finding told
        apart from a mathematical mismatch (PRECISION)."""
        if self.status is Outcome.NOT_EQUIVALENT and self.precision is not None:
            return Outcome.PRECISION
        return self.status

    @property
    def kind(self) -> Outcome:
        """The same as :attr:`outcome`; kept for code written before it."""
        return self.outcome

    @property
    def precision_only(self) -> bool:
        """The differences are float32-sized inside float64 runs only (passing or not)."""
        return self.precision is not None

    @property
    def precision_note(self) -> str | None:
        """The precision finding in words (what, where, how large, why, when it matters), or None."""
        if self.precision is None or not self.mismatches:
            return None
        largest = max(self.mismatches, key=lambda d: d.relative_error)
        return self.precision.describe(largest)

    def __bool__(self) -> bool:
        return self.status is Outcome.EQUIVALENT

    @property
    def first_mismatch(self) -> TensorDiff | None:
        """The earliest step's mismatch furthest off (updates before optimizer state).

        Among a step's mismatches: a parameter update before state before
        buffers (what users act on first), the exact tier first, then the
        greatest :attr:`~TensorDiff.relative_error`, not the greatest ratio: the
        allowance is rounding noise that moves with the CPU's kernels, so two
        tensors far past it can swap places by ratio from one machine to the
        next, while their relative errors are the mathematics of the bug."""
        if not self.mismatches:
            return None
        first_step = min(d.step for d in self.mismatches)
        quantity_rank = {"update": 2, "state": 1, "buffer": 0}
        at_step = [d for d in self.mismatches if d.step == first_step]
        rank = max((quantity_rank[d.quantity], d.tier == "exact") for d in at_step)
        ranked = [d for d in at_step if (quantity_rank[d.quantity], d.tier == "exact") == rank]
        # Tensors the bug moves by the same relative amount (weight decay applied
        # to a frozen layer's weight and bias: lr x decay each) tie up to rounding:
        # the first in the model's order wins, not whichever rounded up here.
        furthest = max(d.relative_error for d in ranked)
        return next(d for d in ranked if d.relative_error >= furthest * (1 - _SAME_RELATIVE_ERROR))

    def diverged_tiers(self) -> list[str]:
        return sorted({d.tier for d in self.mismatches})

    def message(self) -> str:
        head = f"candidate {self.candidate}"
        lines: list[str] = []
        if self.not_applicable:
            lines.append(f"Not applicable ({head}): the case and the step's keywords do not fit:")
            lines += [f"  - {reason}" for reason in self.not_applicable]
            lines.append(f"Reproduce: equiv.check({self.candidate}, equiv.{self.case!r})")
            return "\n".join(lines)
        if self.inherent:
            lines.append(f"Inherently not equivalent to full-batch training ({head}):")
            lines += [f"  - {reason}" for reason in self.inherent]
        first = self.first_mismatch
        if first is not None and self.status is Outcome.EQUIVALENT:  # a passing precision finding
            lines.append(
                f"Equivalent to full-batch training ({head}) in float32 and lower precision, with a precision note."
            )
            lines.append(f"Precision note: {self.precision_note}")
            lines += [f"Note: {note}" for note in self.notes]
        elif first is None:
            if not self.inherent:
                lines.append(f"Equivalent to full-batch training ({head}) in every step and tier.")
        else:
            if self.precision is not None and not self.inherent:
                lines.append(f"Precision ({head}): {self.precision_note}")
            elif not self.inherent:
                lines.append(f"Not equivalent to full-batch training ({head}).")
                if self.failure_kind is not None:
                    lines.append(f"Kind of failure: {self.failure_kind.describe()}")
                if self.witness is not None:
                    lines.append(f"What the loop did: {self.witness.clause()}")
            lines += [f"Note: {note}" for note in self.notes]  # what the step did besides training
            lines.append(f"Diverged at step {first.step} of {self.case.steps}, {first.tier} tier ({first.dtype}):")
            lines.append(first.describe(len(self.case.micro_batch_sizes)))
            lines += self._step_count_diagnosis(first.step)
            quantity_order = {"update": 0, "state": 1, "buffer": 2}
            others = sorted(
                {(quantity_order[d.quantity], d.label, d.tier) for d in self.mismatches if d.step == first.step}
                - {(quantity_order[first.quantity], first.label, first.tier)}
            )
            if others:
                shown = ", ".join(f"{label} [{tier}]" for _, label, tier in others[:4])
                more = f" (+{len(others) - 4} more)" if len(others) > 4 else ""
                lines.append(f"Also mismatched at step {first.step}: {shown}{more}")
        for tier, worst in sorted(self.worst.items()):
            lines.append(
                f"Tier {tier} ({worst.dtype}): worst {worst.ratio:.3g} x allowed, {worst.label} at step {worst.step}"
            )
        lines.append(f"Reproduce: equiv.check({self.candidate}, equiv.{self.case!r}{self._precision_flags()})")
        return "\n".join(lines)

    def _precision_flags(self) -> str:
        """The keywords that make a failing precision finding fail again when replayed."""
        if self.precision is None or not self.precision.fails:
            return ""
        if "strict" in self.precision.fails_because:
            return ", strict=True"
        # A bfloat16-sized finding fails float32 training, the default: no flag makes it fail again.
        return "" if self.precision.cause == "bfloat16_arithmetic" else ", train_dtype='float64'"

    def _step_count_diagnosis(self, step: int) -> list[str]:
        """An optimizer's own step counter (Adam's ``step`` state) says outright how
        many times ``optimizer.step()`` ran: named when it differs from the full batch's."""
        for diff in self.mismatches:
            counted_twice = (
                diff.step == step
                and diff.quantity == "state"
                and diff.name.endswith(":step")
                and diff.expected > 0
                and diff.actual != diff.expected
            )
            if counted_twice:
                return [
                    f"Optimizer steps counted ({diff.name}): the candidate's {diff.actual:g}, the full batch's "
                    f"{diff.expected:g} after step {step}: optimizer.step() runs "
                    f"{diff.actual / diff.expected:g} x per window"
                ]
        return []

    def note(self) -> str | None:
        return self.precision_note if self.status is Outcome.EQUIVALENT else None

    def reasons(self) -> tuple[str, ...]:
        return self.not_applicable or self.inherent

    def line(self) -> str:
        """One line: the outcome, the candidate, the case, and how far off (or how close) it came."""
        return headed(self.outcome, f"{self.candidate} on {self.case!r}{self.detail()}")

    def detail(self) -> str:
        """What :meth:`line` says after the case: the reasons, the worst ratio, or the first mismatch."""
        if self.reasons():
            return f": {'; '.join(self.reasons())}"
        first = self.first_mismatch
        if first is None or self.status is Outcome.EQUIVALENT:
            worst = max(self.worst.values(), key=lambda d: d.ratio, default=None)
            ratio = "" if worst is None else f", worst {worst.ratio:.2g} of its allowance"
            return ratio + (", with a precision note" if self.note() else "")
        witnessed = "" if self.witness is None else f"; {self.witness.clause()}"
        return (
            f": {first.label} at step {first.step} of {self.case.steps}, {first.tier} tier ({first.dtype}), off by "
            f"{first.relative_error:.3g} of its scale ({first.ratio:.3g} x allowed; {len(self.mismatches)} "
            f"tensor(s) past their allowance){witnessed}"
        )

    def _fields(self) -> dict[str, Any]:
        return {
            "candidate": self.candidate,
            "case": self.case.to_dict(),
            "outcome": self.outcome.value,
            "inherent": list(self.inherent),
            "not_applicable": list(self.not_applicable),
            "mismatches": [d.to_dict() for d in self.mismatches],
            "worst": {tier: d.to_dict() for tier, d in sorted(self.worst.items())},
            "precision": None
            if self.precision is None
            else {
                "cause": self.precision.cause,
                "fails_because": self.precision.fails_because,
                "note": self.precision_note,
            },
            "failure_kind": None if self.failure_kind is None else self.failure_kind.to_dict(),
            # only where a witness was read: a passing verdict's JSON is unchanged
            **({} if self.witness is None else {"weights": self.witness.to_dict()}),
        }


#: The verdict of one case on one process, or on every rank (see :class:`CaseVerdicts`).
V = TypeVar("V", bound=Judgement)


@dataclass(frozen=True, slots=True)
class CaseVerdicts(ResultBase, Generic[V]):
    """One candidate on several named cases (``equiv.check(step)`` runs the standard
    cases, ``equiv check-distributed`` the standard splits): truthy when no case that
    applies failed and the step never raised.  A case not applicable to the step, or
    inherently non-equivalent, is neither a pass nor a failure: it is counted apart, and
    so is each case with no verdict, by why (the step raised, hung, a rank died, the
    collectives did not line up, or the case was never run after such a fault): a case
    without a verdict is never tallied as "not equivalent"."""

    KIND = "case_verdicts"

    candidate: str
    #: case name -> its verdict, in the order the cases were checked
    verdicts: dict[str, V]
    #: case name -> what the candidate raised on it (no verdict then)
    errors: dict[str, str] = field(default_factory=dict)
    #: every case name, in the order checked (verdicts and errors interleaved)
    order: tuple[str, ...] = ()
    #: case name -> the step's own traceback, where it raised
    tracebacks: dict[str, str] = field(default_factory=dict)
    #: where the cases ran, said after the count ("on 2 ranks (ddp)"; "": one process)
    setting: str = ""
    #: case name -> how the step failed there, for each case in ``errors`` (absent: it raised)
    faults: dict[str, Fault] = field(default_factory=dict)
    #: case name -> why it was never run (after a hang or a rank's fault the rest are not)
    not_run: dict[str, str] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return self.status is Outcome.EQUIVALENT

    @property
    def status(self) -> Outcome:
        """NOT_EQUIVALENT when an applicable case failed (a definite answer wins), else
        STEP_ERROR when the step raised or hung on one (or a case was not run), else EQUIVALENT."""
        if self.failed:
            return Outcome.NOT_EQUIVALENT
        return Outcome.STEP_ERROR if self.errors or self.not_run else Outcome.EQUIVALENT

    @property
    def failed(self) -> dict[str, V]:
        """The applicable cases that are not equivalent."""
        return {name: v for name, v in self.verdicts.items() if v.status is Outcome.NOT_EQUIVALENT}

    @property
    def names(self) -> tuple[str, ...]:
        """Every case name, in the order checked."""
        return self.order or (*self.verdicts, *self.errors, *self.not_run)

    def fault(self, name: str) -> Fault:
        """How the step failed on the case ``name`` (one of :attr:`errors`)."""
        return self.faults.get(name, Fault.RAISED)

    def counts(self) -> dict[str, int]:
        """How many cases ended each way, by label: "equivalent" and "not equivalent" (always,
        zeros included), "not applicable", "inherently non-equivalent", then the cases with no
        verdict by why: "raised", "hung", "died", "collective mismatch", "not run"."""
        verdict_labels = [
            Outcome.EQUIVALENT,
            Outcome.NOT_EQUIVALENT,
            Outcome.NOT_APPLICABLE,
            Outcome.INHERENTLY_NON_EQUIVALENT,
        ]
        counts = {outcome.label: 0 for outcome in verdict_labels}
        for verdict in self.verdicts.values():
            counts[verdict.status.label] += 1
        for fault in Fault:
            counts[_fault_label(fault)] = sum(self.fault(name) is fault for name in self.errors)
        counts[_NOT_RUN] = len(self.not_run)
        return counts

    def row(self, name: str) -> str:
        """One case's outcome as ``equiv check`` prints it (failures with the whole message)."""
        if name in self.errors:
            return f"ERROR {name}: {self.errors[name]}"
        if name in self.not_run:
            return f"--    {name}: not run: {self.not_run[name]}"
        return self.verdicts[name].row(name)

    def summary(self) -> str:
        counts = self.counts()
        always = (Outcome.EQUIVALENT.label, Outcome.NOT_EQUIVALENT.label)
        shown = ", ".join(f"{n} {label}" for label, n in counts.items() if n or label in always)
        text = f"{shown}, of {len(self.names)} case(s)" + (f" {self.setting}" if self.setting else "")
        noted = [name for name, v in self.verdicts.items() if v.note()]
        if noted:
            # One note for all: the same cause shows on every case it touches.
            text += (
                f"\nPrecision note ({len(noted)} equivalent case(s), e.g. {noted[0]!r}): "
                f"{self.verdicts[noted[0]].note()}"
            )
        return text

    def message(self) -> str:
        return "\n".join([f"candidate {self.candidate}:", *(self.row(name) for name in self.names), self.summary()])

    def line(self) -> str:
        """One line: the outcome, the candidate, the counts, and the first case that failed."""
        counts = ", ".join(f"{n} {label}" for label, n in self.counts().items() if n)
        first = next(iter(self.failed), None) or next(iter(self.errors), None)
        failing = f"; first: {first!r}" if first is not None else ""
        setting = f" {self.setting}" if self.setting else ""
        return headed(self.status, f"{self.candidate} on {len(self.names)} case(s){setting} ({counts}){failing}")

    def _fields(self) -> dict[str, Any]:
        return {
            "candidate": self.candidate,
            "setting": self.setting,
            "counts": self.counts(),
            "cases": [self._case_dict(name) for name in self.names],
        }

    def _case_dict(self, name: str) -> dict[str, Any]:
        """One case's JSON: its verdict's, or (no verdict) why, with ``fault`` or ``not_run``."""
        if name in self.errors:
            return {
                "case_name": name,
                "status": Outcome.STEP_ERROR.value,
                "error": self.errors[name],
                "fault": self.fault(name).value,
                "traceback": self.tracebacks.get(name),
            }
        if name in self.not_run:
            return {
                "case_name": name,
                "status": Outcome.STEP_ERROR.value,
                "error": f"not run: {self.not_run[name]}",
                "not_run": True,
            }
        return {"case_name": name, **self.verdicts[name].to_dict()}


#: How :meth:`CaseVerdicts.counts` names cases never run.
_NOT_RUN = "not run"


def _fault_label(fault: Fault) -> str:
    """A fault as a count's label: "raised", "collective mismatch"."""
    return outcome_words(fault)

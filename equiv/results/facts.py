"""What of a verdict holds on every machine, and how its noisy numbers are shown.

A verdict's exact numbers are rounding noise.  torch picks its CPU kernels by
the processor (``torch.backends.cpu.get_cpu_capability()``: DEFAULT, AVX2,
AVX512; other kernels again on arm64), and each rounds sums in its own order.
Measured on the standard cases x the bug zoo, DEFAULT against AVX2 kernels
(``ATEN_CPU_CAPABILITY``): the worst difference / allowed of a passing case
moved up to 2.3x (0.058 vs 0.131), a failing one up to 1.6x, because the
allowance is sized by the run's own rounding error; in the exact tier, a
failing tensor's difference moved at most 5e-4 relative (a bfloat16 buffer
whose roundings flip), mathematical bugs' at most 4e-5.  So a digit of a
ratio or a message hash pinned on one machine fails on the next.

What is the same everywhere, and what :class:`VerdictFacts` holds:

- the status and class (equivalent, not equivalent, precision, inherently
  non-equivalent, not applicable);
- per tier, whether the worst tensor is within its allowance or past it
  (:func:`ratio_band`: the only edge is the allowance itself, and passing
  cases sit at 0.005-0.44 of it, failing ones at 20 and more);
- for a failing verdict its first divergence: step, tier, tensor (chosen by
  relative error, see :attr:`~equiv.results.verdict.Verdict.first_mismatch`),
  and its relative error as an order of magnitude (:func:`magnitude`: a decade
  is 4000x wider than the largest move measured);
- whether it is a precision finding and why (``default_dtype``: it matches with
  torch's default dtype set to float64, a yes/no; ``float32_sized``: every
  float64-run difference within the float32 tier's roundoff term, a
  mathematical quantity, stable to the 4e-5 above; on the committed data the
  closest is 17% from that edge).

Reports show these, tests pin these; the digits stay in the messages a user
reads on their own machine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from equiv.outcomes import Outcome
from equiv.results.verdict import TensorDiff, Verdict

__all__ = ["Divergence", "VerdictFacts", "magnitude", "ratio_band"]

#: The two bands of a difference over its allowance: the verdict's own edge.
WITHIN, PAST = "≤ 1", "> 1"


def ratio_band(ratio: float) -> str:
    """A difference over its allowance, as the band that holds on every machine:
    "≤ 1" (within the allowance) or "> 1" (past it).

    No finer band is stable: a correct step's ratio is its rounding error over
    32 times the full-batch run's, two noise figures whose quotient moves ~2x
    with the kernels, so any edge between 0.005 and 0.5 is crossed by some case.
    """
    return WITHIN if ratio <= 1 else PAST


def magnitude(value: float) -> str:
    """A non-negative number as its order of magnitude: "~1e-01" for 0.29,
    "~1e+00" for 0.6 (the nearest power of ten in log scale), "0", "inf"."""
    if value == 0:
        return "0"
    if not math.isfinite(value):
        return "inf"
    return f"~1e{round(math.log10(value)):+03d}"


@dataclass(frozen=True, slots=True)
class Divergence:
    """Where a failing verdict first left the full-batch step, in stable terms."""

    step: int
    tier: str
    #: e.g. "the update of '4.bias'"
    label: str
    #: the tensor's greatest difference over its scale, as an order of magnitude
    relative_error: str

    @classmethod
    def of(cls, diff: TensorDiff) -> Divergence:
        return cls(step=diff.step, tier=diff.tier, label=diff.label, relative_error=magnitude(diff.relative_error))

    def describe(self) -> str:
        return f"step {self.step}, {self.tier}, {self.label}, off by {self.relative_error} of its scale"

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "tier": self.tier, "label": self.label, "relative_error": self.relative_error}


@dataclass(frozen=True, slots=True)
class VerdictFacts:
    """The part of a :class:`~equiv.results.verdict.Verdict` that every CPU,
    GPU and thread count agrees on (module docstring): what to pin and report."""

    status: Outcome
    #: the status, with "precision" told apart from a mathematical mismatch
    outcome: Outcome
    #: tier -> :func:`ratio_band` of its worst tensor
    tiers: dict[str, str]
    first_divergence: Divergence | None
    #: why the differences are a precision finding ("default_dtype", "float32_sized"), or None
    precision: str | None = None

    @property
    def kind(self) -> Outcome:
        """The same as :attr:`outcome`; kept for code written before it."""
        return self.outcome

    @classmethod
    def of(cls, verdict: Verdict) -> VerdictFacts:
        first = verdict.first_mismatch
        return cls(
            status=verdict.status,
            outcome=verdict.outcome,
            tiers={tier: ratio_band(diff.ratio) for tier, diff in sorted(verdict.worst.items())},
            first_divergence=None if first is None else Divergence.of(first),
            precision=None if verdict.precision is None else verdict.precision.cause,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "kind": self.outcome,
            "tiers": dict(self.tiers),
            "first_divergence": None if self.first_divergence is None else self.first_divergence.to_dict(),
            "precision": self.precision,
        }

"""How much difference is allowed: derived from the run itself, not guessed.

For one tensor after ``k`` optimizer steps, with ``truth`` the float64
full-batch run::

    allowed = FLOOR_FACTOR * floor  +  ROUNDOFF_UNITS_PER_STEP * k * u(dtype) * scale

- ``floor``: how far the full-batch reference itself lands from the truth when
  computed in the tier's dtype, the largest of three samples or more
  (noise-floor tier: the full-batch run in the working dtype, batch in order
  and shuffled twice; exact tier: those float32 runs' errors scaled by
  u(float64)/u(float32), and the float64 run on a shuffled batch).  A correct accumulation is another
  rounding order of the same sums, so it lands at a comparable distance.
- ``FLOOR_FACTOR``: at one element, the candidate's error and a floor sample
  are two independent roundoff errors, and the ratio of two such errors is
  heavy-tailed (Cauchy-like): with k floor samples, P(|X| > F max|Y_i|) falls
  only like F**-k (for normal errors about (2/pi)/F**2 at k=2, 0.8/F**3 at
  k=3).  Adaptive optimizers expose this tail: Adam and RMSprop divide by |g|,
  centered RMSprop by sqrt(v - m**2), which cancels when consecutive gradients
  agree, so one element can carry a hugely amplified roundoff error in every
  run.  With k=3 and F = 32 about 2e-5 per such tensor remains; first-order bugs sit 1e3-1e7 above the floor in
  float32 and 1e5 and more in float64 (measured: reports/equivalence.md).
- ``u(dtype)``: the unit roundoff (half the machine epsilon).  ``scale`` is the
  tensor's own magnitude (the parameter, or the optimizer state value) and, for
  updates, at least the largest update anywhere in the model: a floor tied to
  the global update size, so a gradient that cancels to ~0 in one tensor is
  compared on the model's scale, not by an exploding relative error.  This
  term matters only where the measured floor happens to be ~0 (e.g. all
  arithmetic exact, as in the 2.04 toy case); a storage rounding of the
  parameter per step is its minimum honest size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["FLOOR_FACTOR", "ROUNDOFF_UNITS_PER_STEP", "Allowance", "allowance", "unit_roundoff"]

#: A correct accumulation may land this many times further from the truth than
#: the full-batch run does (the heavy tail of roundoff ratios; module docstring).
FLOOR_FACTOR = 32.0
#: Units of roundoff of the tensor's scale allowed per optimizer step taken
#: (the parameter is rounded to its dtype once per step in each of two runs).
ROUNDOFF_UNITS_PER_STEP = 16.0


def unit_roundoff(dtype: torch.dtype) -> float:
    """Half the machine epsilon: the largest relative error of one rounding."""
    return float(torch.finfo(dtype).eps) / 2


@dataclass(frozen=True, slots=True)
class Allowance:
    floor: float
    roundoff: float
    scale: float
    steps: int

    @property
    def allowed(self) -> float:
        return FLOOR_FACTOR * self.floor + ROUNDOFF_UNITS_PER_STEP * self.steps * self.roundoff * self.scale

    def explain(self) -> str:
        return (
            f"{FLOOR_FACTOR:g} x full-batch floor {self.floor:.3g} + {ROUNDOFF_UNITS_PER_STEP:g} x {self.steps} "
            f"step(s) x unit roundoff {self.roundoff:.3g} x scale {self.scale:.3g}"
        )


def allowance(*, floor: float, dtype: torch.dtype, scale: float, steps: int) -> Allowance:
    return Allowance(floor=floor, roundoff=unit_roundoff(dtype), scale=scale, steps=steps)

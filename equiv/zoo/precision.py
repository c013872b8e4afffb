"""The accumulation buffer's precision as the search meets it: each step with the
precision its user trains in, and what the search must conclude.

A precision finding depends on the user's precision as much as on the step: a
bfloat16 buffer (:func:`equiv.zoo.bugs.low_precision_buffer`, ISEEKYAN #149)
fails float32 training and passes bfloat16 training; the correct loops whose
float32 arithmetic reaches the gradient (:data:`equiv.zoo.correct.FLOAT32_ON_THE_GRADIENT`)
pass float32 training and are precision findings for float64 training.  Every
step of that set is an entry here, with no list of names to keep in step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from equiv.outcomes import Outcome
from equiv.zoo.bugs import low_precision_buffer
from equiv.zoo.correct import CORRECT_STEPS, FLOAT32_ON_THE_GRADIENT

__all__ = ["PRECISION_SEARCH", "SMOOTH_OPTIMIZERS", "PrecisionEntry"]

#: Optimizers whose update moves by as much as the gradient does: one bfloat16 rounding of the
#: gradient stays one rounding of the update.  Rprop steps by the gradient's sign and Muon
#: orthogonalises it, so there a rounding can become another update.
SMOOTH_OPTIMIZERS: tuple[str, ...] = ("SGD", "Adam", "AdamW")


@dataclass(frozen=True)
class PrecisionEntry:
    """A step searched for one training precision (:func:`equiv.verify`'s ``train_dtype``)."""

    step: Callable[..., Any]
    #: the precision the user trains in
    train_dtype: str
    #: the optimizers drawn (empty: every one)
    optimizers: tuple[str, ...]
    #: EQUIVALENT (nothing found), PRECISION or NOT_EQUIVALENT
    expected: Outcome
    #: for an expected PRECISION, its cause where one is required ("" where either float32 cause fits)
    cause: str
    what: str
    #: the public report it reproduces ("" for equiv's own zoo)
    upstream: str = ""


def _entries() -> dict[str, PrecisionEntry]:
    entries = {
        "low_precision_buffer (float32 training)": PrecisionEntry(
            low_precision_buffer,
            "float32",
            SMOOTH_OPTIMIZERS,
            Outcome.PRECISION,
            "bfloat16_arithmetic",
            "gradients summed in a bfloat16 buffer, master weights and gradients float32",
            "ISEEKYAN #149 (Megatron-FSDP: bf16 accumulation 3.5e-5 relative, float32 buffers 2.7e-8)",
        ),
        "low_precision_buffer (bfloat16 training)": PrecisionEntry(
            low_precision_buffer,
            "bfloat16",
            SMOOTH_OPTIMIZERS,
            Outcome.EQUIVALENT,
            "",
            "the same buffer for a user who trains in bfloat16, whose own rounding is this size",
        ),
        "low_precision_buffer (Rprop)": PrecisionEntry(
            low_precision_buffer,
            "float32",
            ("Rprop",),
            Outcome.NOT_EQUIVALENT,
            "",
            "the same buffer under Rprop, which steps by the gradient's sign: a rounding that flips a small "
            "element's sign is a full step the other way",
        ),
    }
    for name in sorted(FLOAT32_ON_THE_GRADIENT):
        entries[f"{name} (float32 training)"] = PrecisionEntry(
            CORRECT_STEPS[name],
            "float32",
            (),
            Outcome.EQUIVALENT,
            "",
            "correct; float32 arithmetic on the gradient inside the float64 run",
        )
        entries[f"{name} (float64 training)"] = PrecisionEntry(
            CORRECT_STEPS[name], "float64", (), Outcome.PRECISION, "", "the same step for a user who trains in float64"
        )
    return entries


#: entry name -> what the search must conclude for that precision.
PRECISION_SEARCH: dict[str, PrecisionEntry] = _entries()

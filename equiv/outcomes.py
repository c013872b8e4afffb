"""The one vocabulary of results: :class:`Outcome`.

A verdict's ``status`` and ``kind``, a distributed verdict's, a search's
``kind``, the CLI's JSON and the zoo's expectations all use these values, so a
result means the same word everywhere.  A ``str`` enum: it compares equal to
its value (``verdict.status == "equivalent"``) and is written to JSON as it.
"""

from __future__ import annotations

from enum import Enum

__all__ = ["Outcome"]


class Outcome(str, Enum):
    """What a check concluded about a case (or a search about a step)."""

    #: Every tensor at every step within its allowance, in every tier.
    EQUIVALENT = "equivalent"
    #: A mathematical mismatch with the full-batch step.
    NOT_EQUIVALENT = "not_equivalent"
    #: Not equivalent only through float32 rounding inside the float64 run (a tensor
    #: made in torch's default dtype), or a mixed-precision policy's 16-bit arithmetic.
    PRECISION = "precision"
    #: The case has a layer whose output depends on the batch (BatchNorm, dropout):
    #: no accumulation can match the full batch, so it is not judged.
    INHERENTLY_NON_EQUIVALENT = "inherently_non_equivalent"
    #: The case sets something the step cannot be told about (a clip norm for a step
    #: without ``max_grad_norm``): it says nothing about the step.
    NOT_APPLICABLE = "not_applicable"
    #: The step raised, or hung past the time limit: no verdict.
    STEP_ERROR = "step_error"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

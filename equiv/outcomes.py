"""The one vocabulary of results: :class:`Outcome` (and :class:`Fault`: what a step error was).

Every result's ``status`` (see :mod:`equiv.results.protocol`), a verdict's
finer ``outcome``, the CLI's JSON and exit codes and the zoo's expectations all
use these values, so a result means the same word everywhere.  A ``str`` enum:
it compares equal to its value (``verdict.status == "equivalent"``) and is
written to JSON as it; each member carries its :attr:`~Outcome.label` (the
words a one-line result starts with) and :attr:`~Outcome.description`.
"""

from __future__ import annotations

from enum import Enum

__all__ = ["Fault", "Outcome", "outcome_words"]


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

    @property
    def label(self) -> str:
        """The outcome in words, as a result's one line starts: "not equivalent"."""
        return _WORDS[self][0]

    @property
    def description(self) -> str:
        """What the outcome means, in a sentence."""
        return _WORDS[self][1]

    @property
    def passed(self) -> bool:
        """Whether a result with this status is truthy (only EQUIVALENT is)."""
        return self is Outcome.EQUIVALENT

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


#: Outcome -> (label, description): the words each outcome is shown with.
_WORDS: dict[Outcome, tuple[str, str]] = {
    Outcome.EQUIVALENT: ("equivalent", "every tensor at every step within its allowance, in every tier"),
    Outcome.NOT_EQUIVALENT: ("not equivalent", "a mathematical mismatch with the full-batch step"),
    Outcome.PRECISION: (
        "precision",
        "float32-sized differences inside the float64 run (or a mixed-precision "
        "policy's 16-bit arithmetic), failing for the precision trained in",
    ),
    Outcome.INHERENTLY_NON_EQUIVALENT: (
        "inherently non-equivalent",
        "a layer whose output depends on the batch "
        "(BatchNorm, dropout): no accumulation can match the full batch, not judged",
    ),
    Outcome.NOT_APPLICABLE: (
        "not applicable",
        "the case sets something the step cannot be told about: it says nothing about the step",
    ),
    Outcome.STEP_ERROR: ("step error", "the step raised, hung past the time limit, or a rank died: no verdict"),
}


class Fault(str, Enum):
    """How a step (or its ranks) failed to give a verdict: what a
    :data:`Outcome.STEP_ERROR` was, as data.  ``RAISED``: the step raised (on
    some rank); ``HUNG``: it ran past its time limit (a rank still running at
    the deadline); ``DIED``: a rank exited without reporting (killed, or with
    an exit code of its own); ``COLLECTIVE_MISMATCH``: the ranks' collectives
    did not line up.  Set where the failure is met (the launchers'
    :class:`~equiv.distributed.launcher.DistributedCheckError`, a search's
    judge); a search decides from it, never from an error's text, to stop at
    once (``HUNG``: each shrink step would wait out the limit again) or shrink.
    A ``str`` enum, as :class:`Outcome`."""

    RAISED = "raised"
    HUNG = "hung"
    DIED = "died"
    COLLECTIVE_MISMATCH = "collective_mismatch"

    __str__ = Outcome.__str__


def outcome_words(value: str) -> str:
    """An outcome, a fault or a precision cause as a report's cell and a count's label write it.

    Args:
        value: an :class:`Outcome`, a :class:`Fault`, or a word of the same kind (a verdict's
            ``outcome``, a precision finding's ``cause`` such as ``"bfloat16_arithmetic"``).

    Returns:
        Its value with spaces for underscores: ``"not equivalent"``, ``"collective mismatch"``,
        ``"inherently non equivalent"`` (as the committed reports write it; a result's one line
        starts with :attr:`Outcome.label` instead).
    """
    return str(value).replace("_", " ")

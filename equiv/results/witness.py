"""The witness of a failing step: the weight the run gave each micro-batch's loss, beside the full batch's.

A failing window's verdict says how far the run's update is from the full
batch's; the witness says why, in the terms most accumulation bugs are made of
(issue 44): which weight did each micro-batch's loss SUM get?  With ``g_i`` the
float64 gradient of micro-batch i's loss sum and ``G`` the gradient the run
accumulated, ``G ≈ Σ w_i g_i`` (:func:`equiv.judging.witness.recover_weights`);
the full batch's ``w_i`` are ``1/N`` each.  The weights are named from one table
of normalisers (:data:`equiv.zoo.kinds.NORMALISERS`).

A :class:`Witness` is plain data: :meth:`Witness.to_dict` is what a result's
``to_dict()`` carries under ``"weights"``, :meth:`Witness.clause` the short
clause its text line gains.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from equiv.zoo.kinds import PER_MICRO_BATCH_CLIPPING

__all__ = ["CLIPPED_EACH", "NOT_A_REWEIGHTING", "NOT_IDENTIFIABLE", "UNEXPLAINED", "Witness"]

#: The normaliser's name when the best re-weighting of the micro-batches leaves too much of the gradient unexplained.
NOT_A_REWEIGHTING = "not a re-weighting"
#: The normaliser's name when the micro-batches' gradients are (numerically) linearly dependent.
NOT_IDENTIFIABLE = "not identifiable"
#: The normaliser's name when the weights are recovered and no normaliser of the table gives them.
UNEXPLAINED = "a re-weighting no known normaliser explains"
#: The normaliser's name when no normaliser explains the weights and the run was seen clipping its running gradient
#: before the window's last micro-batch (transformers #986): each clip scales every earlier micro-batch again.
CLIPPED_EACH = PER_MICRO_BATCH_CLIPPING.name  # equiv check's kind of the same bug: one classifier


def _ratio(value: float) -> str:
    """A ratio to the full batch's weight, as the line shows it: x4.0, x0.25."""
    return f"x{value:.1f}" if value >= 0.95 else f"x{value:.2g}"


@dataclass(frozen=True)
class Witness:
    """The weights a run applied to a window's micro-batches, named.

    ``run`` and ``full_batch`` are weights of each micro-batch's loss SUM (the
    full batch's are ``1/N`` each, N the window's items); ``run`` is None when
    they are not identifiable (the micro-batches' gradients linearly dependent).
    """

    #: the recovered weight of each micro-batch's loss sum (None: not identifiable)
    run: tuple[float, ...] | None
    #: the full batch's: 1/N each
    full_batch: tuple[float, ...]
    #: ||G - Σ w_i g_i|| / ||G||: how much of the run's gradient no re-weighting of the micro-batches explains
    residual: float
    #: the normaliser's name (several that fit joined by " or "), or NOT_A_REWEIGHTING, NOT_IDENTIFIABLE, UNEXPLAINED
    normaliser: str
    #: what the loop did, in one line
    means: str
    #: the weight of micro-batch i's loss sum as a formula ("1/n_i"); empty where no normaliser was named
    formula: str
    #: the items of each micro-batch's loss
    items: tuple[float, ...]
    #: the rank each micro-batch ran on, where known
    ranks: tuple[int, ...] | None = None
    #: the condition number of the micro-batch gradients' Gram matrix (inf: singular)
    condition: float = 1.0
    #: past the residual tolerance, what the recorded calls and the measured refits support (empty: nothing more
    #: than the micro-batches' gradients was measured)
    explanation: str = ""

    def ratio(self) -> float | None:
        """The run's weights over the full batch's, averaged over the micro-batches (None: not identifiable)."""
        if self.run is None:
            return None
        return sum(run / full for run, full in zip(self.run, self.full_batch, strict=True)) / len(self.run)

    def clause(self) -> str:
        """The one short clause a verdict's text line gains."""
        ratio = self.ratio()
        if self.run is None or ratio is None:
            # Why, in ``means`` (dependent gradients, or a residual past naming); the condition number stays in
            # ``condition``: past identifiability its digits are rounding, not a fact.
            return f"the micro-batches' weights are {NOT_IDENTIFIABLE}: {self.means}"
        if self.normaliser == NOT_A_REWEIGHTING and self.explanation:
            return (
                f"{NOT_A_REWEIGHTING} of micro-batches: the best one leaves {self.residual:.0%} of the gradient "
                f"unexplained; {self.explanation}"
            )
        if self.normaliser == NOT_A_REWEIGHTING:
            return (
                f"{NOT_A_REWEIGHTING} of micro-batches: the best one leaves {self.residual:.0%} of the gradient "
                "unexplained (clipped per micro-batch or per tensor, another loss, per-token weights?)"
            )
        if self.normaliser in (UNEXPLAINED, CLIPPED_EACH):
            scaled = ", ".join(f"{run / full:.3g}" for run, full in zip(self.run, self.full_batch, strict=True))
            said = UNEXPLAINED if self.normaliser == UNEXPLAINED else self.means
            return f"{said}: weights ({scaled})/N, the full batch 1/N each — {_ratio(ratio)} on average"
        return f"{self.means}: weights {self.formula}, the full batch 1/N — {_ratio(ratio)} on average"

    def to_dict(self) -> dict[str, Any]:
        """What a result's ``to_dict()`` carries under ``"weights"``: the run's weights (None: not identifiable),
        the full batch's, the relative residual and the normaliser's name."""
        return {
            "run": None if self.run is None else list(self.run),
            "full_batch": list(self.full_batch),
            "residual": self.residual,
            "normaliser": self.normaliser,
        }

"""The losses, in the form the candidate contract hands them to a step: each one's mean, sum and item count.

Three families, one protocol (:class:`Loss`: ``loss_fn(output, target)`` the mean,
``loss_fn.sum`` and ``loss_fn.count`` what a correct accumulation needs):

- :mod:`equiv.losses.items`: losses over samples and tokens (``MSE``, ``CrossEntropy``,
  ``TokenCrossEntropy``, ``NextTokenCrossEntropy``, the aux-loss ones), and the options a
  torch criterion or functional loss carries;
- :mod:`equiv.losses.packed`: losses over packed rows (several sequences per row), DPO among them;
- :mod:`equiv.losses.policy`: RL policy-gradient losses (GRPO, DAPO, Dr. GRPO) and their normalisers.

Every loss of the three is registered by name in :data:`LOSSES` here, so a ``Case`` names any of them.
"""

from __future__ import annotations

from equiv.losses.items import (  # FUNCTIONAL: imported as equiv.losses.FUNCTIONAL, as before the split
    FUNCTIONAL,  # noqa: F401
    LOSSES,
    MSE,
    CrossEntropy,
    Loss,
    LossOptions,
    MSEWithAux,
    NextTokenCrossEntropy,
    TokenCrossEntropy,
    TokenMSEWithAux,
    build_loss,
    disagreement,
    item_count,
    loss_of,
    loss_sum_and_count,
    options_of_call,
    options_of_criterion,
)
from equiv.losses.packed import PACKED_LOSSES
from equiv.losses.policy import POLICY_LOSSES

# One registry: a Case names a packed or policy loss like any built-in one.
LOSSES.update(PACKED_LOSSES)
LOSSES.update(POLICY_LOSSES)

__all__ = [
    "LOSSES",
    "MSE",
    "CrossEntropy",
    "Loss",
    "LossOptions",
    "MSEWithAux",
    "NextTokenCrossEntropy",
    "TokenCrossEntropy",
    "TokenMSEWithAux",
    "build_loss",
    "disagreement",
    "item_count",
    "loss_of",
    "loss_sum_and_count",
    "options_of_call",
    "options_of_criterion",
]

"""The candidate contract, and the one place a candidate's signature is read.

A *candidate* is the accumulation step a user wants checked::

    step(model, optimizer, micro_batches, loss_fn) -> None

It makes exactly one optimizer update from all of ``micro_batches`` (a list of
``(inputs, targets)``, consecutive pieces of the batch, sizes may be uneven);
``loss_fn(output, target)`` is the MEAN over the micro-batch's items, with
``loss_fn.sum`` / ``loss_fn.count`` for a step that needs them.  A step that
clips, steps an LR scheduler or scales its losses takes the keywords in
:data:`OPTIONAL_KEYWORDS`; the checker passes each only to a candidate whose
signature names it (or takes ``**kwargs``).  Every entry point (``check``,
``verify``, the distributed check, the reports) asks this module which.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn

from equiv.batches import MicroBatches
from equiv.cases.case import Case
from equiv.losses import Loss

__all__ = [
    "OPTIONAL_KEYWORDS",
    "Candidate",
    "CandidateError",
    "accepted_keywords",
    "candidate_name",
    "takes_keyword",
]

#: Keywords a candidate may take, each passed only to a candidate that names it.
OPTIONAL_KEYWORDS: tuple[str, ...] = ("max_grad_norm", "scheduler", "grad_scaler")


class Candidate(Protocol):
    """The public candidate contract: one optimizer update that uses every
    micro-batch.  A candidate that clips accepts ``max_grad_norm``; one that
    steps an LR scheduler accepts ``scheduler``; one that scales its losses
    accepts ``grad_scaler``."""

    def __call__(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: MicroBatches, loss_fn: Loss, /
    ) -> None: ...


class CandidateError(RuntimeError):
    """The candidate raised; the message names the case that triggered it."""

    def __init__(self, message: str, *, case: Case, step: int, dtype: str) -> None:
        super().__init__(message)
        self.case, self.step, self.dtype = case, step, dtype


def candidate_name(candidate: Callable[..., Any]) -> str:
    """How messages and reports name a candidate: its qualified name, else its repr."""
    return getattr(candidate, "__qualname__", None) or getattr(candidate, "__name__", None) or repr(candidate)


def accepted_keywords(candidate: Callable[..., Any]) -> frozenset[str]:
    """Which of :data:`OPTIONAL_KEYWORDS` ``candidate`` accepts: those its
    signature names, or all of them when it takes ``**kwargs``.  A callable
    without a readable signature (a builtin) is passed none."""
    try:
        parameters = inspect.signature(candidate).parameters
    except (TypeError, ValueError):
        return frozenset()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return frozenset(OPTIONAL_KEYWORDS)
    return frozenset(name for name in OPTIONAL_KEYWORDS if name in parameters)


def takes_keyword(candidate: Callable[..., Any], keyword: str) -> bool:
    """Whether the checker would pass ``keyword`` to ``candidate``."""
    if keyword not in OPTIONAL_KEYWORDS:
        raise ValueError(f"keyword must be one of {OPTIONAL_KEYWORDS}, got {keyword!r}")
    return keyword in accepted_keywords(candidate)

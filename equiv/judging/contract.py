"""The candidate contract, and the one place a candidate's signature is read.

A *candidate* is the accumulation step a user wants checked::

    step(model, optimizer, micro_batches, loss_fn) -> None

It makes exactly one optimizer update from all of ``micro_batches`` (a list of
``(inputs, targets)``, consecutive pieces of the batch, sizes may be uneven);
``loss_fn(output, target)`` is the MEAN over the micro-batch's items, with
``loss_fn.sum`` / ``loss_fn.count`` for a step that needs them.  A step that
clips, steps an LR scheduler or scales its losses takes the keywords in
:data:`OPTIONAL_KEYWORDS`; the checker passes each only to a candidate whose
signature names it (or takes ``**kwargs``).  :func:`bind` reads that once;
every entry point (``check``, ``verify``, the distributed check, the reports)
asks the :class:`BoundCandidate` it returns.
"""

from __future__ import annotations

import inspect
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from equiv.batches import MicroBatches
from equiv.cases.case import Case
from equiv.losses import Loss
from equiv.names import reference, resolve

__all__ = [
    "OPTIONAL_KEYWORDS",
    "BoundCandidate",
    "Candidate",
    "CandidateError",
    "CandidateTimeout",
    "ContractError",
    "bind",
    "candidate_name",
    "candidate_reference",
    "load_candidate",
    "shipped",
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

    @property
    def step_traceback(self) -> str | None:
        """The step's own traceback (what it raised), for ``--tb``; None for a hang."""
        cause = self.__cause__
        return "".join(traceback.format_exception(cause)) if cause is not None else None


class CandidateTimeout(CandidateError):
    """The candidate did not finish a step within the check's time limit (it hangs,
    or is far slower than the limit allows); the message names the case, the step
    and how long it ran."""


class ContractError(TypeError):
    """The candidate cannot be called as ``step(model, optimizer, micro_batches, loss_fn)``:
    a usage error, not a counterexample."""


def candidate_name(candidate: Callable[..., Any]) -> str:
    """How messages and reports name a candidate: its qualified name, else its repr."""
    if isinstance(candidate, BoundCandidate):
        return candidate.name
    return getattr(candidate, "__qualname__", None) or getattr(candidate, "__name__", None) or repr(candidate)


#: Case field -> the keyword a candidate needs to honour it.
_NEEDS = (("max_grad_norm", "max_grad_norm"), ("scheduler", "scheduler"), ("loss_scale", "grad_scaler"))


@dataclass(frozen=True, eq=False)
class BoundCandidate:
    """A candidate whose signature has been read, once: what every layer
    (check, the runs, the search, the distributed check, the reports) asks of it.
    Made by :func:`bind`; calling it calls the step."""

    step: Callable[..., Any]
    #: How messages and reports name it.
    name: str
    #: Which of :data:`OPTIONAL_KEYWORDS` the step accepts: those its signature
    #: names, or all of them when it takes ``**kwargs`` (none when its signature
    #: cannot be read, as for a builtin).
    keywords: frozenset[str]
    #: Of those, the ones the signature requires (no default): a case that sets
    #: nothing for one cannot be run, so it does not apply.
    required: frozenset[str] = frozenset()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.step(*args, **kwargs)

    def takes(self, keyword: str) -> bool:
        """Whether the checker passes ``keyword`` to the step."""
        if keyword not in OPTIONAL_KEYWORDS:
            raise ValueError(f"keyword must be one of {OPTIONAL_KEYWORDS}, got {keyword!r}")
        return keyword in self.keywords

    def not_applicable_reasons(self, case: Case) -> tuple[str, ...]:
        """Why ``case`` does not apply to the step: one reason per case setting
        it has no keyword for (a step that takes no ``max_grad_norm`` cannot
        clip, so a clipping case says nothing about it).  Empty when the case
        applies.  The one rule every entry point follows: such a case is
        reported "not applicable", never a pass and never a failure."""
        reasons = []
        for field_name, keyword in _NEEDS:
            value = getattr(case, field_name)
            if value is not None and keyword not in self.keywords:
                reasons.append(f"{self.name} takes no {keyword} (the case sets {field_name}={value!r})")
            if value is None and keyword in self.required:
                reasons.append(f"{self.name} requires {keyword} (no default), and the case sets no {field_name}")
        return tuple(reasons)

    @property
    def reference(self) -> str | None:
        """A spec :func:`load_candidate` loads the step from in another process
        (``module:qualname`` or ``path/to/file.py:qualname``), or None when it has
        no such name (a lambda, a function defined inside another, an instance)."""
        return reference(self.step, files=True)


def bind(candidate: Callable[..., Any] | BoundCandidate) -> BoundCandidate:
    """Read ``candidate``'s signature once (a :class:`BoundCandidate` is returned as it is).

    Raises :class:`ContractError` unless it can be called with the four
    positional arguments of the contract (a callable whose signature cannot be
    read, such as a builtin, is given the benefit of the doubt)."""
    if isinstance(candidate, BoundCandidate):
        return candidate
    if not callable(candidate):
        raise ContractError(
            f"candidate must be callable as step(model, optimizer, micro_batches, loss_fn), got {candidate!r}"
        )
    name = candidate_name(candidate)
    try:
        signature = inspect.signature(candidate)
    except (TypeError, ValueError):
        return BoundCandidate(candidate, name, frozenset())
    # Optional keywords the signature requires are passed by the checker when a case sets them.
    required_keywords = {
        keyword: None
        for keyword, parameter in signature.parameters.items()
        if keyword in OPTIONAL_KEYWORDS and parameter.default is inspect.Parameter.empty
    }
    try:
        signature.bind(None, None, None, None, **required_keywords)
    except TypeError as exc:
        raise ContractError(
            f"candidate {name}{signature} cannot be called as "
            f"step(model, optimizer, micro_batches, loss_fn) ({exc}); see the candidate contract in docs/check.md"
        ) from None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values()):
        keywords = frozenset(OPTIONAL_KEYWORDS)
    else:
        keywords = frozenset(keyword for keyword in OPTIONAL_KEYWORDS if keyword in signature.parameters)
    return BoundCandidate(candidate, name, keywords, frozenset(required_keywords))


def load_candidate(spec: str) -> Callable[..., Any]:
    """``package.module:func`` or ``path/to/file.py:func`` -> the callable
    (``func`` may be dotted: ``Class.method``), through :func:`equiv.names.resolve`
    (the file's folder, or the working directory, is on ``sys.path`` only while it
    imports).  Raises ``ValueError`` naming what is wrong with ``spec``."""
    module_part, sep, attr = spec.rpartition(":")
    if not sep or not module_part or not attr:
        raise ValueError(f"expected MODULE:FUNC or path/to/file.py:FUNC, got {spec!r}")
    target = resolve(spec)
    if not callable(target):
        raise ValueError(f"{spec!r} is a {type(target).__name__}, not a callable step")
    return target


class _ByName:
    """A step on its way to another process: it unpickles as the step loaded
    there from its import path (a module loaded from a file is in no
    ``sys.modules``, and a module found from the working directory is not on
    a spawned rank's ``sys.path``, so pickling the function itself fails there)."""

    def __init__(self, spec: str) -> None:
        self.spec = spec

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (load_candidate, (self.spec,))


def shipped(candidate: Callable[..., Any]) -> Any:
    """``candidate`` as it travels to spawned or torchrun ranks: by its import
    path where it has one (:func:`candidate_reference`), else itself (an
    instance of a module-level class is pickled whole)."""
    spec = candidate_reference(candidate)
    return candidate if spec is None else _ByName(spec)


def candidate_reference(candidate: Callable[..., Any]) -> str | None:
    """A spec :func:`load_candidate` can load ``candidate`` from in another
    process (``module:qualname``, or ``path/to/file.py:qualname`` for a module
    loaded from a file), or None when it has no such name (a lambda, a
    function defined inside another, an instance)."""
    return bind(candidate).reference

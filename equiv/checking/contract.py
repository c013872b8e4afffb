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

import contextlib
import importlib
import importlib.util
import inspect
import sys
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
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
    "CandidateTimeout",
    "ContractError",
    "accepted_keywords",
    "candidate_name",
    "candidate_reference",
    "check_signature",
    "load_candidate",
    "not_applicable_reasons",
    "on_sys_path",
    "takes_keyword",
    "target_folder",
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


def check_signature(candidate: Callable[..., Any]) -> None:
    """Raise :class:`ContractError` unless ``candidate`` can be called with the
    four positional arguments of the contract (a callable whose signature
    cannot be read, such as a builtin, is given the benefit of the doubt)."""
    if not callable(candidate):
        raise ContractError(
            f"candidate must be callable as step(model, optimizer, micro_batches, loss_fn), got {candidate!r}"
        )
    try:
        signature = inspect.signature(candidate)
    except (TypeError, ValueError):
        return
    # Optional keywords the signature requires are passed by the checker when a case sets them.
    required_keywords = {
        name: None
        for name, parameter in signature.parameters.items()
        if name in OPTIONAL_KEYWORDS and parameter.default is inspect.Parameter.empty
    }
    try:
        signature.bind(None, None, None, None, **required_keywords)
    except TypeError as exc:
        raise ContractError(
            f"candidate {candidate_name(candidate)}{signature} cannot be called as "
            f"step(model, optimizer, micro_batches, loss_fn) ({exc}); see the candidate contract in the README"
        ) from None


#: Case field -> the keyword a candidate needs to honour it.
_NEEDS = (("max_grad_norm", "max_grad_norm"), ("scheduler", "scheduler"), ("loss_scale", "grad_scaler"))


def not_applicable_reasons(candidate: Callable[..., Any], case: Case) -> tuple[str, ...]:
    """Why ``case`` does not apply to ``candidate``: one reason per case setting
    the candidate has no keyword for (a step that takes no ``max_grad_norm``
    cannot clip, so a clipping case says nothing about it).  Empty when the
    case applies.  The one rule every entry point follows: such a case is
    reported "not applicable", never a pass and never a failure."""
    accepted = accepted_keywords(candidate)
    name = candidate_name(candidate)
    reasons = []
    for field_name, keyword in _NEEDS:
        value = getattr(case, field_name)
        if value is not None and keyword not in accepted:
            reasons.append(f"{name} takes no {keyword} (the case sets {field_name}={value!r})")
    return tuple(reasons)


@contextlib.contextmanager
def on_sys_path(directory: str) -> Iterator[None]:
    """``directory`` first on ``sys.path`` while a target is imported, removed after."""
    sys.path.insert(0, directory)
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            sys.path.remove(directory)


def target_folder(spec: str) -> str:
    """Where ``spec``'s own imports resolve from: a file target's folder, else the working
    directory (as ``python -m`` does); a case's factories next to the step resolve there too."""
    module_part = spec.rpartition(":")[0]
    return str(Path(module_part).resolve().parent) if module_part.endswith(".py") else str(Path.cwd())


def load_candidate(spec: str) -> Callable[..., Any]:
    """``package.module:func`` or ``path/to/file.py:func`` -> the callable
    (``func`` may be dotted: ``Class.method``).

    The file's folder (or the working directory, for a module name) is on
    ``sys.path`` only while the module is imported, so its own imports
    resolve; nothing is left there afterwards.  Raises ``ValueError`` naming
    what is wrong with ``spec``."""
    module_part, sep, attr = spec.rpartition(":")
    if not sep or not module_part or not attr:
        raise ValueError(f"expected MODULE:FUNC or path/to/file.py:FUNC, got {spec!r}")
    try:
        if module_part.endswith(".py"):
            path = Path(module_part)
            if not path.is_file():
                raise ValueError(f"no such file {str(path)!r} (from {spec!r})")
            module_spec = importlib.util.spec_from_file_location(path.stem, path)
            assert module_spec is not None and module_spec.loader is not None
            module = importlib.util.module_from_spec(module_spec)
            with on_sys_path(str(path.resolve().parent)):
                module_spec.loader.exec_module(module)
        else:
            with on_sys_path(str(Path.cwd())):
                module = importlib.import_module(module_part)
    except ValueError:
        raise
    except Exception as exc:
        raise ValueError(f"could not import {module_part!r}: {type(exc).__name__}: {exc}") from exc
    target: Any = module
    for part in attr.split("."):
        target = getattr(target, part, None)
        if target is None:
            raise ValueError(f"module {module_part!r} has no attribute {attr!r}")
    if not callable(target):
        raise ValueError(f"{spec!r} is a {type(target).__name__}, not a callable step")
    return target


def candidate_reference(candidate: Callable[..., Any]) -> str | None:
    """A spec :func:`load_candidate` can load ``candidate`` from in another
    process (``module:qualname``, or ``path/to/file.py:qualname`` for a module
    loaded from a file), or None when it has no such name (a lambda, a
    function defined inside another, an instance)."""
    qualname = getattr(candidate, "__qualname__", None)
    module_name = getattr(candidate, "__module__", None)
    if not qualname or not module_name or "<" in qualname:
        return None
    module = sys.modules.get(module_name)
    if module is not None and getattr(module.__spec__, "name", None) == module_name:
        return f"{module_name}:{qualname}"
    try:
        source = inspect.getsourcefile(candidate)
    except TypeError:
        return None
    return f"{source}:{qualname}" if source and source.endswith(".py") else None

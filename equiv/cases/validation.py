"""What a :class:`~equiv.cases.case.Case`'s fields are checked against when it is made.

:class:`InvalidCase` and its one-line messages (with a "did you mean" for a near miss), the ``torch.optim``
optimizers and schedulers a case can name (:data:`UNSUPPORTED_OPTIMIZERS` left out, and why), a device torch has
here, optimizer keywords tried on a dummy parameter, and the import paths a case read from JSON may import.
"""

from __future__ import annotations

import difflib
import functools
import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from equiv.distributed.deepspeed import DEEPSPEED_MUON, deepspeed_muon
from equiv.losses import LOSSES
from equiv.names import resolve

__all__ = ["EXTERNAL_OPTIMIZERS", "UNSUPPORTED_OPTIMIZERS", "InvalidCase", "check_device", "optimizer_class"]

#: Optimizers a case may name beyond ``torch.optim``: name -> (the function importing its class, the extra it
#: needs).  DeepSpeed's own Muon, which its engine builds from a config and no torch class replays
#: (:func:`equiv.distributed.deepspeed.deepspeed_muon`).
EXTERNAL_OPTIMIZERS: dict[str, tuple[Callable[[], type[torch.optim.Optimizer]], str]] = {
    DEEPSPEED_MUON: (deepspeed_muon, "deepspeed"),
}

#: ``torch.optim`` classes a case cannot name, and why: their step is not one update
#: from the accumulated gradient, so there is no full-batch step to compare with
#: (refused when the case is made, not from inside the first run).
UNSUPPORTED_OPTIMIZERS: dict[str, str] = {
    "LBFGS": "its step(closure) re-evaluates the loss several times per step, not one update from the "
    "accumulated gradient",
    "SparseAdam": "it takes sparse gradients only (nn.Embedding(sparse=True)); the cases' models make dense ones",
}


class InvalidCase(ValueError):
    """A case whose fields cannot describe a run."""


@functools.cache
def _optimizer_names() -> list[str]:
    """The ``torch.optim`` classes a case can name (every optimizer but :data:`UNSUPPORTED_OPTIMIZERS`)."""
    return [
        name
        for name, value in vars(torch.optim).items()
        if inspect.isclass(value)
        and issubclass(value, torch.optim.Optimizer)
        and value is not torch.optim.Optimizer
        and name not in UNSUPPORTED_OPTIMIZERS
    ]


@functools.cache
def _scheduler_names() -> list[str]:
    return [
        name
        for name, value in vars(torch.optim.lr_scheduler).items()
        if inspect.isclass(value) and not name.startswith("_")
    ]


def _did_you_mean(value: Any, names: Iterable[str]) -> str:
    """ " (did you mean 'AdamW'?)" for a near miss among ``names``, else ""."""
    if not isinstance(value, str):
        return ""
    by_lower = {name.lower(): name for name in names}
    close = difflib.get_close_matches(value.lower(), list(by_lower), n=1, cutoff=0.6)
    return f" (did you mean {by_lower[close[0]]!r}?)" if close else ""


def _check_import_allowed(field_name: str, value: Any, allowed: list[str]) -> None:
    if not isinstance(value, str) or ":" not in value or value.startswith("<"):
        return  # a registered name, or a description that the constructor rejects with its own reason
    module = value.partition(":")[0]
    if any(module == name or module.startswith(name + ".") for name in allowed):
        return
    raise InvalidCase(
        f"the case's {field_name} {value!r} would import module {module!r}, which was not named: importing runs "
        f"that module's code, so a case read from JSON imports only from modules you allow (equiv check "
        f"--allow-import {module}, or Case.from_dict(..., allow_imports=[{module!r}]))"
    )


def check_device(device: str) -> None:
    """Raise :class:`InvalidCase` unless ``device`` names a device torch can use here
    (a CUDA device on a CPU build, or with no GPU visible, is refused up front,
    not inside the first run)."""
    try:
        parsed = torch.device(device)
    except RuntimeError:
        raise InvalidCase(f"unknown device {device!r}; expected e.g. 'cpu' or 'cuda:0'") from None
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            why = "a CPU build" if torch.version.cuda is None else "no CUDA device is visible"
            raise InvalidCase(f"device {device!r} asked for, but torch {torch.__version__} here has none ({why})")
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            raise InvalidCase(f"device {device!r} asked for, but only {torch.cuda.device_count()} CUDA device(s) exist")
    elif parsed.type == "mps" and not torch.backends.mps.is_available():
        raise InvalidCase(f"device {device!r} asked for, but MPS is not available here")


def _check_optimizer_kwargs(optimizer_class: Any, name: str, kwargs: Mapping[str, Any]) -> None:
    """Reject bad optimizer keywords when the case is made (``lr=-1``, a misspelt name),
    not inside the first run: built once on a dummy 2-D parameter.  An optimizer that
    cannot be built on one even with its defaults is left to the run."""

    def build(**options: Any) -> None:
        optimizer_class([torch.zeros(2, 2, requires_grad=True)], **options)

    try:
        build(**kwargs)
    except (TypeError, ValueError) as exc:
        try:
            build()
        except Exception:
            return  # needs more than a plain parameter (or an lr): the run will say
        raise InvalidCase(f"optimizer {name}(**{dict(kwargs)!r}) rejected: {exc}") from None


def _check_target(field_name: str, value: Any, names: Any) -> None:
    """A named entry (``names``), a callable, or an import path that imports."""
    if callable(value):
        return
    if not isinstance(value, str):
        raise InvalidCase(
            f"{field_name} must be a name in {sorted(names)}, a callable or an import path "
            f"'module:attribute', got {type(value).__name__}: {value!r}"
        )
    if ":" in value:
        try:
            target = resolve(value)
        except ValueError as exc:
            raise InvalidCase(f"{field_name}: {exc}") from None
        if not callable(target):
            raise InvalidCase(f"{field_name} {value!r} imports {type(target).__name__}, which is not callable")
        return
    if value not in names:
        raise InvalidCase(
            f"unknown {field_name} {value!r}; expected one of {sorted(names)}, "
            f"a callable or an import path 'module:attribute'{_did_you_mean(value, names)}"
        )


def _check_micro_batches(batch_size: Any, sizes: tuple[Any, ...]) -> None:
    """A positive batch cut into micro-batches of at least one sample each that add up to it."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise InvalidCase(f"batch_size must be a positive int, got {batch_size!r}")
    if not sizes:
        raise InvalidCase("micro_batch_sizes must hold at least one micro-batch, got ()")
    for index, size in enumerate(sizes):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise InvalidCase(
                f"micro-batch {index} has size {size!r}; every micro-batch needs at least one sample "
                f"(micro_batch_sizes={sizes})"
            )
    if sum(sizes) != batch_size:
        raise InvalidCase(f"micro_batch_sizes {sizes} add up to {sum(sizes)}, but batch_size is {batch_size}")


def _check_frozen_layers(frozen: Any) -> None:
    """An int (not a bool), or a non-empty tuple of distinct int layer indices."""
    valid_int = isinstance(frozen, int) and not isinstance(frozen, bool)
    valid_tuple = (
        isinstance(frozen, tuple)
        and len(frozen) > 0
        and len(set(frozen)) == len(frozen)
        and all(isinstance(i, int) and not isinstance(i, bool) for i in frozen)
    )
    if not (valid_int or valid_tuple):
        raise InvalidCase(
            f"frozen_layers must be an int (k: the first k layers, -k: all but the last k) or a "
            f"non-empty tuple of distinct layer indices, got {frozen!r}"
        )


def _check_loss(loss: Any) -> None:
    """A name in ``LOSSES``, or an object following the sum + count protocol."""
    if isinstance(loss, str):
        if loss not in LOSSES:
            raise InvalidCase(
                f"unknown loss {loss!r}; expected one of {sorted(LOSSES)} or a loss object{_did_you_mean(loss, LOSSES)}"
            )
    elif not (callable(loss) and callable(getattr(loss, "sum", None)) and callable(getattr(loss, "count", None))):
        raise InvalidCase(
            f"loss {loss!r} does not follow the sum + count protocol; expected a name in {sorted(LOSSES)} "
            "or an object with sum(output, targets), count(targets) and __call__(output, targets) (the mean)"
        )


def optimizer_class(name: str) -> type[torch.optim.Optimizer]:
    """The optimizer class a case's ``optimizer`` names: a ``torch.optim`` class, or one of
    :data:`EXTERNAL_OPTIMIZERS` (imported here: :class:`InvalidCase` where its package is missing)."""
    if name in EXTERNAL_OPTIMIZERS:
        imported, extra = EXTERNAL_OPTIMIZERS[name]
        try:
            return imported()
        except ImportError:
            raise InvalidCase(f"optimizer {name!r} needs {extra}: pip install 'equiv[{extra}]'") from None
    optimizer: type[torch.optim.Optimizer] = getattr(torch.optim, name)
    return optimizer


def _check_optimizer(name: str) -> type[torch.optim.Optimizer]:
    """The class ``name`` names (:func:`optimizer_class`), unless it is one of :data:`UNSUPPORTED_OPTIMIZERS`."""
    if name in EXTERNAL_OPTIMIZERS:
        return optimizer_class(name)
    named = getattr(torch.optim, name, None)
    if not (inspect.isclass(named) and issubclass(named, torch.optim.Optimizer)):
        known = [*_optimizer_names(), *EXTERNAL_OPTIMIZERS]
        raise InvalidCase(
            f"unknown optimizer {name!r}; expected a class in torch.optim or one of {sorted(EXTERNAL_OPTIMIZERS)}"
            f"{_did_you_mean(name, known)}"
        )
    if name in UNSUPPORTED_OPTIMIZERS:
        raise InvalidCase(
            f"optimizer {name!r} is not supported: {UNSUPPORTED_OPTIMIZERS[name]}; "
            f"supported: {', '.join(sorted(_optimizer_names()))}"
        )
    return named


def _check_scheduler(name: str | None) -> None:
    """None, or a class of ``torch.optim.lr_scheduler``."""
    if name is not None and not inspect.isclass(getattr(torch.optim.lr_scheduler, name, None)):
        raise InvalidCase(
            f"unknown scheduler {name!r}; expected a class in torch.optim.lr_scheduler"
            f"{_did_you_mean(name, _scheduler_names())}"
        )

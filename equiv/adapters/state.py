"""Per-run state for adapters whose state outlives one window."""

from __future__ import annotations

import weakref
from typing import Any

from torch import nn


class PerRun:
    """Remembers the model of the current run; ``is_new(model)`` is True the
    first time a model is seen, so an adapter can reset its state."""

    def __init__(self) -> None:
        self._model: weakref.ReferenceType[nn.Module] | None = None

    def is_new(self, model: nn.Module) -> bool:
        if self._model is not None and self._model() is model:
            return False
        self._model = weakref.ref(model)
        return True


class UnsupportedWindow(ValueError):
    """The ported framework refuses this window as its users would see it
    refused (MindSpore's ``_MicroBatch`` needs a batch divisible by
    ``micro_size``): a case the adapter cannot take, not a counterexample."""


def describe(name: str, **options: Any) -> str:
    shown = ", ".join(f"{key}={value!r}" for key, value in options.items() if value is not None)
    return f"{name}({shown})"

"""torch's clip calls, watched: what the audit records of a window's clips and what ``equiv check``'s witness
counts of a failing step's (issue 44).

``clip_grad_norm_`` and ``clip_grad_value_`` are replaced in ``torch.nn.utils`` and in
``torch.nn.utils.clip_grad`` (where the deprecated ``clip_grad_norm`` and Accelerate's and Lightning's clips
find them) while anything listens: one wrapper however many listeners there are (they may stop in any
order), torch's own functions put back when the last stops.  Each listener is told the function's name, the
parameters it was handed and its limit, before torch clips.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import torch
from torch import Tensor

__all__ = ["LIMIT_KEYWORDS", "ClipCalls", "ClipListener", "clip_calls"]

#: torch's clip functions watched, by name: the keyword of their limit.
LIMIT_KEYWORDS: dict[str, str] = {"clip_grad_norm_": "max_norm", "clip_grad_value_": "clip_value"}

#: Told of each clip call: the function's name, the parameters it was handed, its limit.
ClipListener = Callable[[str, list[Tensor], float], None]

#: Where torch's clip functions live (the first is where their callers look them up, the second where
#: ``torch.nn.utils.clip_grad``'s own functions do).
_MODULES = (torch.nn.utils, torch.nn.utils.clip_grad)


class ClipCalls:
    """The listeners of torch's clip calls, and torch's functions while they are replaced."""

    listeners: ClassVar[list[ClipListener]] = []
    #: torch's functions replaced, by "module.name"
    originals: ClassVar[dict[str, Any]] = {}

    @classmethod
    def listen(cls, listener: ClipListener) -> None:
        """Tell ``listener`` of every clip call until :meth:`stop`."""
        if not cls.listeners:
            for module in _MODULES:
                for name in LIMIT_KEYWORDS:
                    cls.originals[f"{module.__name__}.{name}"] = getattr(module, name)
                    setattr(module, name, cls.watching(name))
        cls.listeners.append(listener)

    @classmethod
    def stop(cls, listener: ClipListener) -> None:
        """Stop telling ``listener``; torch's functions back once no one listens."""
        if listener in cls.listeners:
            cls.listeners.remove(listener)
        if not cls.listeners and cls.originals:
            for module in _MODULES:
                for name in LIMIT_KEYWORDS:
                    setattr(module, name, cls.originals.pop(f"{module.__name__}.{name}"))

    @staticmethod
    def watching(name: str) -> Callable[..., Any]:
        """torch's ``name`` telling the listeners first."""
        keyword = LIMIT_KEYWORDS[name]

        def clip(parameters: Any, *args: Any, **kwargs: Any) -> Any:
            parameters = [parameters] if isinstance(parameters, Tensor) else list(parameters)
            limit = args[0] if args else kwargs.get(keyword)
            if limit is not None and limit == limit and limit >= 0:  # what torch refuses is torch's to say
                for listener in list(ClipCalls.listeners):
                    listener(name, parameters, float(limit))
            return ClipCalls.originals[f"torch.nn.utils.clip_grad.{name}"](parameters, *args, **kwargs)

        clip.__name__ = clip.__qualname__ = name
        return clip


@contextlib.contextmanager
def clip_calls(listener: ClipListener) -> Iterator[None]:
    """``listener`` told of every clip call made inside the block."""
    ClipCalls.listen(listener)
    try:
        yield
    finally:
        ClipCalls.stop(listener)

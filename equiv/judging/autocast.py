"""The ``torch.autocast`` in force where a model is called: read by the audit per recorded forward
(:mod:`equiv.auditing.watch`) and by :func:`equiv.check`, which judges a step that enters one
itself in that precision."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["Autocast", "autocast_of"]

#: The mixed precision a call ran under: ``torch.autocast``'s device type and dtype.
Autocast = tuple[str, torch.dtype]


def autocast_of(model: nn.Module) -> Autocast | None:
    """The ``torch.autocast`` in force for the model's device now (a forward call being recorded), or None."""
    first = next(model.parameters(), None)
    device_type = first.device.type if first is not None else "cpu"
    if not torch.is_autocast_enabled(device_type):
        return None
    return device_type, torch.get_autocast_dtype(device_type)

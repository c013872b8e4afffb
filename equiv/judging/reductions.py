"""Maxima read back to the host in few transfers, and the scratch buffers a comparison reuses.

What :mod:`equiv.judging.compare` and :mod:`equiv.judging.details` share to keep a
comparison to its arithmetic: max |t| where the tensor lives (one multi-tensor
reduction per dtype on a GPU), many 0-d results read in one device-to-host transfer
per device, flat indices unravelled in Python, and :class:`_Scratch`, the float64 (and
bool) buffers reused for every compared tensor's temporaries.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor


def _unravel(flat_index: int, shape: Sequence[int]) -> tuple[int, ...]:
    """The multi-index of a flat (row-major) index, in Python: no device call."""
    index = []
    for size in reversed(shape):
        flat_index, position = divmod(flat_index, size)
        index.append(position)
    return tuple(reversed(index))


def _max_abs(tensor: Tensor) -> Tensor:
    """max |tensor| as a 0-d float64 tensor where the tensor lives (0 for an empty one)."""
    if tensor.numel() == 0:
        return torch.zeros((), dtype=torch.float64, device=tensor.device)
    # min and max in one fused pass (no |tensor| temporary): max|t| = max(|min|, |max|), NaN kept.
    low, high = tensor.aminmax()
    return torch.maximum(low.abs(), high.abs()).to(torch.float64)


def _max_abs_each(tensors: list[Tensor]) -> list[Tensor]:
    """:func:`_max_abs` of every tensor, NaN kept.  On a GPU one multi-tensor
    reduction per dtype (``torch._foreach_norm``, infinity norm: max |t|) and one
    conversion for the whole list, instead of four kernels per tensor; on the
    CPU per tensor, where a foreach op loops over the tensors anyway and the
    fused min/max pass reads each tensor once."""
    out: list[Tensor] = [tensor for tensor in tensors]  # each replaced by its maximum below
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for position, tensor in enumerate(tensors):
        if tensor.device.type == "cpu" or tensor.numel() == 0:  # (the infinity norm of nothing is undefined)
            out[position] = _max_abs(tensor)
        else:
            groups.setdefault((tensor.device, tensor.dtype), []).append(position)
    for positions in groups.values():
        norms = torch._foreach_norm([tensors[p] for p in positions], ord=math.inf)
        for position, norm in zip(positions, torch.stack(norms).to(torch.float64).unbind(), strict=True):
            out[position] = norm
    return out


def _host_floats(values: list[Tensor]) -> list[float]:
    """Many 0-d tensors as Python floats, in one device-to-host transfer per device.

    Host tensors are read where they are: moving them to the GPU to stack them
    is a synchronising copy each (Adam's ``step`` counters live on the host)."""
    out = [0.0] * len(values)
    by_device: dict[torch.device, list[int]] = {}
    for position, value in enumerate(values):
        by_device.setdefault(value.device, []).append(position)
    for device, positions in by_device.items():
        stacked = torch.stack([values[p] for p in positions])
        read = stacked.tolist() if device.type == "cpu" else stacked.cpu().tolist()
        for position, number in zip(positions, read, strict=True):
            out[position] = float(number)
    return out


class _Scratch:
    """Reusable float64 (and bool) buffers for the comparison's temporaries.

    A fresh large tensor per compared tensor is mostly page faults (the
    allocator hands big blocks back to the system and gets zeroed pages the
    next time): one buffer per slot, grown to the largest tensor compared and
    viewed in each tensor's shape, keeps the comparison to its arithmetic.
    Memory: two float64 tensors and one bool tensor of the largest size.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.dtype, torch.device], Tensor] = {}
        #: Views already made, per slot and shape (a model has few shapes; a view costs a call).
        self._views: dict[tuple[str, torch.dtype, torch.device, torch.Size], Tensor] = {}

    def release(self, *slots: str) -> None:
        """Let the buffers of ``slots`` go (the next :meth:`get` makes them again)."""
        self._buffers = {key: buffer for key, buffer in self._buffers.items() if key[0] not in slots}
        self._views = {key: view for key, view in self._views.items() if key[0] not in slots}

    def get(self, slot: str, shape: torch.Size, device: torch.device, dtype: torch.dtype = torch.float64) -> Tensor:
        view = self._views.get((slot, dtype, device, shape))
        if view is not None:
            return view
        key = (slot, dtype, device)
        numel = math.prod(shape)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < numel:
            # A larger buffer: views of the old one would outlive it, so they go.
            buffer = self._buffers[key] = torch.empty(numel, dtype=dtype, device=device)
            self._views = {k: v for k, v in self._views.items() if k[:3] != key}
        view = self._views[(slot, dtype, device, shape)] = buffer[:numel].view(shape)
        return view

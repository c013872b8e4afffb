"""A mismatched row's details: where its greatest differences are, and what diagnoses it.

:class:`~equiv.judging.compare.StepComparer` measures every tensor's greatest
difference; only the rows a verdict shows (those past their allowance, and a tier's
worst) are detailed here, from the candidate-minus-truth difference: the index of the
greatest absolute and relative difference, the count of mismatched elements, the
expected and actual values there, NaN and inf counted apart, and for an update its
size and cosine against the full batch's.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import Tensor

from equiv.judging.reductions import _host_floats, _Scratch, _unravel
from equiv.results.verdict import TensorDiff

#: Scratch slots only detailing uses (see :func:`_detailed`), besides the difference itself.
_DETAIL_SLOTS = ("truth", "absolute", "flags")


#: Row width of :func:`_first_argmax`'s two-pass search (any width gives the same index).
_ARGMAX_ROW = 1024


def _first_argmax(values: Tensor) -> Tensor:
    """``values.argmax()`` (the flat index of the first greatest value; ``values``
    hold no NaN) as a 0-d long tensor.  On the CPU an argmax tracks an index per
    element and runs several times slower than a max: there, the greatest of each
    row of a flat view (one vectorised pass), the first row holding the greatest,
    and the argmax inside it (and a tail shorter than a row) give the same index."""
    flat = values.reshape(-1)
    rows = flat.numel() // _ARGMAX_ROW
    if flat.device.type != "cpu" or rows < 2:
        return flat.argmax()
    body = flat[: rows * _ARGMAX_ROW].view(rows, _ARGMAX_ROW)
    top = int(body.amax(dim=1).argmax())
    best = top * _ARGMAX_ROW + int(body[top].argmax())
    if rows * _ARGMAX_ROW < flat.numel():
        tail = rows * _ARGMAX_ROW + int(flat[rows * _ARGMAX_ROW :].argmax())
        best = best if bool(flat[best] >= flat[tail]) else tail  # equal: the body's comes first
    return torch.tensor(best, device=flat.device)


def _detailed(row: TensorDiff, difference: Tensor, truth: Tensor | None, scratch: _Scratch) -> TensorDiff:
    """``row`` with where its greatest differences are, its greatest relative
    difference, its count of mismatched elements, and what diagnoses it: the
    expected and actual value where the difference is greatest, NaN and inf
    counted apart (with the first one's index), and for an update its size
    against the full batch's (``<c, t> / <t, t>``) and its cosine; all from the
    candidate-minus-truth ``difference`` (a scratch buffer the next call reuses)."""
    if difference.numel() == 0:
        return dataclasses.replace(row, index=(), max_rel_diff=0.0, rel_index=())
    device = difference.device
    abs_diff = torch.abs(difference, out=scratch.get("absolute", difference.shape, device))
    if not math.isfinite(row.max_abs_diff):  # (a finite greatest difference: no NaN, no inf to map)
        abs_diff.nan_to_num_(nan=math.inf, posinf=math.inf)
    flat_abs = _first_argmax(abs_diff)
    is_update = row.quantity == "update" and truth is not None
    if truth is None:  # state the truth never has, compared with zeros: relative difference inf where not 0
        truth = torch.zeros_like(abs_diff)
    flags = scratch.get("flags", abs_diff.shape, device, torch.bool)
    # In this order: each step below reuses ``flags``, and the relative difference overwrites |diff|.
    mismatched = _mismatched(row, abs_diff, flags)
    rel_diff = _relative(abs_diff, truth, flags)
    flat_rel = _first_argmax(rel_diff)
    not_finite = _not_finite(row, difference, flags)
    # An update c = t + d against the truth t: <d, t>, <t, t>, <d, d> give its scale and cosine.
    products = _products(difference, truth) if is_update else [torch.zeros((), dtype=torch.float64, device=device)] * 3
    # All on the device, read in one transfer (torch.take: no host-side index).
    floats = _host_floats(
        [
            flat_abs.to(torch.float64),
            torch.take(rel_diff, flat_rel),
            flat_rel.to(torch.float64),
            mismatched.to(torch.float64),
            torch.take(truth, flat_abs),
            torch.take(difference, flat_abs),
            *(count.to(torch.float64) for count in not_finite),
            *products,
        ]
    )
    return _with_details(row, tuple(difference.shape), floats, is_update)


def _mismatched(row: TensorDiff, abs_diff: Tensor, flags: Tensor) -> Tensor:
    """How many elements are not within the row's allowance (a 0-d long tensor): past
    it, not finite, or against an allowance that is not a number (a NaN truth's scale;
    NaN differences are inf in ``abs_diff`` by now).  ``flags``: a bool scratch buffer."""
    if row.ok:
        return torch.zeros((), dtype=torch.long, device=abs_diff.device)
    # (A bool tensor's sum is several times slower on the CPU than counting its non-zeros.)
    within = torch.le(abs_diff, row.allowed, out=flags)
    if not math.isfinite(row.max_abs_diff):
        within.logical_and_(torch.isfinite(abs_diff))
    return abs_diff.numel() - torch.count_nonzero(within)


def _relative(abs_diff: Tensor, truth: Tensor, flags: Tensor) -> Tensor:
    """|diff| / |truth|, 0 where the two agree (0 / 0 included), inf where only the
    truth is 0.  |diff / truth| is |diff| / |truth| bit for bit; divided in place
    (``abs_diff`` is overwritten: |diff| is not needed after this), no buffer of its own."""
    # Whether the truth is finite, read on the CPU only (a GPU would wait for it: there
    # the masked pass below is cheap).  Finite where both ends are (NaN spreads to them).
    truth_finite = abs_diff.device.type == "cpu" and bool(torch.isfinite(torch.stack(truth.aminmax())).all())
    agree = None if truth_finite else torch.eq(abs_diff, 0, out=flags)
    rel_diff = torch.div(abs_diff, truth, out=abs_diff)
    if agree is None:
        # |diff| holds no NaN and the truth is finite: a NaN quotient is 0 / 0 (the two
        # agree) and nothing else, so it is 0, with no mask and no masked pass.
        rel_diff.abs_().nan_to_num_(nan=0.0, posinf=math.inf)
    else:
        rel_diff.abs_().nan_to_num_(nan=math.inf, posinf=math.inf)
        rel_diff.masked_fill_(agree, 0.0)
    return rel_diff


def _not_finite(row: TensorDiff, difference: Tensor, flags: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """NaN count, inf count and the flat index of the first of either (0-d long tensors):
    the truth is finite, so a non-finite difference is the candidate's.  None to count
    when the greatest difference is finite (NaN makes it inf)."""
    if math.isfinite(row.max_abs_diff):
        zero = torch.zeros((), dtype=torch.long, device=difference.device)
        return zero, zero, zero
    not_finite = torch.logical_not(torch.isfinite(difference), out=flags)
    nan_count = torch.count_nonzero(torch.isnan(difference))
    inf_count = torch.count_nonzero(not_finite) - nan_count
    first_not_finite = not_finite.flatten().to(torch.uint8).argmax()  # the first True (argmax takes the first)
    return nan_count, inf_count, first_not_finite


def _products(difference: Tensor, truth: Tensor) -> list[Tensor]:
    """<d, t>, <t, t> and <d, d> of the difference d and the truth t, 0-d where they live."""
    flat_difference, flat_truth = difference.flatten(), truth.flatten()
    return [
        torch.dot(flat_difference, flat_truth),
        torch.dot(flat_truth, flat_truth),
        torch.dot(flat_difference, flat_difference),
    ]


def _with_details(row: TensorDiff, shape: tuple[int, ...], floats: list[float], is_update: bool) -> TensorDiff:
    """``row`` with the details :func:`_detailed` read back, in its order."""
    index_abs, max_rel, index_rel, count, expected, signed, nans, infs, first_bad, dt, tt, dd = floats
    ct, cc = tt + dt, tt + 2 * dt + dd
    ratio = ct / tt if is_update and tt > 0 else math.nan
    cosine = ct / math.sqrt(cc * tt) if is_update and cc > 0 and tt > 0 else math.nan
    return dataclasses.replace(
        row,
        index=_unravel(int(index_abs), shape),
        max_rel_diff=max_rel,
        rel_index=_unravel(int(index_rel), shape),
        mismatched=int(count),
        expected=expected,
        actual=expected + signed,
        nan_count=int(nans),
        inf_count=int(infs),
        first_not_finite=_unravel(int(first_bad), shape) if nans or infs else (),
        update_ratio=ratio,
        cosine=cosine,
    )

"""The weights a run gave each micro-batch's loss, recovered from its gradient and named (issue 44).

Most accumulation bugs are one question: which weight did each micro-batch's
loss get?  With ``g_i`` the float64 gradient of micro-batch i's loss SUM (the
declared loss, replayed for the truth anyway) and ``G`` the gradient the run
accumulated (what the optimizer saw at its step), :func:`recover_weights` solves
``G ≈ Σ w_i g_i`` by least squares on the k x k Gram matrix of the ``g_i``, in
float64; :func:`name_normaliser` names ``w`` from one table
(:data:`equiv.zoo.kinds.NORMALISERS`, which holds ``equiv check``'s failure kinds
under their own names) and :func:`witness` puts both in a
:class:`~equiv.results.witness.Witness`.

Why 1 % is a safe tolerance for naming: the float64 solve moves ``w`` by about
the Gram's condition number times its rounding (``sqrt(P)`` float64 epsilons of
its largest entry, P the gradient's elements), and a run's own rounding of ``G``
(float32: ~1e-7 of it) moves ``w`` by at most ``||r|| / sqrt(λ_min)``, both
bounded together as :attr:`Recovered.uncertainty`; weights are called
identifiable only while that bound is under a tenth of the tolerance, so a
normaliser that fits the true weights within 1 % is never missed by more than
0.1 %, while the normalisers the table tells apart differ by far more on any
uneven window (mean of means against the full batch: ``N / (k n_i)``).  When
several fit (an even split makes the mean of means the full batch), all are
named.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from equiv.results.witness import CLIPPED_EACH, NOT_A_REWEIGHTING, NOT_IDENTIFIABLE, UNEXPLAINED, Witness
from equiv.zoo.kinds import FULL_BATCH, NORMALISERS, Normaliser, Window

__all__ = [
    "IDENTIFIABLE_UNCERTAINTY",
    "NAMING_TOLERANCE",
    "RESIDUAL_TOLERANCE",
    "Evidence",
    "Gradient",
    "Naming",
    "Recovered",
    "explained",
    "name_normaliser",
    "recover_weights",
    "row_gradients",
    "row_residual",
    "witness",
]

#: A micro-batch's gradient (or the accumulated one): one tensor, or one per parameter (None: no gradient, zero).
Gradient = Tensor | Sequence[Tensor | None]

#: Every weight within 1 % of a normaliser's names it.
NAMING_TOLERANCE = 0.01
#: Weights are identifiable while their uncertainty bound is under a tenth of the naming tolerance.
IDENTIFIABLE_UNCERTAINTY = NAMING_TOLERANCE / 10
#: Past this relative residual the run's gradient is not a re-weighting of the micro-batches' (a float32 run's
#: own rounding leaves ~1e-6; a bfloat16 autocast run's ~1e-2 is at the edge: pass a larger one for those).
RESIDUAL_TOLERANCE = 0.05
#: Rows split out of a window's micro-batches at most for the row refit (one backward each, on a failing window).
MAX_ROWS = 512
#: Elements of each gradient copied into the moments' block at once: 512 KiB of float64 a row, whatever the
#: model's size (in cache, where the product reads it k+1 times).
_CHUNK_ELEMENTS = 1 << 16


@dataclass(frozen=True)
class Recovered:
    """The least-squares weights of a window's micro-batches and how far to trust them."""

    #: the weight of each micro-batch's loss sum (None: the Gram is singular, the weights are not identifiable)
    weights: tuple[float, ...] | None
    #: ||G - Σ w_i g_i|| / ||G|| (0 when G is zero); defined even when the weights are not
    residual: float
    #: the Gram's largest eigenvalue over its smallest (inf: singular)
    condition: float
    #: the Gram's numerical rank (k when every micro-batch's gradient adds a direction)
    rank: int
    #: a bound on how far the weights may be off, relative to the largest: rounding of the solve plus a
    #: perturbation of G the size of the residual
    uncertainty: float

    @property
    def identifiable(self) -> bool:
        """Whether the weights are known to well within the naming tolerance."""
        return self.weights is not None and self.uncertainty <= IDENTIFIABLE_UNCERTAINTY


def _pieces(gradient: Gradient, what: str) -> list[Tensor | None]:
    if isinstance(gradient, Tensor):
        return [gradient]
    if isinstance(gradient, Sequence) and all(piece is None or isinstance(piece, Tensor) for piece in gradient):
        return list(gradient)
    raise TypeError(f"{what} must be a tensor or a sequence of tensors (one per parameter), got {gradient!r}")


def _moments(gradients: Sequence[Gradient], accumulated: Gradient) -> tuple[Tensor, int]:
    """[Gram (k*k), g_i·G (k), G·G (1)] in float64, summed over the pieces, and the elements counted."""
    k = len(gradients)
    micro = [_pieces(gradient, f"gradients[{i}]") for i, gradient in enumerate(gradients)]
    target = _pieces(accumulated, "accumulated")
    for i, pieces in enumerate(micro):
        if len(pieces) != len(target):
            raise ValueError(
                f"gradients[{i}] has {len(pieces)} tensors, expected {len(target)} (one per tensor of accumulated)"
            )
    device = next((p.device for p in [*target, *(q for pieces in micro for q in pieces)] if p is not None), None)
    largest = max((p.numel() for p in [*target, *(q for pieces in micro for q in pieces)] if p is not None), default=1)
    # One (k+1) x chunk float64 buffer, G its last row, reused for every chunk of every tensor: one product gives
    # the Gram, g_i·G and G·G together, on a block small enough to stay in cache, and nothing of the gradients'
    # size is allocated (a fresh stack per tensor cost more than its product).
    block = torch.empty(k + 1, max(1, min(largest, _CHUNK_ELEMENTS)), dtype=torch.float64, device=device)
    products = torch.zeros(k + 1, k + 1, dtype=torch.float64, device=device)
    elements = 0
    for index, wanted in enumerate(target):
        parts = [pieces[index] for pieces in micro]
        sizes = {p.numel() for p in [wanted, *parts] if p is not None}
        if len(sizes) > 1:
            raise ValueError(f"tensor {index} has {sorted(sizes)} elements across the gradients, expected one size")
        if not sizes:
            continue
        (size,) = sizes
        elements += size
        flats = [None if part is None else part.detach().reshape(-1) for part in [*parts, wanted]]
        for start in range(0, size, block.shape[1]):
            stop = min(size, start + block.shape[1])
            rows = block[:, : stop - start]
            for row, flat in zip(rows, flats, strict=True):
                if flat is None:
                    row.zero_()
                else:
                    row.copy_(flat[start:stop])
            products.addmm_(rows, rows.T)
    moments = torch.cat([products[:k, :k].reshape(-1), products[:k, k], products[k, k:]])
    return moments, elements


def recover_weights(
    gradients: Sequence[Gradient],
    accumulated: Gradient,
    *,
    all_reduce: Callable[[Tensor], object] | None = None,
) -> Recovered:
    """The weights ``w`` with ``accumulated ≈ Σ w_i gradients[i]``, by float64 least squares on the Gram matrix.

    Args:
        gradients: each micro-batch's gradient of its loss SUM (float64 for an exact witness): one tensor, or
            one per parameter (None where a parameter got none), the same layout for every micro-batch.
        accumulated: the gradient the run accumulated over the window, in the same layout (any float dtype).
        all_reduce: for sharded gradients (FSDP2, or a flat gradient split between processes), each process
            holding a shard of every gradient: called once with one float64 tensor (the Gram, the right-hand
            side and ``G·G`` of this shard) that it must sum in place over the shards, as
            ``torch.distributed.all_reduce`` does.  Leave it out for replicated gradients (DDP).

    Returns:
        The weights (None when the Gram is singular: duplicated micro-batches, fewer parameters than
        micro-batches), the relative residual, the Gram's condition number and rank, and a bound on the
        weights' error.

    Raises:
        ValueError: no micro-batches, or gradients whose layouts differ.
        TypeError: a gradient that is neither a tensor nor a sequence of tensors.
    """
    if len(gradients) == 0:
        raise ValueError("gradients is empty, expected one gradient per micro-batch")
    k = len(gradients)
    moments, elements = _moments(gradients, accumulated)
    if all_reduce is not None:
        all_reduce(moments)
        # the elements of every shard: the rounding floor grows with the whole gradient's size
        counted = torch.tensor([float(elements)], dtype=torch.float64, device=moments.device)
        all_reduce(counted)
        elements = int(counted.item())
    moments = moments.cpu()
    gram, rhs, norm_squared = moments[: k * k].view(k, k), moments[k * k : -1], float(moments[-1])
    gram = (gram + gram.T) / 2  # symmetric to the last bit before eigh
    eigenvalues, vectors = torch.linalg.eigh(gram)
    largest = float(eigenvalues[-1])
    smallest = float(eigenvalues[0])
    floor = 4 * torch.finfo(torch.float64).eps * math.sqrt(max(elements, 1))  # the Gram's own rounding, relative
    kept = eigenvalues > largest * floor if largest > 0 else torch.zeros(k, dtype=torch.bool)
    rank = int(kept.sum())
    projected = vectors.T @ rhs
    coefficients = torch.where(kept, projected / torch.where(kept, eigenvalues, 1.0), 0.0)
    solution = vectors @ coefficients
    explained = float((projected[kept] ** 2 / eigenvalues[kept]).sum()) if rank else 0.0
    residual_squared = max(0.0, norm_squared - explained)
    residual = math.sqrt(residual_squared / norm_squared) if norm_squared > 0 else 0.0
    condition = largest / smallest if smallest > 0 else math.inf
    if rank < k:
        return Recovered(None, residual, condition, rank, math.inf)
    largest_weight = float(solution.abs().max())
    if largest_weight == 0:
        uncertainty = 0.0 if residual_squared == 0 else math.inf
    else:
        uncertainty = condition * floor + math.sqrt(residual_squared / smallest) / largest_weight
    return Recovered(tuple(float(w) for w in solution), residual, condition, rank, uncertainty)


@dataclass(frozen=True)
class Naming:
    """The normalisers of the table that give a window's weights."""

    #: the name: the one that fits, several joined by " or ", or UNEXPLAINED
    name: str
    #: what the loop did, in one line
    means: str
    #: the weight of micro-batch i's loss sum ("1/n_i"); empty when unexplained
    formula: str
    #: every normaliser that fits, in the table's order (a uniform scale with its factor: "uniform scale x2")
    fits: tuple[str, ...]


def _scale_fitting(weights: Sequence[float], reference: Sequence[float], up_to_scale: bool) -> float | None:
    """The factor c with every weight within the tolerance of c x reference (1 unless up to a scale), or None."""
    scale = 1.0
    if up_to_scale:
        scale = sum(w * r for w, r in zip(weights, reference, strict=True)) / sum(r * r for r in reference)
        if scale <= 0:
            return None
    if all(abs(w - scale * r) <= NAMING_TOLERANCE * abs(scale * r) for w, r in zip(weights, reference, strict=True)):
        return scale
    return None


def _window(
    k: int,
    items: Sequence[float],
    configured_n: int | None,
    ranks: Sequence[int] | None,
    rows: Sequence[int] | None,
) -> Window:
    if len(items) != k:
        raise ValueError(f"items has {len(items)} counts, expected {k} (one per micro-batch)")
    if any(not (math.isfinite(count) and count > 0) for count in items):
        raise ValueError(f"items must be positive counts of each micro-batch's items, got {list(items)}")
    if configured_n is not None and (isinstance(configured_n, bool) or not isinstance(configured_n, int)):
        raise ValueError(f"configured_n must be the configured micro-batches per step (an int), got {configured_n!r}")
    if configured_n is not None and configured_n < 1:
        raise ValueError(f"configured_n must be at least 1, got {configured_n}")
    if ranks is not None and len(ranks) != k:
        raise ValueError(f"ranks has {len(ranks)} entries, expected {k} (the rank of each micro-batch)")
    if rows is not None and (len(rows) != k or any(row < 0 for row in rows)):
        raise ValueError(f"rows must be {k} non-negative row counts (one per micro-batch), got {list(rows)}")
    return Window(
        tuple(float(count) for count in items),
        configured_n,
        None if ranks is None else tuple(ranks),
        None if rows is None else tuple(rows),
    )


def name_normaliser(
    weights: Sequence[float],
    items: Sequence[float],
    *,
    configured_n: int | None,
    ranks: Sequence[int] | None = None,
    rows: Sequence[int] | None = None,
    clipped: bool = False,
) -> Naming:
    """Which normalisers of :data:`equiv.zoo.kinds.NORMALISERS` give ``weights`` on this window (every weight
    within 1 %).

    Args:
        weights: the weight of each micro-batch's loss sum (:attr:`Recovered.weights`).
        items: the items (samples, tokens) of each micro-batch's loss.
        configured_n: the micro-batches per optimizer step the run was configured with (None: not known; a
            window shorter than it can be "tail divided by N").
        ranks: the rank each micro-batch ran on (a per-rank mean needs them).
        rows: the rows of each micro-batch (a count off by one per row needs them).
        clipped: the run clipped the window's gradient, so its scale is the clip's: compare directions only.

    Returns:
        The name (several that fit joined by " or ", or "a re-weighting no known normaliser explains"), what
        it means, its formula and every normaliser that fits.

    Raises:
        ValueError: weights, items, ranks or rows of different lengths, or counts that are not positive.
    """
    window = _window(len(weights), items, configured_n, ranks, rows)
    found: list[tuple[Normaliser, float]] = []
    for normaliser in NORMALISERS:
        if clipped and normaliser.up_to_scale:
            continue  # the full batch up to a scale: under a clip, the full batch itself
        reference = normaliser.weights(window)
        if reference is None:
            continue
        scale = _scale_fitting(weights, reference, up_to_scale=clipped or normaliser.up_to_scale)
        if scale is None:
            continue
        if normaliser.up_to_scale and (found or abs(scale - 1) <= NAMING_TOLERANCE):
            continue  # a factor only named when nothing of the table explains it (and not 1: the full batch)
        found.append((normaliser, scale))
    if not found:
        return Naming(UNEXPLAINED, UNEXPLAINED, "", ())
    names = tuple(f"{n.name} x{scale:.3g}" if n.up_to_scale else n.name for n, scale in found)
    first, scale = found[0]
    means = first.means + (" (up to the clip's scale)" if clipped else "")
    if len(names) > 1:
        means += f"; on this window the same weights as {', '.join(names[1:])}"
    formula = first.formula.replace("c", f"{scale:.3g}") if first.up_to_scale else first.formula
    return Naming(" or ".join(names), means, formula, names)


def witness(
    recovered: Recovered,
    items: Sequence[float],
    *,
    configured_n: int | None,
    ranks: Sequence[int] | None = None,
    rows: Sequence[int] | None = None,
    clipped: bool = False,
    residual_tolerance: float = RESIDUAL_TOLERANCE,
) -> Witness:
    """The witness of a window: the recovered weights beside the full batch's, named.

    Args:
        recovered: what :func:`recover_weights` found for the window.
        items, configured_n, ranks, rows, clipped: as :func:`name_normaliser` takes them.
        residual_tolerance: the relative residual past which the run's gradient is not a re-weighting of the
            micro-batches' (raise it for a low-precision run, whose rounding the residual holds).

    Returns:
        A :class:`~equiv.results.witness.Witness`: not a re-weighting when the residual is past the tolerance,
        not identifiable when the weights are not, else the normaliser named (or none explains them).

    Raises:
        ValueError: items, ranks or rows that do not match the window (as :func:`name_normaliser`).
    """
    k = len(items)
    window = _window(k, items, configured_n, ranks, rows)
    full_batch = tuple(FULL_BATCH.weights(window) or ())
    if recovered.weights is not None and len(recovered.weights) != k:
        raise ValueError(f"items has {k} counts, expected {len(recovered.weights)} (one per recovered weight)")

    def made(run: tuple[float, ...] | None, name: str, means: str, formula: str = "") -> Witness:
        return Witness(
            run, full_batch, recovered.residual, name, means, formula, window.counts, window.ranks, recovered.condition
        )

    if recovered.residual > residual_tolerance:
        return made(recovered.weights, NOT_A_REWEIGHTING, "the run's gradient is not a re-weighting of micro-batches")
    if recovered.weights is None:
        return made(None, NOT_IDENTIFIABLE, "their gradients are linearly dependent")
    if not recovered.identifiable:
        # Full rank, but the part of G no re-weighting explains (a low-precision run's rounding, say) moves the
        # solved weights past what naming may trust: said as that, not as dependent gradients.
        return made(
            None,
            NOT_IDENTIFIABLE,
            f"{recovered.residual:.2%} of the run's gradient is no re-weighting of them (rounding of a low-precision "
            "run, or a small difference of another kind), which leaves them uncertain past naming",
        )
    naming = name_normaliser(
        recovered.weights, items, configured_n=configured_n, ranks=ranks, rows=rows, clipped=clipped
    )
    return made(recovered.weights, naming.name, naming.means, naming.formula)


@dataclass(frozen=True)
class Evidence:
    """What equiv recorded or measured of a failing window beyond its micro-batches' gradients, to say which
    explanation a residual past the tolerance (or weights no normaliser explains) supports."""

    #: the micro-batches of the window (a clip recorded after fewer of them ran between two of their backwards)
    micro_batches: int
    #: each clip call of the window on the model's parameters: (torch's function, the micro-batches recorded
    #: before it); None where clip calls were not watched
    clips: tuple[tuple[str, int], ...] | None = None
    #: ||G - Σ w_r g_r|| / ||G|| over every row's (sequence's) gradient of the declared loss: a small one says
    #: the weighting is per row; None where it was not measured
    row_residual: float | None = None
    #: why the rows were not split (where ``row_residual`` is None)
    rows_unmeasured: str = "the rows were not split"

    def clipped_between(self) -> tuple[str, ...]:
        """The clip functions called before the window's last micro-batch ran (between its backwards)."""
        return tuple(name for name, after in self.clips or () if after < self.micro_batches)


def row_gradients(output: Tensor, target: Tensor, loss: Any, leaves: Sequence[Tensor]) -> list[list[Tensor | None]]:
    """Each row's (sequence's) gradient of the declared loss sum, from one forward of a micro-batch: the loss
    of ``output[r:r+1]`` against ``target[r:r+1]``, differentiated through the whole micro-batch's forward (so
    a weighting of rows inside the micro-batch is a weighting of these).

    Raises:
        ValueError: output and target without one row dimension, or rows whose loss sums do not add up to the
            micro-batch's (a loss that is not a sum over rows: packed or cross-row targets).
    """
    rows = int(target.shape[0]) if target.dim() else 0
    if rows < 1 or output.dim() == 0 or int(output.shape[0]) != rows:
        raise ValueError(f"output {tuple(output.shape)} and target {tuple(target.shape)} share no row dimension")
    sums = [loss.sum(output[row : row + 1], target[row : row + 1]) for row in range(rows)]
    whole = float(loss.sum(output, target).detach())
    added = float(sum(float(each.detach()) for each in sums))
    if abs(added - whole) > 1e-9 * max(abs(whole), 1e-300) + 1e-12:
        raise ValueError(
            f"the rows' loss sums add to {added:.6g}, the micro-batch's is {whole:.6g}: not a sum over rows"
        )
    return [list(torch.autograd.grad(each, list(leaves), retain_graph=True, allow_unused=True)) for each in sums]


def row_residual(rows: Sequence[Gradient], accumulated: Gradient) -> tuple[float | None, str]:
    """The residual of ``accumulated`` fitted on the rows' gradients, or None and why it says nothing: more
    rows than half the gradient's elements span nearly any gradient."""
    if not rows:
        return None, "no row had an item to count"
    elements = sum(piece.numel() for piece in _pieces(accumulated, "accumulated") if piece is not None)
    if 2 * len(rows) > elements:
        return None, f"{len(rows)} rows against {elements} gradient elements span nearly any gradient"
    return recover_weights(rows, accumulated).residual, ""


def explained(found: Witness, evidence: Evidence, *, residual_tolerance: float = RESIDUAL_TOLERANCE) -> Witness:
    """``found`` with what ``evidence`` supports said: weights no normaliser explains from a run seen clipping
    between micro-batches named :data:`~equiv.results.witness.CLIPPED_EACH`; a residual past the tolerance
    explained by a clip recorded between micro-batches, else by a re-weighting of rows (a small row residual),
    else as a different loss.  Only what was recorded or measured is said ("no clip call was recorded" too)."""
    between = evidence.clipped_between()
    if found.normaliser == UNEXPLAINED and between:
        means = (
            f"the running gradient clipped after each micro-batch ({len(between)} {_calls(between)} before the "
            "window's last; transformers #986): earlier micro-batches scaled down more often"
        )
        return dataclasses.replace(found, normaliser=CLIPPED_EACH, means=means)
    if found.normaliser != NOT_A_REWEIGHTING:
        return found
    by_value = [name for name, _ in evidence.clips or () if name == "clip_grad_value_"]
    if between:
        said = (
            f"clipped per micro-batch: {len(between)} {_calls(between)} recorded before the window's last "
            "micro-batch (a clip of some tensors or by value there is no re-weighting)"
        )
    elif by_value:
        said = "clamped by value: clip_grad_value_ recorded after the last micro-batch (elementwise, no re-weighting)"
    else:
        seen = "" if evidence.clips is None else "no clip call was recorded between micro-batches, and "
        if evidence.row_residual is None:
            said = f"{seen}another loss or a weighting inside micro-batches ({evidence.rows_unmeasured})"
        elif evidence.row_residual <= residual_tolerance:
            said = (
                f"a weighting of rows inside micro-batches: {seen}a re-weighting of each row's gradient of the "
                f"declared loss leaves {evidence.row_residual:.2%} (a per-row or per-sequence normalisation of "
                "its tokens)"
            )
        else:
            said = (
                f"a loss other than the declared one: {seen}no re-weighting of each row's gradient of the declared "
                f"loss explains it either ({evidence.row_residual:.0%} left; weights of single tokens inside a row "
                "were not fitted)"
            )
    return dataclasses.replace(found, explanation=said)


def _calls(names: Sequence[str]) -> str:
    """The clip functions of ``names`` as the count before it reads: "clip_grad_norm_ calls"."""
    kinds = sorted(set(names))
    return f"{' / '.join(kinds)} call{'s' if len(names) > 1 else ''}"

"""The witness of a failing audited window (issue 44): the weight the run gave each micro-batch's loss.

Run only after a window's verdict says it is not equivalent, so a passing window pays nothing.
``G`` is the gradient the run accumulated, read from the user's parameters after the step (the
audit judges inside the optimizer's post-step hook, before the loop's ``zero_grad``; a stock
optimizer leaves ``.grad`` as its pre-step hook saw it).  ``g_i`` is the float64 gradient of each
recorded micro-batch's loss SUM (the declared ``loss=``), replayed one micro-batch at a time at
the window's starting parameters; :func:`equiv.judging.witness.recover_weights` solves
``G ≈ Σ w_i g_i`` and :func:`equiv.judging.witness.witness` names ``w``.

Under DDP every rank holds the same ``G`` and its own micro-batches: the ranks' ``g_i`` are summed
into one zero-padded stack by the audit's own all-reduce, each rank then takes the Gram of one
slice of the elements and the slices' Gram sums are reduced with the same all-reduce, so every
rank names the same weights (none when the ranks hold different gradients: a sync left off).  A micro-batch with no item to count has a zero gradient (any weight
fits it): it is left out.

Under FSDP2 each rank holds a shard of ``G`` (the local tensors of the DTensor gradients) and the Gram's
inner products are sums over the shards.  This rank's shard of every rank's ``g_i`` comes from a float64
copy sharded as the run's (the truth's :meth:`~equiv.auditing.ranks.Ranks.sharded_replica`): one
forward and backward per micro-batch of any rank, every rank taking part (FSDP2's all-gathers and
reduce-scatters are collectives), the micro-batch's owner back-propagating its loss sum times the world
(FSDP2 averages what it reduce-scatters) and every other rank zero times one of its own, so each rank's
shard is of that micro-batch's gradient alone; no rank holds a whole gradient, and no input leaves its
rank.  The shards' Gram sums are then reduced by the audit's all-reduce.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import Tensor, nn

from equiv.auditing.deepspeed import ZeroOptimizer
from equiv.auditing.ranks import Ranks, local
from equiv.auditing.replay import RecordedWindow, WindowReplay, model_at
from equiv.auditing.replay import _cast as cast_to  # floating tensors only, as the truth's replay casts
from equiv.judging.witness import (
    MAX_ROWS,
    Evidence,
    Recovered,
    explained,
    recover_weights,
    row_gradients,
    row_residual,
    witness,
)
from equiv.results.witness import NOT_A_REWEIGHTING, NOT_IDENTIFIABLE, UNEXPLAINED, Witness

__all__ = ["window_witness"]

#: Why a multi-process witness says no row refit: the rows' gradients would be gathered from every rank.
_ACROSS_RANKS = "rows are not split across ranks"
#: A run's clipped gradient norm is the limit up to its rounding; a norm this far below it was not clipped.
_CLIP_ACTIVE_TOLERANCE = 1e-3


def _flat_gradient(params: list[nn.Parameter]) -> Tensor:
    """The parameters' gradients as one float64 vector (zeros where a parameter got none)."""
    return torch.cat(
        [
            (torch.zeros_like(p, dtype=torch.float64) if p.grad is None else p.grad.detach().to(torch.float64)).reshape(
                -1
            )
            for p in params
        ]
    )


def _zero_or(gradient: Tensor | None, param: Tensor) -> Tensor:
    return torch.zeros_like(param, dtype=torch.float64) if gradient is None else gradient


def _micro_batch_gradients(
    window: RecordedWindow, replay: WindowReplay
) -> tuple[list[list[Tensor | None]], list[float], list[int] | None]:
    """Each micro-batch's float64 gradient of its loss sum at the window's start (its own tensors, one per
    parameter: set to None before each backward, so none is copied), its items, and its rows where its
    targets are per token (rows x positions: a count off by one per row, labels counted before the shift, is
    then nameable; None otherwise); micro-batches with no item to count left out."""
    model = model_at(replay.template, window, torch.float64)
    params = list(model.parameters())
    gradients: list[list[Tensor | None]] = []
    items: list[float] = []
    rows: list[int] | None = []
    for call in window.calls:
        target = cast_to(replay.targets_of(call), torch.float64)
        count = float(replay.loss.count(target))
        if not count > 0:
            continue
        model.zero_grad(set_to_none=True)
        output = replay.output_of(replay.call_model(model, cast_to(call, torch.float64)))
        replay.loss.sum(output.to(torch.float64), target).backward()
        gradients.append([p.grad for p in params])
        items.append(count)
        rows = [*rows, int(target.shape[0])] if rows is not None and target.dim() >= 2 else None
    return gradients, items, rows


def _gathered(ranks: Ranks, gradients: list[Tensor], items: list[float], size: int) -> tuple[Tensor, Tensor, list[int]]:
    """Every rank's micro-batch gradients stacked in rank order (one all-reduce of a zero-padded stack),
    their items, and the rank of each."""
    counts = torch.zeros(ranks.world_size, dtype=torch.float64)
    counts[ranks.rank] = len(gradients)
    ranks.all_reduce(counts)
    per_rank = [int(count) for count in counts.tolist()]
    offset, total = sum(per_rank[: ranks.rank]), sum(per_rank)
    stack = torch.zeros(total, size + 1, dtype=torch.float64)  # the last column: each micro-batch's items
    for index, (gradient, count) in enumerate(zip(gradients, items, strict=True)):
        stack[offset + index, :size] = gradient
        stack[offset + index, size] = count
    ranks.all_reduce(stack)
    owners = [rank for rank, count in enumerate(per_rank) for _ in range(count)]
    return stack[:, :size], stack[:, size], owners


def _same_on_every_rank(ranks: Ranks, accumulated: Tensor) -> bool:
    """Whether every rank holds the same accumulated gradient (DDP's all-reduce ran), by one projection on a
    fixed random direction: R Σ x_r² = (Σ x_r)² only when every x_r is the same (two numbers sent)."""
    direction = torch.randn(accumulated.numel(), generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    projection = float(direction @ accumulated)
    sums = torch.tensor([projection, projection * projection], dtype=torch.float64)
    ranks.all_reduce(sums)
    spread = ranks.world_size * float(sums[1]) - float(sums[0]) ** 2  # R² times the projections' variance
    return spread <= 1e-12 * ranks.world_size * float(sums[1])


def _per_rank(ranks: Ranks, count: int, *, stepped: bool) -> tuple[list[int], bool]:
    """Every rank's micro-batch count (``count`` this rank's) and whether any rank's optimizer got a gradient
    (``stepped`` this rank's), in one all-reduce."""
    counts = torch.zeros(ranks.world_size + 1, dtype=torch.float64)
    counts[ranks.rank] = count
    counts[-1] = float(stepped)
    ranks.all_reduce(counts)
    return [int(each) for each in counts[:-1].tolist()], bool(counts[-1] > 0)


def _sharded_gradients(
    window: RecordedWindow, replay: WindowReplay, ranks: Ranks
) -> tuple[list[str], list[Tensor], list[float], list[int]] | None:
    """This rank's shard of the float64 loss-sum gradient of every rank's micro-batches (flat, the parameters
    in the order of the names returned first, the micro-batches in rank order), their items and owners, on a
    copy sharded as the run's: one pass per micro-batch of any rank, every rank in it (FSDP2's collectives),
    only the owner's loss counted; micro-batches with no item left out.  None where no rank's optimizer got a
    gradient (FSDP2's sync left off on every micro-batch: the shards were never reduce-scattered): no ``G``."""
    targets = [cast_to(replay.targets_of(call), torch.float64) for call in window.calls]
    counts = [float(replay.loss.count(target)) for target in targets]
    mine = [position for position, count in enumerate(counts) if count > 0]
    stepped = any(param.grad is not None for param in replay.model.parameters())
    per_rank, anywhere = _per_rank(ranks, len(mine), stepped=stepped)
    if not anywhere:
        return None
    replica = ranks.sharded_replica(replay.template, window.start_params, window.start_buffers, torch.float64)
    params = dict(replica.named_parameters())
    passes = [(owner, index) for owner, count in enumerate(per_rank) for index in range(count)]
    # a rank's pass on another's micro-batch runs one of its own (with items if it has one) and back-propagates
    # zero times its output (never its loss: a loss over no item may be NaN, and NaN times zero is no zero);
    # FSDP2 averages its reduce-scatter over the ranks, so the owner's loss sum is taken times the world
    idle = mine[0] if mine else 0
    shards: list[Tensor] = []
    items = torch.zeros(len(passes), dtype=torch.float64)  # each micro-batch's items, known to its owner only
    for number, (owner, index) in enumerate(passes):
        owned = owner == ranks.rank
        position = mine[index] if owned else idle
        replica.zero_grad(set_to_none=True)
        with ranks.counting_fsdp():
            output = replay.output_of(replay.call_model(replica, cast_to(window.calls[position], torch.float64)))
            if owned:
                (replay.loss.sum(output.to(torch.float64), targets[position]) * float(ranks.world_size)).backward()
            else:
                (output.sum() * 0.0).backward()
        shards.append(torch.cat([_local_gradient(param).reshape(-1) for param in params.values()]))
        items[number] = counts[position] if owned else 0.0
    if passes:
        ranks.all_reduce(items)
    return list(params), shards, items.tolist(), [owner for owner, _ in passes]


def _local_gradient(param: Tensor) -> Tensor:
    """This rank's shard of ``param``'s gradient in float64 (zeros where it got none)."""
    return _zero_or(None if param.grad is None else local(param.grad).detach().to(torch.float64), local(param))


def _sharded_witness(
    window: RecordedWindow, replay: WindowReplay, ranks: Ranks, clips: tuple[tuple[str, int], ...] | None
) -> Witness | None:
    """The witness of an FSDP2 run's failing window: ``G`` is this rank's shards of the run's gradient, the
    ``g_i`` this rank's shards of every rank's micro-batches' (:func:`_sharded_gradients`), the Gram summed
    over the shards by the audit's all-reduce; the same weights on every rank."""
    gathered = _sharded_gradients(window, replay, ranks)
    if gathered is None or not gathered[3]:
        return None  # no gradient stepped, or no micro-batch with an item to count
    names, shards, items, owners = gathered
    run_params = dict(replay.model.named_parameters())
    accumulated = torch.cat([_local_gradient(run_params[name]).reshape(-1) for name in names])
    clipped = replay.max_grad_value is not None
    if replay.max_grad_norm is not None:  # the run's global norm: its shards' squares summed over the ranks
        squares = (accumulated @ accumulated).reshape(1)
        ranks.all_reduce(squares)
        clipped = clipped or _clip_acted(replay.max_grad_norm, math.sqrt(float(squares)))
    recovered = recover_weights(shards, accumulated, all_reduce=ranks.all_reduce)
    found = witness(recovered, items, configured_n=None, ranks=owners, clipped=clipped)
    return explained(found, Evidence(len(window.calls), clips, rows_unmeasured=_ACROSS_RANKS))


def _clip_acted(max_grad_norm: float, norm: float) -> bool:
    """Whether a clip by norm acted: it leaves G at exactly the limit when it does; below it (0.1 % for the
    run's rounding) it did not, and the weights are compared as they are, not only in direction."""
    return norm >= max_grad_norm * (1 - _CLIP_ACTIVE_TOLERANCE)


def window_witness(
    window: RecordedWindow,
    replay: WindowReplay,
    *,
    configured_n: int | None,
    clips: tuple[tuple[str, int], ...] | None = None,
    engine_steps: int | None = None,
) -> Witness | None:
    """The witness of a failing window: the weights the run applied to its micro-batches, named.

    Args:
        window: the window just stepped (its calls, its start).
        replay: how the run is replayed (the user's model, whose ``.grad`` still holds the run's ``G``).
        configured_n: the run's usual micro-batches per step (a shorter window may be "tail divided by N").
        clips: each clip call the audit recorded in the window, (torch's function, the forward calls recorded
            before it): the evidence of clipping between micro-batches (None: not watched).
        engine_steps: the accumulation steps an engine divides every micro-batch's loss by on its own (DeepSpeed's
            ``engine.backward``): weights no normaliser explains are named again with that division undone.

    Returns:
        The :class:`~equiv.results.witness.Witness`, or None where none is made: a window with no item to
        count, or DDP ranks holding different gradients.  Under DDP and FSDP2 every rank must call it together.
    """
    found = _found(window, replay, configured_n, clips)
    return found if found is None or not engine_steps else _after_engine_division(found, engine_steps)


def _after_engine_division(found: Witness, steps: int) -> Witness:
    """``found`` named again with an engine's division of every micro-batch's loss by ``steps`` undone, where no
    normaliser explains its weights as they are (a per-rank token mean under DeepSpeed is one divided again by
    its gradient_accumulation_steps), and the division said; else ``found`` as it is."""
    if found.normaliser != UNEXPLAINED or found.run is None or steps == 1:
        return found
    undone = Recovered(
        tuple(weight * steps for weight in found.run), found.residual, found.condition, len(found.run), 0.0
    )
    again = witness(undone, found.items, configured_n=None, ranks=found.ranks)
    if again.normaliser in (UNEXPLAINED, NOT_A_REWEIGHTING, NOT_IDENTIFIABLE):
        return found
    return dataclasses.replace(
        found,
        normaliser=again.normaliser,
        means=f"{again.means}, then divided by gradient_accumulation_steps={steps} by DeepSpeed's engine.backward",
        formula=f"({again.formula})/{steps}" if again.formula else "",
    )


def _found(
    window: RecordedWindow,
    replay: WindowReplay,
    configured_n: int | None,
    clips: tuple[tuple[str, int], ...] | None,
) -> Witness | None:
    """The witness as the run's weights name it (:func:`window_witness`, before an engine's division)."""
    ranks = replay.ranks
    if ranks is not None and ranks.sharded:
        return _sharded_witness(window, replay, ranks, clips)
    if isinstance(replay.optimizer, ZeroOptimizer):
        return _zero_witness(window, replay, replay.optimizer, clips)
    gradients, items, rows = _micro_batch_gradients(window, replay)
    run_params = list(replay.model.parameters())
    norm = math.sqrt(sum(float(p.grad.detach().double().square().sum()) for p in run_params if p.grad is not None))
    # only a clip that acted makes the weights comparable in direction only (the scale is the clip's then)
    clipped = replay.max_grad_value is not None or (
        replay.max_grad_norm is not None and _clip_acted(replay.max_grad_norm, norm)
    )
    if ranks is None:
        if not gradients:
            return None
        recovered = recover_weights(gradients, [p.grad for p in run_params])  # per parameter: nothing copied
        found = witness(recovered, items, configured_n=configured_n, rows=rows, clipped=clipped)
        return explained(found, _evidence(window, replay, clips, found))
    accumulated = _flat_gradient(run_params)
    if not _same_on_every_rank(ranks, accumulated):
        return None  # the ranks stepped different gradients (a sync left off): no one G to re-weight
    flat = [
        torch.cat([_zero_or(g, p).reshape(-1) for g, p in zip(pieces, run_params, strict=True)]) for pieces in gradients
    ]
    stack, counts, owners = _gathered(ranks, flat, items, accumulated.numel())
    if not owners:
        return None
    # each rank the Gram of its slice of the elements, the slices' sums reduced by the audit's all-reduce
    size = accumulated.numel()
    low, high = size * ranks.rank // ranks.world_size, size * (ranks.rank + 1) // ranks.world_size
    recovered = recover_weights([row[low:high] for row in stack], accumulated[low:high], all_reduce=ranks.all_reduce)
    found = witness(recovered, counts.tolist(), configured_n=None, ranks=owners, clipped=clipped)
    return explained(found, Evidence(len(window.calls), clips, rows_unmeasured=_ACROSS_RANKS))


def _zero_witness(
    window: RecordedWindow, replay: WindowReplay, zero: ZeroOptimizer, clips: tuple[tuple[str, int], ...] | None
) -> Witness | None:
    """The witness of a failing window under DeepSpeed ZeRO 1/2: ``G`` is this rank's partitions of the gradient
    its optimizer stepped (DeepSpeed's averaged and clipped one, captured by the inner optimizer's pre-step hook),
    the ``g_i`` every rank's micro-batches' float64 loss-sum gradients (gathered as under DDP) cut into this rank's
    partitions by DeepSpeed's layout; the Gram summed over the ranks' partitions by the audit's all-reduce."""
    if not zero.gradients:
        return None  # DeepSpeed stepped no gradient this window (none captured)
    gradients, items, _ = _micro_batch_gradients(window, replay)
    named = list(replay.template.named_parameters())
    accumulated = torch.cat([zero.gradients[name].to(torch.float64).reshape(-1) for name in zero.layout.names()])
    flat = [
        torch.cat([_zero_or(g, p).reshape(-1) for g, (_, p) in zip(pieces, named, strict=True)]) for pieces in gradients
    ]
    ranks = replay.ranks
    if ranks is not None:
        stack, counts, owners = _gathered(ranks, flat, items, sum(p.numel() for _, p in named))
        rows, items, kept_owners = list(stack), counts.tolist(), owners
    else:
        rows, kept_owners = flat, None
    if not rows:
        return None
    cut = [torch.cat(zero.layout.partitions(_by_name(row, named), torch.float64)) for row in rows]
    reduce = None if ranks is None else ranks.all_reduce
    squares = (accumulated @ accumulated).reshape(1)
    if reduce is not None:
        reduce(squares)
    clipped = replay.max_grad_value is not None or (
        replay.max_grad_norm is not None and _clip_acted(replay.max_grad_norm, math.sqrt(float(squares)))
    )
    recovered = recover_weights(cut, accumulated, all_reduce=reduce)
    found = witness(recovered, items, configured_n=None, ranks=kept_owners, clipped=clipped)
    return explained(found, Evidence(len(window.calls), clips, rows_unmeasured=_ACROSS_RANKS))


def _by_name(flat: Tensor, named: list[tuple[str, nn.Parameter]]) -> dict[str, Tensor]:
    """A flat vector over ``named``'s parameters (in their order), cut back into one tensor per name."""
    pieces, offset = {}, 0
    for name, param in named:
        pieces[name] = flat[offset : offset + param.numel()].view(param.shape)
        offset += param.numel()
    return pieces


def _evidence(
    window: RecordedWindow, replay: WindowReplay, clips: tuple[tuple[str, int], ...] | None, found: Witness
) -> Evidence:
    """What supports one explanation of a failing window: its clip calls, and, only past the residual tolerance,
    the residual of G refitted on every row's gradient of the declared loss (one more backward per row)."""
    if found.normaliser != NOT_A_REWEIGHTING:
        return Evidence(len(window.calls), clips)
    try:
        rows = _row_gradients(window, replay)
    except ValueError as why:
        return Evidence(len(window.calls), clips, rows_unmeasured=f"the rows were not split: {why}")
    residual, why_not = row_residual(rows, [p.grad for p in replay.model.parameters()])
    return Evidence(len(window.calls), clips, residual, f"the rows were not split: {why_not}")


def _row_gradients(window: RecordedWindow, replay: WindowReplay) -> list[list[Tensor | None]]:
    """Every row's float64 gradient of the declared loss sum at the window's start, micro-batch by micro-batch
    (:func:`equiv.judging.witness.row_gradients`); rows with no item to count left out.

    Raises:
        ValueError: micro-batches whose output and targets cannot be split into rows, or more than MAX_ROWS rows.
    """
    model = model_at(replay.template, window, torch.float64)
    params = list(model.parameters())
    rows: list[list[Tensor | None]] = []
    for call in window.calls:
        target = cast_to(replay.targets_of(call), torch.float64)
        if not float(replay.loss.count(target)) > 0:
            continue
        output = replay.output_of(replay.call_model(model, cast_to(call, torch.float64))).to(torch.float64)
        if len(rows) + int(target.shape[0] if target.dim() else 0) > MAX_ROWS:
            raise ValueError(f"more than {MAX_ROWS} rows in the window")
        rows.extend(
            gradient
            for gradient, row in zip(row_gradients(output, target, replay.loss, params), target, strict=True)
            if float(replay.loss.count(row.unsqueeze(0))) > 0
        )
    return rows

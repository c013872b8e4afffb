"""Compare a candidate's trajectory with the float64 truth, tensor by tensor.

What is compared per step: the cumulative update of every parameter
(p_k - p_0, not the raw parameter: an absolute tolerance on parameters hides
small updates), floating buffers the same way, and every optimizer state
tensor.  Each gets its own allowance (see :mod:`equiv.checking.tolerances`).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from equiv.checking.tolerances import allowance
from equiv.checking.trajectory import Snapshot
from equiv.checking.verdict import TensorDiff, Tier

__all__ = ["compare_trajectories"]


def _unravel(flat_index: int, shape: torch.Size) -> tuple[int, ...]:
    return tuple(int(i) for i in torch.unravel_index(torch.tensor(flat_index), shape)) if shape else ()


def _max_abs(tensor: Tensor) -> float:
    return float(tensor.abs().max()) if tensor.numel() else 0.0


def _diff(
    *,
    step: int,
    name: str,
    kind: str,
    tier: Tier,
    dtype: torch.dtype,
    candidate: Tensor | None,
    truth: Tensor,
    floor_runs: list[Tensor],
    floor_scales: list[float],
    scale: float,
) -> TensorDiff:
    floor = max(_max_abs(run - truth) * factor for run, factor in zip(floor_runs, floor_scales, strict=True))
    budget = allowance(floor=floor, dtype=dtype, scale=scale, steps=step)
    dtype_name = str(dtype).removeprefix("torch.")
    if candidate is None or candidate.shape != truth.shape:
        # Missing state (e.g. the optimizer never stepped) or a reshaped tensor.
        return TensorDiff(step, name, kind, tier, dtype_name, math.inf, (), math.inf, (),  # type: ignore[arg-type]
                          budget.allowed, budget.explain(), max(truth.numel(), 1), max(truth.numel(), 1))
    # NaN anywhere is as far from the truth as it gets.
    abs_diff = torch.nan_to_num((candidate - truth).abs(), nan=math.inf, posinf=math.inf)
    rel_diff = abs_diff / truth.abs()
    rel_diff = torch.where(abs_diff == 0, torch.zeros_like(rel_diff), torch.nan_to_num(rel_diff, nan=math.inf, posinf=math.inf))
    flat_abs = int(abs_diff.argmax()) if abs_diff.numel() else 0
    flat_rel = int(rel_diff.argmax()) if rel_diff.numel() else 0
    return TensorDiff(
        step=step,
        name=name,
        kind=kind,  # type: ignore[arg-type]
        tier=tier,
        dtype=dtype_name,
        max_abs_diff=float(abs_diff.flatten()[flat_abs]) if abs_diff.numel() else 0.0,
        index=_unravel(flat_abs, abs_diff.shape),
        max_rel_diff=float(rel_diff.flatten()[flat_rel]) if rel_diff.numel() else 0.0,
        rel_index=_unravel(flat_rel, rel_diff.shape),
        allowed=budget.allowed,
        explanation=budget.explain(),
        mismatched=int((abs_diff > budget.allowed).sum()),
        numel=truth.numel(),
    )


def compare_trajectories(
    *,
    tier: Tier,
    dtype: torch.dtype,
    truth: list[Snapshot],
    floor_runs: list[list[Snapshot]],
    floor_scales: list[float],
    candidate: list[Snapshot],
) -> list[TensorDiff]:
    """Every tensor at every step (1-based) of ``candidate`` against ``truth``.

    ``floor_runs``: full-batch runs whose distance from the truth, times the
    matching ``floor_scales`` entry, estimates the floor a correct candidate
    may reach; the largest estimate counts.
    """
    out: list[TensorDiff] = []

    def deltas(run: list[Snapshot], step: int, name: str, kind: str) -> Tensor:
        if kind == "update":
            return run[step].params[name] - run[0].params[name]
        return run[step].buffers[name] - run[0].buffers[name]

    for step in range(1, len(truth)):
        t, c = truth[step], candidate[step]
        truth_updates = {n: deltas(truth, step, n, "update") for n in t.params}
        # Tie the absolute floor to the global update size (see tolerances).
        global_update = max((_max_abs(u) for u in truth_updates.values()), default=0.0)
        for name, truth_update in truth_updates.items():
            out.append(_diff(
                step=step, name=name, kind="update", tier=tier, dtype=dtype,
                candidate=deltas(candidate, step, name, "update"),
                truth=truth_update,
                floor_runs=[deltas(run, step, name, "update") for run in floor_runs], floor_scales=floor_scales,
                scale=max(_max_abs(t.params[name]), global_update),
            ))
        for name, truth_buffer in t.buffers.items():
            out.append(_diff(
                step=step, name=name, kind="buffer", tier=tier, dtype=dtype,
                candidate=deltas(candidate, step, name, "buffer"),
                truth=deltas(truth, step, name, "buffer"),
                floor_runs=[deltas(run, step, name, "buffer") for run in floor_runs], floor_scales=floor_scales,
                scale=_max_abs(truth_buffer),
            ))
        for name in sorted(t.optimizer_state.keys() | c.optimizer_state.keys()):
            truth_state = t.optimizer_state.get(name)
            if truth_state is None:
                # The candidate created state the full-batch step never has.
                truth_state = torch.zeros_like(c.optimizer_state[name])
            out.append(_diff(
                step=step, name=name, kind="state", tier=tier, dtype=dtype,
                candidate=c.optimizer_state.get(name),
                truth=truth_state,
                floor_runs=[run[step].optimizer_state.get(name, truth_state) for run in floor_runs],
                floor_scales=floor_scales,
                scale=_max_abs(truth_state),
            ))
    return out

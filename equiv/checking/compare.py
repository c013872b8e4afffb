"""Compare a candidate's run with the float64 truth, tensor by tensor, step by step.

What is compared per step: the cumulative update of every parameter
(p_k - p_0, not the raw parameter: an absolute tolerance on parameters hides
small updates), floating buffers the same way, and every optimizer state
tensor.  Each gets its own allowance (see :mod:`equiv.checking.tolerances`).

Everything streams: a floor run or a candidate run hands over one snapshot
per step and keeps nothing.  :class:`FloorErrors` keeps only, per step and
tensor, the largest (scaled) distance of a floor run from the truth;
:class:`StepComparer` turns each candidate snapshot into :class:`TensorDiff`
rows at once.  So a check holds the truth's trajectory plus O(1) model states,
whatever the number of runs and steps.  The arithmetic happens where the
tensors are (the GPU for a CUDA case); the per-tensor maxima of one step come
back to the host in one transfer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from equiv.checking.tolerances import allowance
from equiv.checking.trajectory import Snapshot
from equiv.checking.verdict import TensorDiff, Tier

__all__ = ["FloorErrors", "StepComparer", "compare_trajectories"]

#: (kind, name): kind is "update", "buffer" or "state".
Key = tuple[str, str]


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


def _host_floats(values: list[Tensor]) -> list[float]:
    """Many 0-d tensors as Python floats, in one device-to-host transfer."""
    if not values:
        return []
    return [float(v) for v in torch.stack([v.to(values[0].device) for v in values]).cpu().tolist()]


def _tensors(step: Snapshot, initial: Snapshot, names: _Names) -> dict[Key, Tensor]:
    """The compared tensors of one snapshot: updates and buffer changes since
    ``initial``, optimizer state as is (names from the truth, plus any extra
    state the run has)."""
    out: dict[Key, Tensor] = {}
    for name in names.params:
        out["update", name] = step.params[name] - initial.params[name]
    for name in names.buffers:
        out["buffer", name] = step.buffers[name] - initial.buffers[name]
    for name, value in step.optimizer_state.items():
        out["state", name] = value
    return out


class _Names:
    """The tensor names of the truth at one step, in comparison order."""

    def __init__(self, truth_step: Snapshot) -> None:
        self.params = list(truth_step.params)
        self.buffers = list(truth_step.buffers)


class FloorErrors:
    """For one tier: per step and tensor, the largest distance from the truth
    of any full-batch floor run, times that run's scale factor.

    Feed each floor run's snapshots in order with :meth:`add` (step 0 first);
    nothing of the run is kept but its first snapshot while it runs.
    """

    def __init__(self, truth: list[Snapshot]) -> None:
        self.truth = truth
        self.errors: dict[tuple[int, str, str], float] = {}
        #: Per floor run, the GradScaler scale after each step (when the case scales losses).
        self.scale_trajectories: list[list[float]] = []
        self._initial: Snapshot | None = None

    def add(self, step: int, snapshot: Snapshot, factor: float) -> None:
        if step == 0:
            self._initial = snapshot
            self.scale_trajectories.append([])
        assert self._initial is not None, "a floor run's snapshots must start at step 0"
        scale = snapshot.optimizer_state.get("grad_scaler:scale")
        if scale is not None:
            self.scale_trajectories[-1].append(float(scale))
        if step == 0:
            return
        truth_step = self.truth[step]
        names = _Names(truth_step)
        run = _tensors(snapshot, self._initial, names)
        truth = _tensors(truth_step, self.truth[0], names)
        keys = list(dict.fromkeys([*truth, *run]))
        distances = []
        for key in keys:
            truth_value = truth.get(key)
            run_value = run.get(key)
            if truth_value is None:  # state the full-batch truth never has: compared with zeros
                assert run_value is not None
                truth_value = torch.zeros_like(run_value)
            if run_value is None:  # the floor run lacks it: no distance
                run_value = truth_value
            distances.append(_max_abs(torch.sub(run_value, truth_value)))
        for key, distance in zip(keys, _host_floats(distances), strict=True):
            scaled = distance * factor
            previous = self.errors.get((step, key[0], key[1]))
            # Same semantics as max() over the runs in order (NaN-safe the same way).
            if previous is None or scaled > previous:
                self.errors[(step, key[0], key[1])] = scaled

    def floor(self, step: int, key: Key) -> float:
        return self.errors.get((step, key[0], key[1]), 0.0)


class StepComparer:
    """Judge a candidate run snapshot by snapshot against the truth and a
    tier's :class:`FloorErrors`; :attr:`diffs` collects every tensor's row."""

    def __init__(self, *, tier: Tier, dtype: torch.dtype, floors: FloorErrors) -> None:
        self.tier, self.dtype, self.floors = tier, dtype, floors
        self.diffs: list[TensorDiff] = []
        self._initial: Snapshot | None = None

    def add(self, step: int, snapshot: Snapshot) -> None:
        if step == 0:
            self._initial = snapshot
            return
        assert self._initial is not None, "a run's snapshots must start at step 0"
        self.diffs.extend(self.compare(step, snapshot, self._initial))

    def compare(self, step: int, candidate_step: Snapshot, candidate_initial: Snapshot) -> list[TensorDiff]:
        truth_step, truth_initial = self.floors.truth[step], self.floors.truth[0]
        names = _Names(truth_step)
        truth = _tensors(truth_step, truth_initial, names)
        device = truth_initial.params[names.params[0]].device if names.params else None
        candidate = {
            key: value.to(device) if device is not None and value.dim() else value  # a rank's run may live elsewhere
            for key, value in _tensors(candidate_step, candidate_initial, names).items()
        }
        # Tie the absolute floor to the global update size (see tolerances).
        update_keys = [("update", name) for name in names.params]
        global_update = max(_host_floats([_max_abs(truth[key]) for key in update_keys]), default=0.0)
        rows: list[tuple[Key, Tensor | None, Tensor]] = []
        for key in update_keys:
            rows.append((key, candidate[key], truth[key]))
        for name in names.buffers:
            rows.append((("buffer", name), candidate["buffer", name], truth["buffer", name]))
        state_names = sorted({n for k, n in truth if k == "state"} | {n for k, n in candidate if k == "state"})
        for name in state_names:
            truth_state = truth.get(("state", name))
            candidate_state = candidate.get(("state", name))
            if truth_state is None:  # the candidate created state the full-batch step never has
                assert candidate_state is not None
                truth_state = torch.zeros_like(candidate_state)
            rows.append((("state", name), candidate_state, truth_state))

        # Scales: the parameter (at least the global update) for updates, the
        # tensor's own magnitude for buffers and state.
        scale_values = [
            _max_abs(truth_step.params[name]) if kind == "update" else
            _max_abs(truth_step.buffers[name]) if kind == "buffer" else _max_abs(truth_value)
            for (kind, name), _, truth_value in rows
        ]
        scales = _host_floats(scale_values)
        out = []
        measured = [self._measure(c, t) for _, c, t in rows]
        floats = _host_floats([value for m in measured if m is not None for value in m])
        position = 0
        for ((kind, name), candidate_value, truth_value), scale, m in zip(rows, scales, measured, strict=True):
            if kind == "update":
                scale = max(scale, global_update)
            budget = allowance(floor=self.floors.floor(step, (kind, name)), dtype=self.dtype, scale=scale, steps=step)
            dtype_name = str(self.dtype).removeprefix("torch.")
            if m is None:
                # Missing state (e.g. the optimizer never stepped) or a reshaped tensor.
                size = max(truth_value.numel(), 1)
                out.append(TensorDiff(step, name, kind, self.tier, dtype_name, math.inf, (), math.inf, (),  # type: ignore[arg-type]
                                      budget.allowed, budget.explain(), size, size))
                continue
            max_abs, flat_abs, max_rel, flat_rel = floats[position : position + 4]
            position += 4
            assert candidate_value is not None
            # Counting the mismatched elements costs a pass: only where there are some.
            mismatched = (
                int((self._abs_diff(candidate_value, truth_value) > budget.allowed).sum())
                if max_abs > budget.allowed else 0
            )
            shape = tuple(truth_value.shape) if truth_value.numel() else ()
            out.append(TensorDiff(
                step=step, name=name, kind=kind, tier=self.tier, dtype=dtype_name,  # type: ignore[arg-type]
                max_abs_diff=max_abs, index=_unravel(int(flat_abs), shape),
                max_rel_diff=max_rel, rel_index=_unravel(int(flat_rel), shape),
                allowed=budget.allowed, explanation=budget.explain(),
                mismatched=mismatched, numel=truth_value.numel(),
            ))
        return out

    @staticmethod
    def _abs_diff(candidate: Tensor, truth: Tensor) -> Tensor:
        # NaN anywhere is as far from the truth as it gets.  In place: one temporary.
        return torch.sub(candidate, truth).abs_().nan_to_num_(nan=math.inf, posinf=math.inf)

    def _measure(self, candidate: Tensor | None, truth: Tensor) -> list[Tensor] | None:
        """[max |diff|, its flat index, max relative diff, its flat index] as 0-d tensors."""
        if candidate is None or candidate.shape != truth.shape:
            return None
        zero = torch.zeros((), dtype=torch.float64, device=truth.device)
        if truth.numel() == 0:
            return [zero, zero, zero, zero]
        abs_diff = self._abs_diff(candidate, truth)
        # |diff| / |truth|, 0 where the two agree (0 / 0 included), inf where only the truth is 0.
        rel_diff = torch.where(abs_diff == 0, 0.0, torch.div(abs_diff, truth.abs()).nan_to_num_(nan=math.inf))
        flat_abs = abs_diff.argmax()
        flat_rel = rel_diff.argmax()
        return [abs_diff.flatten()[flat_abs], flat_abs.to(torch.float64),
                rel_diff.flatten()[flat_rel], flat_rel.to(torch.float64)]


def compare_trajectories(
    *,
    tier: Tier,
    dtype: torch.dtype,
    floors: FloorErrors,
    candidate: list[Snapshot],
) -> list[TensorDiff]:
    """Every tensor at every step (1-based) of a whole ``candidate`` trajectory
    (e.g. one rank's, sent back from a spawned process) against the truth."""
    comparer = StepComparer(tier=tier, dtype=dtype, floors=floors)
    for step, snapshot in enumerate(candidate):
        comparer.add(step, snapshot)
    return comparer.diffs

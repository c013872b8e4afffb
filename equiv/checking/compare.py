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


class _Names:
    """The tensor names of the truth at one step, in comparison order."""

    def __init__(self, truth_step: Snapshot) -> None:
        self.params = list(truth_step.params)
        self.buffers = list(truth_step.buffers)


class _Compared:
    """The compared tensors of one snapshot, made on demand, one at a time (so
    at most one delta temporary lives at once): updates and buffer changes
    since ``initial``, optimizer state as is.  Names come from the truth, plus
    any extra state the run has."""

    def __init__(self, step: Snapshot, initial: Snapshot, names: _Names) -> None:
        self.snapshot, self.initial = step, initial
        self.keys: list[Key] = [
            *(("update", name) for name in names.params),
            *(("buffer", name) for name in names.buffers),
            *(("state", name) for name in step.optimizer_state),
        ]

    def get(self, key: Key) -> Tensor | None:
        kind, name = key
        if kind == "update":
            return self.snapshot.params[name] - self.initial.params[name]
        if kind == "buffer":
            return self.snapshot.buffers[name] - self.initial.buffers[name]
        return self.snapshot.optimizer_state.get(name)


def _initial_state(snapshot: Snapshot, truth_initial: Snapshot) -> Snapshot:
    """What a run's updates are measured from.  Every run starts from the same
    weights as the truth, so the truth's first snapshot serves (nothing is
    kept of the run); a run that starts elsewhere keeps a copy of its own."""
    same = snapshot.params.keys() == truth_initial.params.keys() and all(
        torch.equal(value, truth_initial.params[name].to(value.device)) for name, value in snapshot.params.items()
    ) and snapshot.buffers.keys() == truth_initial.buffers.keys() and all(
        torch.equal(value, truth_initial.buffers[name].to(value.device)) for name, value in snapshot.buffers.items()
    )
    if same:
        return truth_initial
    return Snapshot(
        params={name: value.clone() for name, value in snapshot.params.items()},
        buffers={name: value.clone() for name, value in snapshot.buffers.items()},
        optimizer_state={},
    )


class FloorErrors:
    """For one tier: per step and tensor, the largest distance from the truth
    of any full-batch floor run, times that run's scale factor.

    Feed each floor run's snapshots in order with :meth:`add` (step 0 first);
    nothing of the run is kept while it runs (snapshots may be its live tensors).
    """

    def __init__(self, truth: list[Snapshot]) -> None:
        self.truth = truth
        self.errors: dict[tuple[int, str, str], float] = {}
        #: Per floor run, the GradScaler scale after each step (when the case scales losses).
        self.scale_trajectories: list[list[float]] = []
        self._initial: Snapshot | None = None

    def add(self, step: int, snapshot: Snapshot, factor: float) -> None:
        if step == 0:
            self._initial = _initial_state(snapshot, self.truth[0])
            self.scale_trajectories.append([])
        assert self._initial is not None, "a floor run's snapshots must start at step 0"
        scale = snapshot.optimizer_state.get("grad_scaler:scale")
        if scale is not None:
            self.scale_trajectories[-1].append(float(scale))
        if step == 0:
            return
        names = _Names(self.truth[step])
        run = _Compared(snapshot, self._initial, names)
        truth = _Compared(self.truth[step], self.truth[0], names)
        keys = list(dict.fromkeys([*truth.keys, *run.keys]))
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
            self._initial = _initial_state(snapshot, self.floors.truth[0])
            return
        assert self._initial is not None, "a run's snapshots must start at step 0"
        self.diffs.extend(self.compare(step, snapshot, self._initial))

    def compare(self, step: int, candidate_step: Snapshot, candidate_initial: Snapshot) -> list[TensorDiff]:
        truth_step, truth_initial = self.floors.truth[step], self.floors.truth[0]
        names = _Names(truth_step)
        truth = _Compared(truth_step, truth_initial, names)
        run = _Compared(candidate_step, candidate_initial, names)
        device = truth_initial.params[names.params[0]].device if names.params else None

        def candidate(key: Key) -> Tensor | None:
            value = run.get(key)
            # A rank's run may live on another device than the truth (0-d state may stay on the CPU).
            return value.to(device) if value is not None and device is not None and value.dim() else value

        def truth_of(key: Key) -> Tensor:
            value = truth.get(key)
            if value is None:  # the candidate created state the full-batch step never has
                created = candidate(key)
                assert created is not None
                return torch.zeros_like(created)
            return value

        update_keys: list[Key] = [("update", name) for name in names.params]
        state_names = sorted({n for k, n in truth.keys if k == "state"} | {n for k, n in run.keys if k == "state"})
        keys = [*update_keys, *(("buffer", name) for name in names.buffers), *(("state", n) for n in state_names)]

        # One tensor at a time: its 0-d maxima are kept, its temporaries freed.
        scale_values: list[Tensor] = []
        measured: list[list[Tensor] | None] = []
        shapes: list[tuple[int, ...]] = []
        for kind, name in keys:
            truth_value = truth_of((kind, name))
            # Scales: the parameter (at least the global update) for updates, the
            # tensor's own magnitude for buffers and state.
            scale_values.append(
                _max_abs(truth_step.params[name]) if kind == "update"
                else _max_abs(truth_step.buffers[name]) if kind == "buffer" else _max_abs(truth_value)
            )
            if kind == "update":
                # Tie the absolute floor to the global update size (see tolerances).
                scale_values.append(_max_abs(truth_value))
            measured.append(self._measure(candidate((kind, name)), truth_value))
            shapes.append(tuple(truth_value.shape) if truth_value.numel() else ())
        floats = _host_floats([*scale_values, *(value for m in measured if m is not None for value in m)])
        scales: list[float] = []
        update_sizes: list[float] = []
        position = 0
        for kind, _ in keys:
            scales.append(floats[position])
            position += 1
            if kind == "update":
                update_sizes.append(floats[position])
                position += 1
        global_update = max(update_sizes, default=0.0)

        out = []
        dtype_name = str(self.dtype).removeprefix("torch.")
        for (kind, name), scale, m, shape in zip(keys, scales, measured, shapes, strict=True):
            if kind == "update":
                scale = max(scale, global_update)
            budget = allowance(floor=self.floors.floor(step, (kind, name)), dtype=self.dtype, scale=scale, steps=step)
            numel = math.prod(shape) if shape else truth_of((kind, name)).numel()
            if m is None:
                # Missing state (e.g. the optimizer never stepped) or a reshaped tensor.
                size = max(numel, 1)
                out.append(TensorDiff(step, name, kind, self.tier, dtype_name, math.inf, (), math.inf, (),  # type: ignore[arg-type]
                                      budget.allowed, budget.explain(), size, size))
                continue
            max_abs, flat_abs, max_rel, flat_rel = floats[position : position + 4]
            position += 4
            mismatched = 0
            if max_abs > budget.allowed:  # counting costs a pass: only where there are some
                candidate_value = candidate((kind, name))
                assert candidate_value is not None
                mismatched = int((self._abs_diff(candidate_value, truth_of((kind, name))) > budget.allowed).sum())
            out.append(TensorDiff(
                step=step, name=name, kind=kind, tier=self.tier, dtype=dtype_name,  # type: ignore[arg-type]
                max_abs_diff=max_abs, index=_unravel(int(flat_abs), shape),
                max_rel_diff=max_rel, rel_index=_unravel(int(flat_rel), shape),
                allowed=budget.allowed, explanation=budget.explain(),
                mismatched=mismatched, numel=numel,
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

"""Compare a candidate's run with the float64 truth, tensor by tensor, step by step.

What is compared per step: the cumulative update of every parameter
(p_k - p_0, not the raw parameter: an absolute tolerance on parameters hides
small updates), floating buffers the same way, and every optimizer state
tensor.  Each gets its own allowance (see :mod:`equiv.judging.tolerances`).

Everything streams: a floor run or a candidate run hands over its live
tensors once per step (any dtype: the arithmetic promotes them to float64,
which is exact) and keeps nothing.  :class:`TruthTrajectory` holds the float64
truth already in compared form (updates since step 0, state as is) with the
per-step scales every comparison needs, computed once; :class:`FloorErrors`
keeps only, per step and tensor, the largest (scaled) distance of a floor run
from the truth; :class:`StepComparer` turns each candidate snapshot into
:class:`TensorDiff` rows at once.  So a check holds the truth's trajectory
plus O(1) model states, whatever the number of runs and steps, and each
compared tensor costs one temporary (two for a candidate: the relative
difference).  The arithmetic happens where the tensors are (the GPU for a
CUDA case); the per-tensor maxima of one step come back to the host in one
transfer.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Sequence

import torch
from torch import Tensor, nn

from equiv.judging.details import _DETAIL_SLOTS, _detailed
from equiv.judging.reductions import _host_floats, _max_abs, _max_abs_each, _Scratch
from equiv.judging.runs import Snapshot
from equiv.judging.tolerances import allowance
from equiv.results.verdict import TensorDiff, Tier

__all__ = ["FloorErrors", "FloorRun", "StepComparer", "TruthTrajectory", "compare_trajectories", "starts_exactly"]

#: (quantity, name): quantity is "update", "buffer" or "state".
Key = tuple[str, str]
#: The GradScaler's scale, recorded as optimizer state when a case scales losses.
LOSS_SCALE_KEY = "grad_scaler:scale"


def _float64(tensor: Tensor, device: torch.device | None) -> Tensor:
    """A 0-d or lent tensor as float64 where the truth lives (a copy only when it must)."""
    if device is not None and tensor.dim():
        tensor = tensor.to(device)
    return tensor.to(torch.float64)


def _compact(tensor: Tensor, own: Tensor | None = None) -> Tensor:
    """A copy of ``tensor`` in float32 when that holds every value exactly (a model
    built in float32 and cast up: half the bytes of float64, and float64
    arithmetic promotes it back exactly), else in float64.  ``own``: the float32
    tensor ``tensor`` was cast up from (exactly: float64 holds every float32),
    kept anyway: returned as it is, no copy and no comparison."""
    tensor = tensor.detach()
    if (
        own is not None
        and own.dtype == torch.float32
        and tensor.dtype in (torch.float32, torch.float64)
        and (own.shape, own.device) == (tensor.shape, tensor.device)
    ):
        return own.detach()
    narrow = tensor.clone() if tensor.dtype == torch.float32 else None
    if tensor.dtype == torch.float64:
        narrow = tensor.to(torch.float32)
        if not torch.equal(narrow.to(torch.float64), tensor):
            narrow = None
    return tensor.to(torch.float64, copy=True) if narrow is None else narrow


class TruthTrajectory:
    """The float64 full-batch run, kept as every comparison needs it.

    Step 0 (:attr:`initial`): the weights every run starts from, in float32
    when they are float32 values (a case's model is built in float32).  Per
    step k >= 1 (:attr:`values`): every parameter and floating buffer as its
    float64 value t_k, and every optimizer state tensor; and the scales the
    allowances use (max |t_k|, max |t_k - t_0|, max |state|), computed once
    here instead of once per compared run.  A run that starts where the truth
    does is compared as p_k - t_k, which is its update minus the truth's
    ((p_k - t_0) - (t_k - t_0)) in one subtraction.

    Built streaming (:meth:`add` as the truth runs, its tensors lent, not
    copied) or from a list of snapshots (:meth:`of`).
    """

    def __init__(self, start: nn.Module | None = None, steps: int | None = None) -> None:
        """``start``: the model every run copies and none trains (the case's, in
        float32), and the truth run's own start cast up to float64 (exactly: float64
        holds every value of a lower precision): the truth's step 0 is held as its
        tensors, one copy of the initial weights per check, not two, and without
        comparing the two (a mixed-dtype comparison costs more than a subtraction).

        ``steps``: the run's last step.  Its snapshot's float64 tensors are kept as
        lent, not copied: the run ends with it and nothing writes them again (a
        copy would cost a pass over the model and its state, and a second copy of
        them alive at once)."""
        self._start_tensors: dict[str, Tensor] = (
            {} if start is None else {**dict(start.named_parameters()), **dict(start.named_buffers())}
        )
        self._last_step = steps
        self.initial: Snapshot | None = None
        #: step -> key -> the truth's tensor after that step, float64 (index 0 unused)
        self.values: list[dict[Key, Tensor]] = [{}]
        #: step -> key -> the tensor's own scale: max |t_k| for updates and buffers, max |state| for state
        self.scales: list[dict[Key, float]] = [{}]
        #: step -> the largest |update| anywhere in the model (the floor of every update's scale)
        self.global_update: list[float] = [0.0]
        #: the GradScaler's scale after each step, step 0 included (empty when the case does not scale)
        self.loss_scales: list[float] = []

    @classmethod
    def of(cls, snapshots: Sequence[Snapshot]) -> TruthTrajectory:
        truth = cls()
        for step, snapshot in enumerate(snapshots):
            truth.add(step, snapshot)
        return truth

    def __len__(self) -> int:
        return len(self.values)

    def add(self, step: int, snapshot: Snapshot) -> None:
        if step != len(self.values) - (self.initial is None):
            raise ValueError(f"the truth's snapshots must come in order: got step {step} after {len(self) - 1}")
        if LOSS_SCALE_KEY in snapshot.optimizer_state:
            self.loss_scales.append(float(snapshot.optimizer_state[LOSS_SCALE_KEY]))
        if step == 0:
            own = self._start_tensors
            self.initial = Snapshot(
                params={name: _compact(value, own.get(name)) for name, value in snapshot.params.items()},
                buffers={name: _compact(value, own.get(name)) for name, value in snapshot.buffers.items()},
                optimizer_state={},
            )
            self._start_tensors = {}  # held through self.initial where used; nothing else kept
            return
        assert self.initial is not None
        copy = step != self._last_step  # the last snapshot's tensors are the truth's to keep
        values: dict[Key, Tensor] = {
            **{
                ("update", name): value.detach().to(torch.float64, copy=copy) for name, value in snapshot.params.items()
            },
            **{
                ("buffer", name): value.detach().to(torch.float64, copy=copy)
                for name, value in snapshot.buffers.items()
            },
            **{
                ("state", name): value.detach().to(torch.float64, copy=copy)
                for name, value in snapshot.optimizer_state.items()
            },
        }
        own_scales = _max_abs_each(list(values.values()))
        floats = _host_floats([*own_scales, *self._update_sizes(step, values)])
        self.values.append(values)
        self.scales.append(dict(zip(values, floats[: len(values)], strict=True)))
        self.global_update.append(max(floats[len(values) :], default=0.0))

    def _update_sizes(self, step: int, values: dict[Key, Tensor]) -> list[Tensor]:
        """max |t_k - t_0| of every parameter, 0-d float64 tensors where they live: one
        at a time on the CPU; on a GPU packed (see :func:`_packs`) as the start minus
        the value, the update negated exactly (the same greatest magnitude)."""
        scratch = _Scratch()
        keys = [key for key in values if key[0] == "update"]
        device = self.device
        if device is None or device.type == "cpu":
            return [_max_abs(self.compared(step, key, scratch, values)) for key in keys]
        assert self.initial is not None
        tensors = [values[key] for key in keys]
        sizes: list[Tensor] = []
        for pack in _packs(scratch, "truth", tensors, device):
            views = [view for _, view in pack]
            torch._foreach_copy_(views, [self.initial.params[keys[position][1]] for position, _ in pack])
            torch._foreach_sub_(views, [tensors[position] for position, _ in pack])
            sizes.extend(_max_abs_each(views))
        return sizes

    def compared(self, step: int, key: Key, scratch: _Scratch, values: dict[Key, Tensor] | None = None) -> Tensor:
        """What is compared at ``key`` after ``step``: a parameter's update or a
        buffer's change since step 0 (t_k - t_0, in ``scratch``, which the next
        call may overwrite), or the optimizer state as it is."""
        value = (self.values[step] if values is None else values)[key]
        quantity, name = key
        if quantity == "state":
            return value
        assert self.initial is not None
        start = (self.initial.params if quantity == "update" else self.initial.buffers)[name]
        out = scratch.get("truth", value.shape, value.device)
        if start.dtype == value.dtype:
            return torch.sub(value, start, out=out)
        # The start (float32 when exact) converted into the buffer first: a mixed-dtype
        # subtraction is about 3x slower than a conversion and a float64 one.
        out.copy_(start)
        return torch.sub(value, out, out=out)

    def nbytes(self) -> int:
        """Bytes of the tensors held (the start and every step's)."""
        held = list(self.values)
        if self.initial is not None:
            held.append({("", n): t for n, t in [*self.initial.params.items(), *self.initial.buffers.items()]})
        return sum(t.numel() * t.element_size() for tensors in held for t in tensors.values())

    def names(self, step: int, quantity: str) -> list[str]:
        return [name for k, name in self.values[step] if k == quantity]

    @property
    def device(self) -> torch.device | None:
        assert self.initial is not None
        first = next(iter(self.initial.params.values()), None)
        return first.device if first is not None else None


class _RunStart:
    """Where one run starts, and the scratch buffers of its comparison (dropped
    with it when the run ends).  A run that starts from the truth's weights
    compares against the truth's step 0 (nothing of the run is kept); a run that
    starts elsewhere keeps a float64 copy of its own.

    ``at_truth_start``: whether the run is known to start at the truth's weights
    (a copy of the model the truth started from, cast to a dtype that holds its
    values exactly: see :func:`starts_exactly`); None: compare the two."""

    def __init__(self, snapshot: Snapshot, truth: TruthTrajectory, at_truth_start: bool | None = None) -> None:
        self.scratch = _Scratch()
        self.truth = truth
        initial = truth.initial
        assert initial is not None
        device = truth.device
        if at_truth_start:
            self.at_truth_start = True
            return

        def same(values: dict[str, Tensor], truths: dict[str, Tensor]) -> bool:
            # torch.eq compares values across dtypes (float32 promoted exactly):
            # no float64 copy of the whole model per run just to compare it; and
            # one host read for the whole model, not one per tensor (a GPU sync each).
            if values.keys() != truths.keys() or any(v.shape != truths[n].shape for n, v in values.items()):
                return False
            equal = [
                torch.eq(value.detach().to(truths[name].device), truths[name]).all() for name, value in values.items()
            ]
            return bool(torch.stack(equal).all()) if equal else True

        self.at_truth_start = same(snapshot.params, initial.params) and same(snapshot.buffers, initial.buffers)
        if not self.at_truth_start:
            self.params = {name: _float64(v.detach(), device).clone() for name, v in snapshot.params.items()}
            self.buffers = {name: _float64(v.detach(), device).clone() for name, v in snapshot.buffers.items()}

    def _value(
        self, snapshot: Snapshot, key: Key, truth_value: Tensor | None, device: torch.device | None
    ) -> Tensor | None:
        """The run's tensor at ``key`` on the truth's device; None where the run
        lacks it or its shape differs from the truth's."""
        quantity, name = key
        held = {"update": snapshot.params, "buffer": snapshot.buffers}.get(quantity, snapshot.optimizer_state)
        value = held.get(name)
        if value is None:
            return None
        value = value.detach()
        if device is not None and value.dim() and value.device != device:
            value = value.to(device)  # a rank's run may live on another device than the truth
        if truth_value is not None and truth_value.shape != value.shape:
            return None
        return value

    def difference(
        self, snapshot: Snapshot, key: Key, truth_value: Tensor | None, device: torch.device | None
    ) -> Tensor | None:
        """The run's compared tensor at ``key`` minus the truth's (the truth's
        zeros where the truth lacks it), float64, in a scratch buffer that the
        next call overwrites; None where the run lacks it or its shape differs.

        ``truth_value``: the truth's tensor after the step (its value, not its update)."""
        value = self._value(snapshot, key, truth_value, device)
        if value is None:
            return None
        out = self.scratch.get("difference", value.shape, value.device)
        # (p_k - p_0) - (t_k - t_0), state - truth state: the same operations as on
        # float64 copies (type promotion to float64 is exact), in one temporary.
        # From the truth's start, p_k - t_k: one subtraction.
        if value.dtype == torch.float64 and truth_value is not None:
            torch.sub(value, truth_value, out=out)
        else:
            # Converted into the scratch buffer first: a mixed-dtype subtraction
            # is several times slower than a conversion and a float64 one.
            out.copy_(value)
            if truth_value is not None:
                out.sub_(truth_value)
        if key[0] != "state" and not self.at_truth_start and truth_value is not None:
            own_start, truth_start = self._starts(key)
            out.sub_(own_start).add_(truth_start)
        return out

    def _starts(self, key: Key) -> tuple[Tensor, Tensor]:
        """The run's own start and the truth's at an update or buffer ``key``."""
        quantity, name = key
        initial = self.truth.initial
        assert initial is not None
        own = (self.params if quantity == "update" else self.buffers)[name]
        return own, (initial.params if quantity == "update" else initial.buffers)[name]

    def max_differences(
        self,
        snapshot: Snapshot,
        keys: list[Key],
        truths: dict[Key, Tensor],
        device: torch.device | None,
    ) -> list[Tensor | None]:
        """max |:meth:`difference`| at each of ``keys`` as a 0-d float64 tensor (None
        where the run lacks the tensor or its shape differs).

        On the CPU one tensor at a time through one scratch buffer.  On a GPU many
        at once: packed into one flat float64 buffer no larger than the largest
        tensor (the memory of the one-at-a-time buffer), a few multi-tensor kernels
        per pack instead of five kernels per tensor.  The same arithmetic either
        way (the value converted exactly, the truth subtracted in float64), so the
        same numbers."""
        if device is None or device.type == "cpu":
            out: list[Tensor | None] = []
            for key in keys:
                difference = self.difference(snapshot, key, truths.get(key), device)
                out.append(_max_abs(difference) if difference is not None else None)
            return out
        out = [None] * len(keys)
        batched: list[tuple[int, Key, Tensor]] = []
        for position, key in enumerate(keys):
            value = self._value(snapshot, key, truths.get(key), device)
            if value is None:
                continue
            if value.device != device:  # a 0-d host tensor (Adam's step): read where it is
                difference = self.difference(snapshot, key, truths.get(key), device)
                out[position] = None if difference is None else _max_abs(difference)
            else:
                batched.append((position, key, value))
        for pack in _packs(self.scratch, "difference", [value for _, _, value in batched], device):
            views = [view for _, view in pack]
            items = [batched[i] for i, _ in pack]
            torch._foreach_copy_(views, [value for _, _, value in items])
            against = [(view, truths[key]) for view, (_, key, _) in zip(views, items, strict=True) if key in truths]
            if against:
                torch._foreach_sub_([view for view, _ in against], [truth for _, truth in against])
            if not self.at_truth_start:
                moved = [
                    (view, *self._starts(key))
                    for view, (_, key, _) in zip(views, items, strict=True)
                    if key[0] != "state" and key in truths
                ]
                if moved:
                    torch._foreach_sub_([view for view, _, _ in moved], [own for _, own, _ in moved])
                    torch._foreach_add_([view for view, _, _ in moved], [start for _, _, start in moved])
            for (position, _, _), maximum in zip(items, _max_abs_each(views), strict=True):
                out[position] = maximum
        return out


def _packs(
    scratch: _Scratch, slot: str, tensors: list[Tensor], device: torch.device
) -> Iterator[list[tuple[int, Tensor]]]:
    """``tensors`` (by position) in packs of total size at most the largest one's,
    each with a float64 view, in its shape, of one flat scratch buffer: many
    tensors per multi-tensor kernel in the memory of one tensor-sized buffer.
    A pack's views are overwritten by the next pack (kernels queue in order)."""
    capacity = max((tensor.numel() for tensor in tensors), default=0)
    flat = scratch.get(slot, torch.Size([capacity]), device)
    pack: list[tuple[int, Tensor]] = []
    used = 0
    for position, tensor in enumerate(tensors):
        size = tensor.numel()
        if pack and used + size > capacity:
            yield pack
            pack, used = [], 0
        pack.append((position, flat[used : used + size].view(tensor.shape)))
        used += size
    if pack:
        yield pack


def starts_exactly(start: nn.Module, dtype: torch.dtype) -> bool:
    """Whether a copy of ``start`` cast to ``dtype`` holds its values exactly: every
    floating tensor's dtype is ``dtype`` or one that ``dtype`` holds (float64 holds
    every float; float32 holds float16 and bfloat16).  A run that trains such a
    copy of the model the truth started from starts at the truth's weights, and
    need not be compared there (:class:`_RunStart`)."""
    holds = {
        torch.float64: (torch.float32, torch.float16, torch.bfloat16),
        torch.float32: (torch.float16, torch.bfloat16),
    }
    tensors = [*start.parameters(), *start.buffers()]
    return all(t.dtype == dtype or t.dtype in holds.get(dtype, ()) for t in tensors if t.is_floating_point())


class FloorErrors:
    """For one tier: per step and tensor, the largest distance from the truth
    of any full-batch floor run, times that run's scale factor.

    Feed each floor run's snapshots in order with :meth:`add` (step 0 first),
    or through a :class:`FloorRun` that feeds several tiers at once; nothing of
    the run is kept while it runs (snapshots may be its live tensors).
    """

    def __init__(self, truth: TruthTrajectory) -> None:
        self.truth = truth
        self.errors: dict[tuple[int, str, str], float] = {}
        #: Per floor run, the GradScaler scale after each step (when the case scales losses).
        self.scale_trajectories: list[list[float]] = []
        self._run: FloorRun | None = None

    def add(self, step: int, snapshot: Snapshot, factor: float) -> None:
        if step == 0:
            self._run = FloorRun([(self, factor)])
        assert self._run is not None, "a floor run's snapshots must start at step 0"
        self._run.add(step, snapshot)

    def end_run(self) -> None:
        """The floor run fed since step 0 has ended: its scratch buffers go."""
        self._run = None

    def fold(self, step: int, keys: Sequence[Key], distances: Sequence[float], factor: float) -> None:
        """One floor run's distances from the truth after ``step``, times ``factor``."""
        for key, distance in zip(keys, distances, strict=True):
            scaled = distance * factor
            previous = self.errors.get((step, key[0], key[1]), 0.0)
            # The greatest over the samples, whatever order they run in; a sample that
            # left the finite numbers measures no rounding and is passed over (an
            # infinite or NaN floor would allow anything).
            if math.isfinite(scaled) and scaled > previous:
                self.errors[(step, key[0], key[1])] = scaled

    def floor(self, step: int, key: Key) -> float:
        return self.errors.get((step, key[0], key[1]), 0.0)


class FloorRun:
    """One floor run fed to every tier whose floor it measures, each with its
    factor (a float32 run measures the float32 tier's floor as it is and the
    float64 tier's scaled by u64/u32): its distance from the truth is measured
    once per step and folded into each tier's :class:`FloorErrors` (they share
    the truth), not once per tier.  ``at_truth_start``: as for :class:`_RunStart`."""

    def __init__(self, feeds: Sequence[tuple[FloorErrors, float]], *, at_truth_start: bool | None = None) -> None:
        if not feeds or any(errors.truth is not feeds[0][0].truth for errors, _ in feeds):
            raise ValueError("a floor run feeds one or more FloorErrors of one truth")
        self.feeds = list(feeds)
        self.truth = feeds[0][0].truth
        self.at_truth_start = at_truth_start
        self._start: _RunStart | None = None

    def add(self, step: int, snapshot: Snapshot) -> None:
        if step == 0:
            self._start = _RunStart(snapshot, self.truth, self.at_truth_start)
            for errors, _ in self.feeds:
                errors.scale_trajectories.append([])
        assert self._start is not None, "a floor run's snapshots must start at step 0"
        scale = snapshot.optimizer_state.get(LOSS_SCALE_KEY)
        if scale is not None:
            for errors, _ in self.feeds:
                errors.scale_trajectories[-1].append(float(scale))
        if step == 0:
            return
        truth = self.truth.values[step]
        device = self.truth.device
        # The truth's tensors, then state only the run has (compared with zeros).
        keys = [*truth, *(("state", n) for n in snapshot.optimizer_state if ("state", n) not in truth)]
        # A tensor the floor run lacks has no distance (a zero made where the
        # others are: a host-to-GPU copy would be one more synchronisation).
        distances = _host_floats(
            [
                distance if distance is not None else torch.zeros((), dtype=torch.float64, device=device)
                for distance in self._start.max_differences(snapshot, keys, truth, device)
            ]
        )
        for errors, factor in self.feeds:
            errors.fold(step, keys, distances, factor)

    def end_run(self) -> None:
        """The run has ended: its scratch buffers go."""
        self._start = None


class StepComparer:
    """Judge a candidate run snapshot by snapshot against the truth and a
    tier's :class:`FloorErrors`; :attr:`diffs` collects every tensor's row.

    Every tensor costs one pass for its greatest difference (min and max of
    the difference in one fused reduction).  Where it is (``index``), the
    greatest relative difference and the count of mismatched elements take
    several more passes (an argmax is ~8 times a max on the CPU), so they are
    computed only for the rows a verdict shows: the tensors that exceed their
    allowance, and, once per step, the step's worst tensor when it is the
    tier's worst so far (a verdict's ``worst`` is the first row of greatest
    ratio).  Other rows carry ``index=()``, ``rel_index=()`` and
    ``max_rel_diff=nan``.

    With ``details=False`` no row is detailed: a pass whose floors may still
    grow (see :meth:`rejudged`), whose rows are final only if they all pass.
    """

    def __init__(
        self,
        *,
        tier: Tier,
        dtype: torch.dtype,
        floors: FloorErrors,
        details: bool = True,
        at_truth_start: bool | None = None,
    ) -> None:
        self.tier, self.dtype, self.floors, self.details = tier, dtype, floors, details
        #: as for :class:`_RunStart`
        self.at_truth_start = at_truth_start
        self.diffs: list[TensorDiff] = []
        self._start: _RunStart | None = None
        self._worst_ratio: float | None = None

    def add(self, step: int, snapshot: Snapshot) -> None:
        if step == 0:
            self._start = _RunStart(snapshot, self.floors.truth, self.at_truth_start)
            return
        assert self._start is not None, "a run's snapshots must start at step 0"
        self.diffs.extend(self.compare(step, snapshot, self._start))

    def end_run(self) -> None:
        """The run has ended: its scratch buffers go (the rows stay)."""
        self._start = None

    def rejudged(self, floors: FloorErrors) -> list[TensorDiff]:
        """:attr:`diffs` judged against other floors of the same truth (more floor
        samples run since): each row's allowance again, from the greatest
        difference already measured; no row detailed."""
        assert not self.details, "a detailed row's mismatched count belongs to its own allowance"
        rows = []
        for row in self.diffs:
            budget = allowance(
                floor=floors.floor(row.step, (row.quantity, row.name)),
                dtype=self.dtype,
                scale=row.scale,
                steps=row.step,
            )
            rows.append(dataclasses.replace(row, allowed=budget.allowed, explanation=budget.explain()))
        return rows

    def compare(self, step: int, candidate: Snapshot, start: _RunStart) -> list[TensorDiff]:
        """Every compared tensor's row after ``step``, ``candidate`` being the run's
        snapshot then; the rows a verdict shows detailed (unless :attr:`details` is False)."""
        truth = self.floors.truth
        compared = truth.values[step]
        extra_state = sorted(n for n in candidate.optimizer_state if ("state", n) not in compared)
        truth_state = sorted(n for k, n in compared if k == "state")
        keys: list[Key] = [
            *(("update", n) for n in truth.names(step, "update")),
            *(("buffer", n) for n in truth.names(step, "buffer")),
            *(("state", n) for n in sorted([*truth_state, *extra_state])),
        ]
        # Into one scratch buffer: only each tensor's 0-d maximum is kept.
        maxima = start.max_differences(candidate, keys, compared, truth.device)
        floats = iter(_host_floats([m for m in maxima if m is not None]))
        out = [
            self._row(step, key, candidate, None if maximum is None else next(floats))
            for key, maximum in zip(keys, maxima, strict=True)
        ]
        if self.details:
            self._detail(step, candidate, start, keys, out)
        return out

    def _row(self, step: int, key: Key, candidate: Snapshot, max_abs: float | None) -> TensorDiff:
        """The row of ``key`` (not detailed) whose greatest difference is ``max_abs``; None:
        the run lacks the tensor (e.g. the optimizer never stepped) or reshaped it."""
        truth = self.floors.truth
        quantity, name = key
        truth_value = truth.values[step].get(key)
        # Scales: the parameter (at least the global update) for updates, the
        # tensor's own magnitude for buffers and state (0 for state the truth lacks).
        scale = truth.scales[step].get(key, 0.0)
        if quantity == "update":
            scale = max(scale, truth.global_update[step])
        budget = allowance(floor=self.floors.floor(step, key), dtype=self.dtype, scale=scale, steps=step)
        shape = tuple(truth_value.shape) if truth_value is not None else tuple(candidate.optimizer_state[name].shape)
        numel = math.prod(shape)
        if max_abs is None:  # as far from the truth as it gets, every element mismatched
            max_abs, max_rel, mismatched = math.inf, math.inf, max(numel, 1)
            numel = mismatched
        else:
            max_rel, mismatched = math.nan, 0  # (filled in only where detailed)
            if math.isnan(max_abs):  # NaN anywhere is as far from the truth as it gets
                max_abs = math.inf
        return TensorDiff(
            step=step,
            name=name,
            quantity=quantity,  # type: ignore[arg-type]
            tier=self.tier,
            dtype=str(self.dtype).removeprefix("torch."),
            max_abs_diff=max_abs,
            index=(),
            max_rel_diff=max_rel,
            rel_index=(),
            allowed=budget.allowed,
            explanation=budget.explain(),
            mismatched=mismatched,
            numel=numel,
            scale=scale,
        )

    def _detail(self, step: int, candidate: Snapshot, start: _RunStart, keys: list[Key], out: list[TensorDiff]) -> None:
        """Details, in ``out`` (the rows of ``keys``), for the rows a verdict shows: every
        row past its allowance, and the step's worst (the first of greatest ratio) when it
        beats the tier's worst so far."""
        truth = self.floors.truth
        compared = truth.values[step]
        worst = max(range(len(out)), key=lambda i: out[i].ratio, default=None)
        for position, row in enumerate(out):
            new_worst = position == worst and (self._worst_ratio is None or row.ratio > self._worst_ratio)
            missing = math.isinf(row.max_abs_diff) and row.mismatched > 0  # nothing to detail
            if missing or (row.ok and not new_worst):
                continue
            key = keys[position]
            truth_compared = truth.compared(step, key, start.scratch) if key in compared else None
            again = start.difference(candidate, key, compared.get(key), truth.device)
            assert again is not None
            out[position] = _detailed(row, again, truth_compared, start.scratch)
        if worst is not None and (self._worst_ratio is None or out[worst].ratio > self._worst_ratio):
            self._worst_ratio = out[worst].ratio
        # The details' buffers go before the run's next step: not held while its
        # gradients and optimizer temporaries are (a failing check's peak).
        start.scratch.release(*_DETAIL_SLOTS)


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
    comparer.end_run()
    return comparer.diffs

"""The witness of a failing ``check_distributed`` step, per rank (issue 44).

Run only after the ranks' verdicts fail in the exact (float64) tier: the ranks
run the step once more in float64 up to its first failing step
(:func:`equiv.checking.witnessing.capture` on each rank, under the check's
engine), and read ``G``, the gradient the optimizer saw (after the engine's
reduction), and each micro-batch's float64 loss-SUM gradient ``g_i``.

Where every rank holds the whole gradient (DDP; context parallelism and sequence
parallelism, whose parameters DDP replicates), each rank sends back ``G`` and the
``g_i`` of its own micro-batches, and each rank's ``G`` is fitted against every
rank's micro-batches, the rank of each known to the naming (a per-rank mean needs it).

Where a rank holds a shard of ``G`` (FSDP2, tensor parallelism, their compositions),
each rank fits its shard: at the failing step's start the parameters are gathered
(a collective) into a float64 copy wrapped by the same engine, so its shards are
the run's; then one forward and backward per micro-batch of any data rank, every
rank taking part (FSDP2's and DTensor's collectives), the owner (the data rank's
tensor-parallel group) back-propagating its loss sum times the ranks FSDP2 averages
over and every other rank zero times its own output, so each rank's shard is of
that micro-batch's gradient alone.  :func:`~equiv.judging.witness.recover_weights`
sums the shards' Gram matrices with an all-reduce, so every rank finds the same
weights.  (A tensor replicated over a tensor-parallel group, a row-wise bias, is
counted once per rank in that sum, in ``G`` and in the ``g_i`` alike: a weighted
least squares with the same solution.)

Under context (or sequence) parallelism each rank sees its slice of every
micro-batch's positions, so a micro-batch's gradient is the sum of its slices'
loss-sum gradients over its group.  The fit takes each slice as a unit of its
own (a slice with no real token has no gradient and is left out): where every
micro-batch's slices get one weight the slices are added up, the window is named
in micro-batches and a per-rank mean is per data rank; where they do not (each
slice divided by its own tokens, Megatron-LM PR #7513) the window is named in
slices, each rank's, and a per-rank mean is per rank of the whole grid.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from equiv.cases.distributed import DistributedCase
from equiv.checking.witnessing import CapturedStep, capture, finite, sum_gradients
from equiv.distributed.collectives import CollectiveCounts
from equiv.distributed.context_parallel import clear_layout, install_layout
from equiv.distributed.deepspeed import DEEPSPEED_MUON
from equiv.distributed.engines import Apply, Wrapping, apply_fsdp, engine_named
from equiv.distributed.launcher import DistributedCheckError, Launcher
from equiv.distributed.sharding import full_tensors
from equiv.judging.contract import bind
from equiv.judging.runs import autocast_wrapped
from equiv.judging.witness import NAMING_TOLERANCE, Recovered, recover_weights, witness
from equiv.results.verdict import Verdict
from equiv.results.witness import Witness

__all__ = ["WITNESS_READ", "rank_witnesses", "witness_deferred"]

#: Whether a failing distributed verdict reads its witness now (one more launch of the ranks).  A search sets it
#: off while it shrinks (every failing example would pay that launch) and reads the witness of the one it reports.
WITNESS_READ: ContextVar[bool] = ContextVar("equiv_distributed_witness_read", default=True)


@contextlib.contextmanager
def witness_deferred() -> Iterator[None]:
    """Within it, a failing distributed verdict carries no witness (its ranks are not launched again for it)."""
    token = WITNESS_READ.set(False)
    try:
        yield
    finally:
        WITNESS_READ.reset(token)


#: What a replicated rank sends back: (G_r, each unit's loss-sum gradient, each unit's items), or None.
RankWindow = tuple[list[Tensor | None], list[list[Tensor | None]], list[float]] | None


@dataclass(frozen=True)
class _Fitted:
    """What a sharded rank sends back: the weights every rank found together, and the units they weigh."""

    recovered: Recovered
    items: list[float]
    #: the rank (data rank, or under split sequences the rank of the whole grid) and micro-batch of each unit
    units: list[tuple[int, int]]


@dataclass(frozen=True)
class _Units:
    """The units a window is fitted in: each data rank's micro-batches, or each rank's slices of them."""

    dcase: DistributedCase

    @property
    def by_slice(self) -> bool:
        return self.dcase.sequence_slices > 1

    def owner(self, rank: int) -> int:
        """The unit owner a rank is: itself where it holds a slice, else its data rank (its TP group)."""
        return rank if self.by_slice else self.dcase.data_rank(rank)

    def all(self) -> list[tuple[int, int]]:
        """(owner, micro-batch index) of every unit, in rank order."""
        dcase = self.dcase
        if self.by_slice:
            return [
                (rank, index)
                for rank in range(dcase.world_size)
                for index in range(len(dcase.rank_micro_batches(rank)))
            ]
        return [
            (data_rank, index)
            for data_rank, sizes in enumerate(dcase.rank_micro_batch_sizes)
            for index in range(len(sizes))
        ]

    def data_rank(self, owner: int) -> int:
        return self.dcase.data_rank(owner) if self.by_slice else owner


def _sharded(dcase: DistributedCase, engine: str) -> bool:
    """Whether a rank holds a shard of the gradient: FSDP2, or tensor parallelism's nn.Linear plan."""
    return engine_named(engine).shards_parameters or (dcase.tensor_parallel > 1 and dcase.sequence_slices == 1)


def _local(tensor: Tensor) -> Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _flat_local(gradients: Sequence[Tensor | None], params: Sequence[Tensor]) -> Tensor:
    """This rank's shards of ``gradients`` as one float64 vector (zeros where a parameter got none)."""
    return torch.cat(
        [
            (torch.zeros_like(_local(p), dtype=torch.float64) if g is None else _local(g).detach().to(torch.float64))
            .reshape(-1)
            .cpu()
            for g, p in zip(gradients, params, strict=True)
        ]
    )


@dataclass(frozen=True)
class _WitnessTask:
    """One rank of the witness's run: the step in float64 up to ``step`` (0-based), under the check's engine."""

    candidate: Callable[..., Any]
    dcase: DistributedCase
    apply: tuple[Apply, ...]
    step: int
    sharded: bool = False
    #: the engine's wrapper of a rank's model and optimizer together (DeepSpeed), as the check's run had it
    wrap_optimizer: Callable[..., Any] | None = None

    def _wrapping(self) -> Wrapping:
        return Wrapping(torch.device(self.dcase.case.device).type, self.dcase, CollectiveCounts())

    def _wrap(self, model: nn.Module) -> nn.Module:
        wrapping = self._wrapping()
        for apply in self.apply:
            model = apply(model, wrapping)
        return model

    def __call__(self, rank: int, world_size: int, progress: Callable[[str], None]) -> RankWindow | _Fitted | None:
        case = self.dcase.case
        if self.dcase.sequence_slices > 1:  # a step reads its groups (layout()) as the check's run gave them
            install_layout(self.dcase.sequence_slices)
        else:
            clear_layout()
        start: list[dict[str, Tensor]] = []

        def gathered(model: nn.Module) -> None:  # every rank at the same step: a collective
            start.append(full_tensors({**dict(model.named_parameters()), **dict(model.named_buffers())}))

        progress(f"the witness: step {self.step + 1} in float64")
        window = capture(
            bind(self.candidate),
            case,
            self.step,
            {
                "wrap_model": self._wrap,
                "batch_slice": self.dcase.rank_slice(rank),
                "micro_batch_sizes": self.dcase.rank_micro_batches(rank),
                "catch_os_exit": False,
                **(
                    {}
                    if self.wrap_optimizer is None
                    else {
                        "wrap_optimizer": self.wrap_optimizer(self.dcase, rank, case.max_grad_norm, CollectiveCounts())
                    }
                ),
            },
            on_start=gathered if self.sharded else None,
        )
        if self.sharded:
            return self._fit_shards(rank, window, start[0] if start else None)
        if window is None or window.accumulated is None:
            return None
        gradients, items = sum_gradients(window, case)
        cpu = [[None if g is None else g.cpu() for g in micro] for micro in gradients]
        return [None if g is None else g.cpu() for g in window.accumulated], cpu, items

    def _fit_shards(self, rank: int, window: CapturedStep | None, start: dict[str, Tensor] | None) -> _Fitted | None:
        """The weights of every unit, fitted on this rank's shards with every other rank (see the module)."""
        case, dcase = self.dcase.case, self.dcase
        ready = window is not None and window.accumulated is not None and start is not None
        if window is not None and window.accumulated is not None:
            ready = ready and finite([window.accumulated])
        stepped = (
            window is not None and window.accumulated is not None and any(g is not None for g in window.accumulated)
        )
        readiness = torch.tensor([float(ready), float(stepped)], dtype=torch.float64)
        dist.all_reduce(readiness)
        if int(readiness[0].item()) != dcase.world_size or not readiness[1].item() > 0:
            # a rank never stepped there (or overflowed), or no rank's optimizer got a gradient (FSDP2's sync left
            # off on every micro-batch: nothing to re-weight): every rank leaves together
            return None
        assert window is not None and window.accumulated is not None and start is not None
        model = case.build_model().module.to(device=torch.device(case.device), dtype=torch.float64)
        # built as the run builds it (autocast never lowers float64), so its names and FSDP2 units are the run's
        replica = autocast_wrapped(model, case.autocast)
        persistent = replica.state_dict()
        replica.load_state_dict({name: value for name, value in start.items() if name in persistent})
        wrapping = self._wrapping()
        for apply in self.apply:
            replica = apply(replica, wrapping)
        # FSDP2 averages what it reduce-scatters over its mesh (data ranks): a loss sum taken times that many
        averaged = (
            (wrapping.tp_mesh["dp"].size() if wrapping.tp_mesh is not None else dcase.world_size)
            if apply_fsdp in self.apply
            else 1
        )
        accumulated = _flat_local(window.accumulated, [p for _, p in window.replica.named_parameters()])
        params = [dict(replica.named_parameters())[name] for name in window.names]
        loss_fn = case.build_loss()
        units = _Units(dcase)
        everyone = units.all()
        mine = units.owner(rank)
        shards: list[Tensor] = []
        items = torch.zeros(len(everyone), dtype=torch.float64)
        for number, (owner, index) in enumerate(everyone):
            owned = owner == mine
            inputs, targets = window.micro_batches[index if owned else 0]
            replica.zero_grad(set_to_none=True)
            output = replica(inputs)
            if owned:
                (loss_fn.sum(output.to(torch.float64), targets) * float(averaged)).backward()
                # one rank of the owner's group counts its items (a TP group's ranks see the same ones)
                if units.by_slice or rank % dcase.ranks_per_data_rank == 0:
                    items[number] = float(loss_fn.count(targets))
            else:  # zero times an output: every rank takes part in the collectives, never a loss over no item
                (output.sum() * 0.0).backward()
            shards.append(_flat_local([p.grad for p in params], params))
        dist.all_reduce(items)
        kept = [number for number in range(len(everyone)) if items[number] > 0]
        if not kept:
            return None
        recovered = recover_weights([shards[n] for n in kept], accumulated, all_reduce=dist.all_reduce)
        return _Fitted(recovered, [float(items[n]) for n in kept], [everyone[n] for n in kept])


def _named(
    recovered: Recovered, items: list[float], units: list[tuple[int, int]], dcase: DistributedCase, clipped: bool
) -> Witness:
    """The witness of the fitted units: in micro-batches (ranks the data ranks) where each micro-batch's slices
    got one weight, else in slices (ranks the ranks of the whole grid)."""
    split = _Units(dcase)
    if split.by_slice and recovered.weights is not None:
        groups: dict[tuple[int, int], list[int]] = {}
        for position, (owner, index) in enumerate(units):
            groups.setdefault((split.data_rank(owner), index), []).append(position)
        weights = recovered.weights
        common = [sum(weights[p] for p in members) / len(members) for members in groups.values()]
        # one weight: the slices agree within what an identifiable fit resolves (a tenth of the naming tolerance)
        if all(
            abs(weights[p] - weight) <= NAMING_TOLERANCE / 10 * abs(weight)
            for weight, members in zip(common, groups.values(), strict=True)
            for p in members
        ):
            collapsed = dataclasses.replace(recovered, weights=tuple(common), rank=len(common))
            counts = [sum(items[p] for p in members) for members in groups.values()]
            ranks = [data_rank for data_rank, _ in groups]
            return witness(collapsed, counts, configured_n=None, ranks=ranks, clipped=clipped)
    return witness(recovered, items, configured_n=None, ranks=[owner for owner, _ in units], clipped=clipped)


def rank_witnesses(
    sent: Any,
    dcase: DistributedCase,
    engine: str,
    verdicts: Sequence[Verdict],
    launcher: Launcher,
    timeout_s: float,
) -> list[Witness | None]:
    """Each rank's witness at the first step failing in the exact tier on any rank (None for a rank that
    passes, and for every rank where none fails there or the ranks' run raised or never stepped)."""
    exact = [d.step for v in verdicts for d in v.mismatches if d.tier == "exact"]
    record = engine_named(engine)
    # ZeRO's Muon overwrites each gradient with its update in place: no gradient to read, no witness.
    zero_muon = record.wrap_optimizer is not None and dcase.case.optimizer == DEEPSPEED_MUON
    if not exact or all(verdicts) or zero_muon:
        return [None] * len(verdicts)
    sharded = _sharded(dcase, engine)
    task = _WitnessTask(sent, dcase, record.apply, min(exact) - 1, sharded, record.wrap_optimizer)  # step 1-based
    # the sharded fit's own sums (items, the Gram) are CPU tensors: on CUDA they need the CPU backend beside NCCL
    sharded_on_cuda = sharded and dcase.case.device.startswith("cuda")
    try:
        windows: list[Any] = launcher(
            task,
            dcase.world_size,
            device=dcase.case.device,
            backend="cpu:gloo,cuda:nccl" if sharded_on_cuda else None,
            timeout_s=timeout_s,
            describe=f"the witness of {dcase!r}",
            match_collectives=True,
        )
    except DistributedCheckError:
        return [None] * len(verdicts)  # the step raised when run again: the verdicts stand without a witness
    clipped = dcase.case.max_grad_norm is not None
    if sharded:
        fitted = windows[0]
        if not isinstance(fitted, _Fitted):
            return [None] * len(verdicts)  # a rank never stepped there, or no unit had an item to count
        found = _named(fitted.recovered, fitted.items, fitted.units, dcase, clipped)
        return [None if verdict else found for verdict in verdicts]
    if any(window is None or not finite([window[0], *window[1]]) for window in windows):
        return [None] * len(verdicts)  # a rank never stepped there, or its window overflowed: nothing to read
    # every rank's units (micro-batches, or under split sequences its slices of them) but those with no item
    units = [
        (rank, index, gradient, count)
        for rank, window in enumerate(windows)
        for index, (gradient, count) in enumerate(zip(window[1], window[2], strict=True))
        if count > 0
    ]
    if not units:
        return [None] * len(verdicts)
    split = _Units(dcase)
    owners = [(split.owner(rank), index) for rank, index, _, _ in units]
    out: list[Witness | None] = []
    for window, verdict in zip(windows, verdicts, strict=True):
        if verdict:
            out.append(None)
            continue
        recovered = recover_weights([gradient for _, _, gradient, _ in units], window[0])
        out.append(_named(recovered, [count for *_, count in units], owners, dcase, clipped))
    return out

"""The witness of a failing ``check_distributed`` step, per rank (issue 44).

Run only after the ranks' verdicts fail in the exact (float64) tier: the ranks
run the step once more in float64 up to its first failing step
(:func:`equiv.checking.witnessing.capture` on each rank, under the check's
engine), and each sends back the gradient its optimizer saw (``G_r``, after the
engine's all-reduce) and the float64 gradient of each of its micro-batches'
loss SUM.  Each rank's ``G_r`` is then fitted against every rank's
micro-batches, so the weights say what each rank's update made of each
micro-batch, its rank known to the naming (a per-rank mean needs it).

Only where every rank holds the whole model (DDP, one rank per data rank):
under FSDP2, tensor or context parallelism a rank's gradient is a shard, and
no witness is read (the verdict stands without one).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from equiv.cases.distributed import DistributedCase
from equiv.checking.witnessing import capture, finite, sum_gradients
from equiv.distributed.collectives import CollectiveCounts
from equiv.distributed.context_parallel import clear_layout
from equiv.distributed.engines import Apply, Wrapping, engine_named
from equiv.distributed.launcher import DistributedCheckError, Launcher
from equiv.judging.contract import bind
from equiv.judging.witness import recover_weights, witness
from equiv.results.verdict import Verdict
from equiv.results.witness import Witness

__all__ = ["WITNESS_READ", "rank_witnesses", "witness_deferred", "witnessable"]

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


#: What a rank sends back: (G_r, each micro-batch's loss-sum gradient, each micro-batch's items), or None.
RankWindow = tuple[list[Tensor | None], list[list[Tensor | None]], list[float]] | None


@dataclass(frozen=True)
class _WitnessTask:
    """One rank of the witness's run: the step in float64 up to ``step`` (0-based), under the check's engine."""

    candidate: Callable[..., Any]
    dcase: DistributedCase
    apply: tuple[Apply, ...]
    step: int

    def __call__(self, rank: int, world_size: int, progress: Callable[[str], None]) -> RankWindow:
        case = self.dcase.case
        clear_layout()  # whole sequences on every rank (only such cases get here)
        wrapping = Wrapping(torch.device(case.device).type, self.dcase, CollectiveCounts())

        def wrap(model: nn.Module) -> nn.Module:
            for apply in self.apply:
                model = apply(model, wrapping)
            return model

        progress(f"the witness: step {self.step + 1} in float64")
        window = capture(
            bind(self.candidate),
            case,
            self.step,
            wrap_model=wrap,
            batch_slice=self.dcase.rank_slice(rank),
            micro_batch_sizes=self.dcase.rank_micro_batches(rank),
            catch_os_exit=False,
        )
        if window is None or window.accumulated is None:
            return None
        gradients, items = sum_gradients(window, case)
        cpu = [[None if g is None else g.cpu() for g in micro] for micro in gradients]
        return [None if g is None else g.cpu() for g in window.accumulated], cpu, items


def witnessable(dcase: DistributedCase, engine: str) -> bool:
    """Whether every rank holds the whole model's gradient (DDP over whole sequences): the witness can be read."""
    return (
        not engine_named(engine).shards_parameters
        and dcase.tensor_parallel == 1
        and dcase.context_parallel == 1
        and dcase.sequence_slices == 1
    )


def rank_witnesses(
    sent: Any,
    dcase: DistributedCase,
    engine: str,
    verdicts: Sequence[Verdict],
    launcher: Launcher,
    timeout_s: float,
) -> list[Witness | None]:
    """Each rank's witness at the first step failing in the exact tier on any rank (None for a rank that
    passes, and for every rank where none fails there, the engine shards the gradient, or the ranks' run
    raised)."""
    exact = [d.step for v in verdicts for d in v.mismatches if d.tier == "exact"]
    if not exact or not witnessable(dcase, engine) or all(verdicts):
        return [None] * len(verdicts)
    task = _WitnessTask(sent, dcase, engine_named(engine).apply, min(exact) - 1)  # a row's step is 1-based
    try:
        windows: list[RankWindow] = launcher(
            task,
            dcase.world_size,
            device=dcase.case.device,
            backend=None,
            timeout_s=timeout_s,
            describe=f"the witness of {dcase!r}",
            match_collectives=True,
        )
    except DistributedCheckError:
        return [None] * len(verdicts)  # the step raised when run again: the verdicts stand without a witness
    if any(window is None or not finite([window[0], *window[1]]) for window in windows):
        return [None] * len(verdicts)  # a rank never stepped there, or its window overflowed: nothing to read
    gradients = [g for window in windows if window is not None for g in window[1]]
    items = [count for window in windows if window is not None for count in window[2]]
    ranks = [rank for rank, window in enumerate(windows) if window is not None for _ in window[2]]
    clipped = dcase.case.max_grad_norm is not None
    out: list[Witness | None] = []
    for window, verdict in zip(windows, verdicts, strict=True):
        if verdict or window is None:
            out.append(None)
            continue
        recovered = recover_weights(gradients, window[0])
        out.append(witness(recovered, items, configured_n=None, ranks=ranks, clipped=clipped))
    return out

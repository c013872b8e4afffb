"""Equivalence beyond one process: W data-parallel ranks x N micro-batches.

The distributed candidate contract is the single-process one, run on every
rank at once::

    step(model, optimizer, micro_batches, loss_fn) -> None

- ``model`` is the case's model wrapped in ``DistributedDataParallel`` (the
  process group is initialised: gloo on CPU, NCCL on CUDA);
- ``micro_batches`` are THIS rank's micro-batches: each step's global batch is
  cut into consecutive rank shards (sizes may differ between ranks), and each
  shard into that rank's micro-batches;
- ``loss_fn`` returns the mean over this micro-batch's items (with ``sum`` and
  ``count``), exactly as on one process.

The reference is one single-process full-batch step on the concatenated
global batch.  Every rank's parameters and optimizer state are compared with
it after every step, in the same two tiers as :func:`equiv.check`.  A comm hook
counts DDP's gradient all-reduces and their bytes per optimizer step: a
correct ``no_sync`` step all-reduces once per window, whatever N is.

Workers are spawned processes with a deadline: a rank that raises, hangs or
dies ends the check with :class:`DistributedCheckError` naming the rank and the
case, and no worker outlives the call.
"""

from __future__ import annotations

import math
import pickle
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from equiv.cases.case import Case, InvalidCase
from equiv.checking.check import TIERS, ReferenceRuns
from equiv.checking.contract import Candidate, candidate_name, check_signature, not_applicable_reasons
from equiv.checking.trajectory import Snapshot, run_candidate
from equiv.checking.verdict import Judgement, Tier, Verdict

__all__ = [
    "DistributedCase",
    "DistributedCheckError",
    "DistributedVerdict",
    "check_distributed",
]

#: Seconds a rank that already failed gives the others to report before all are stopped.
_GRACE_S = 3.0
#: Seconds the ranks may take to start (spawn, import torch, join the group) before timeout_s applies.
_STARTUP_S = 120.0


class DistributedCheckError(RuntimeError):
    """A rank raised, hung or died; the message names the rank(s) and the case."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DistributedCase:
    """A case run by ``len(rank_micro_batch_sizes)`` ranks.

    ``rank_micro_batch_sizes[r]`` cuts rank r's shard into micro-batches; the
    shards are consecutive pieces of each step's global batch, in rank order.
    ``case`` supplies everything else; its ``batch_size`` and
    ``micro_batch_sizes`` are derived (all ranks' micro-batches, in order).
    """

    case: Case
    rank_micro_batch_sizes: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, base: Case, rank_micro_batch_sizes: Sequence[Sequence[int]]) -> DistributedCase:
        ranks = tuple(tuple(sizes) for sizes in rank_micro_batch_sizes)
        if not ranks:
            raise InvalidCase("rank_micro_batch_sizes needs at least one rank, got ()")
        for rank, sizes in enumerate(ranks):
            if not sizes or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes):
                raise InvalidCase(
                    f"rank {rank} has micro-batch sizes {sizes}; every rank needs at least one micro-batch "
                    "of at least one sample"
                )
        flat = tuple(size for sizes in ranks for size in sizes)
        case = base.replace(batch_size=sum(flat), micro_batch_sizes=list(flat))
        return cls(case=case, rank_micro_batch_sizes=ranks)

    @property
    def world_size(self) -> int:
        return len(self.rank_micro_batch_sizes)

    def rank_slice(self, rank: int) -> slice:
        start = sum(sum(sizes) for sizes in self.rank_micro_batch_sizes[:rank])
        return slice(start, start + sum(self.rank_micro_batch_sizes[rank]))

    def to_dict(self) -> dict[str, Any]:
        return {"case": self.case.to_dict(), "rank_micro_batch_sizes": [list(s) for s in self.rank_micro_batch_sizes]}

    def __repr__(self) -> str:
        return f"DistributedCase.of({self.case!r}, {[list(s) for s in self.rank_micro_batch_sizes]!r})"


@dataclass(frozen=True, slots=True)
class CommStats:
    """DDP gradient all-reduces on one rank, per optimizer step."""

    calls_per_step: tuple[int, ...]
    bytes_per_step: tuple[int, ...]


@dataclass(frozen=True)
class DistributedVerdict(Judgement):
    """Truthy only when every rank matches the single-process full-batch step."""

    case: DistributedCase
    candidate: str
    #: One verdict per rank (its trajectory against the same references).
    ranks: tuple[Verdict, ...]
    #: tier -> per-rank all-reduce statistics
    comm: dict[str, tuple[CommStats, ...]] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return all(self.ranks)

    @property
    def status(self) -> str:
        statuses = {v.status for v in self.ranks}
        for status in ("not_applicable", "inherently_non_equivalent", "not_equivalent"):
            if status in statuses:
                return status
        return "equivalent"

    def allreduces_per_step(self, tier: str = "exact") -> set[int]:
        """The distinct all-reduce counts per step seen on any rank."""
        return {calls for stats in self.comm.get(tier, ()) for calls in stats.calls_per_step}

    def bytes_per_step(self, tier: str = "exact") -> int:
        """The most bytes any rank all-reduced in one step."""
        return max((b for stats in self.comm.get(tier, ()) for b in stats.bytes_per_step), default=0)

    def message(self) -> str:
        lines = [f"{self.case.world_size} ranks, micro-batches per rank {[list(s) for s in self.case.rank_micro_batch_sizes]}"]
        failing = [(rank, v) for rank, v in enumerate(self.ranks) if not v]
        if failing:
            rank, verdict = failing[0]
            body = [line for line in verdict.message().splitlines() if not line.startswith("Reproduce:")]
            lines.append(f"rank {rank} of {self.case.world_size}: " + "\n".join(body))
            if len(failing) > 1:
                lines.append(f"also not equivalent on rank(s) {[r for r, _ in failing[1:]]}")
        else:
            # One rank's summary suffices; the distributed reproduction follows.
            lines += [line for line in self.ranks[0].message().splitlines() if not line.startswith("Reproduce:")]
        for tier, _stats in sorted(self.comm.items()):
            lines.append(
                f"gradient all-reduces per step ({tier} tier): {sorted(self.allreduces_per_step(tier))}, "
                f"up to {self.bytes_per_step(tier)} bytes per step per rank"
            )
        lines.append(f"Reproduce: equiv.check_distributed({self.candidate}, {self.case!r})")
        return "\n".join(lines)



class _AllReduceCounter:
    """A DDP comm hook: the default all-reduce, counted per optimizer step."""

    def __init__(self) -> None:
        self.calls: list[int] = []
        self.bytes: list[int] = []

    def start_step(self, step: int) -> None:
        self.calls.append(0)
        self.bytes.append(0)

    # No annotations: DDP compares them with dist.GradBucket at registration,
    # and this module's postponed annotations would be strings.
    def hook(self, state, bucket):  # type: ignore[no-untyped-def]
        buffer = bucket.buffer()
        self.calls[-1] += 1
        self.bytes[-1] += buffer.numel() * buffer.element_size()
        return default_hooks.allreduce_hook(state, bucket)


def _worker(
    rank: int,
    candidate: Callable[..., Any],
    dcase: DistributedCase,
    tiers: list[tuple[str, str]],
    workdir: str,
    timeout_s: float,
) -> None:
    """One rank: run the candidate in each tier's dtype, save snapshots and counts."""
    out = Path(workdir)
    progress = out / f"rank{rank}.progress"
    try:
        torch.set_num_threads(1)
        device = torch.device(dcase.case.device)
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend, init_method=f"file://{out / 'store'}", rank=rank, world_size=dcase.world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        progress.write_text("ready")
        results: dict[str, Any] = {}
        for tier, dtype_name in tiers:
            counter = _AllReduceCounter()

            def wrap(model: nn.Module, counter: _AllReduceCounter = counter) -> nn.Module:
                ddp = DistributedDataParallel(model, device_ids=[rank] if device.type == "cuda" else None)
                ddp.register_comm_hook(None, counter.hook)
                return ddp

            def on_step(step: int, counter: _AllReduceCounter = counter, tier: str = tier) -> None:
                progress.write_text(f"{tier} tier, step {step}: in the candidate")
                counter.start_step(step)

            snapshots = run_candidate(
                dcase.case, candidate, getattr(torch, dtype_name), wrap_model=wrap,
                batch_slice=dcase.rank_slice(rank), micro_batch_sizes=dcase.rank_micro_batch_sizes[rank],
                on_step=on_step,
            )
            results[tier] = {"snapshots": snapshots, "calls": counter.calls, "bytes": counter.bytes}
        progress.write_text("finished")
        torch.save(results, out / f"rank{rank}.pt")
    except BaseException:
        (out / f"rank{rank}.error").write_text(traceback.format_exc())
        raise SystemExit(1) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        return f"killed by signal {-code}"
    return f"exit code {code}"


def _launch(
    candidate: Callable[..., Any], dcase: DistributedCase, tiers: list[tuple[str, str]], timeout_s: float
) -> list[dict[str, Any]]:
    context = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="equiv-ddp-") as workdir:
        out = Path(workdir)
        processes = [
            context.Process(target=_worker, args=(rank, candidate, dcase, tiers, workdir, timeout_s), daemon=True)
            for rank in range(dcase.world_size)
        ]
        try:
            for process in processes:
                process.start()
            # Start-up (spawning, importing torch, joining the group) has its own
            # bound; the check's timeout runs from when every rank is ready.
            deadline = time.monotonic() + _STARTUP_S + timeout_s
            started = False
            first_failure: float | None = None
            while True:
                if not started and all((out / f"rank{r}.progress").exists() for r in range(len(processes))):
                    started = True
                    deadline = min(deadline, time.monotonic() + timeout_s)
                codes = [p.exitcode for p in processes]
                if all(code == 0 for code in codes):
                    break
                failed = any(code not in (None, 0) for code in codes)
                if failed and first_failure is None:
                    first_failure = time.monotonic()
                grace_over = first_failure is not None and time.monotonic() - first_failure > _GRACE_S
                if (failed and all(code is not None for code in codes)) or grace_over:
                    raise DistributedCheckError(_failure_report(out, processes, dcase, candidate))
                if time.monotonic() > deadline:
                    raise DistributedCheckError(
                        f"the distributed check did not finish within {timeout_s:g} s"
                        f"{'' if started else f' (+ {_STARTUP_S:g} s to start)'}: "
                        + _failure_report(out, processes, dcase, candidate, hung=True)
                    )
                time.sleep(0.05)
            return [torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in range(dcase.world_size)]
        finally:
            # No worker outlives the call, whatever happened.
            for process in processes:
                if process.is_alive():
                    process.terminate()
            for process in processes:
                process.join(timeout=5)
                if process.is_alive():
                    process.kill()
                    process.join()


def _failure_report(
    out: Path, processes: list[Any], dcase: DistributedCase, candidate: Callable[..., Any], hung: bool = False
) -> str:
    lines = []
    # Root causes first: ranks that died without a word, then those that raised.
    order = sorted(range(len(processes)), key=lambda r: (not (out / f"rank{r}.error").exists(), r))
    order.sort(key=lambda r: processes[r].exitcode in (None, 0))
    for rank in order:
        code = processes[rank].exitcode
        error = out / f"rank{rank}.error"
        progress_file = out / f"rank{rank}.progress"
        progress = progress_file.read_text() if progress_file.exists() else "not started"
        if error.exists():
            last = error.read_text().strip().splitlines()[-1]
            lines.append(f"rank {rank} raised ({progress}): {last}")
        elif code not in (None, 0):
            lines.append(f"rank {rank} died with {_describe_exit(code)} ({progress}) and reported nothing")
        elif code is None:
            lines.append(f"rank {rank} {'hung' if hung else 'was stopped'} ({progress})")
    lines.append(f"candidate {candidate_name(candidate)}, case {dcase!r}")
    return "; ".join(lines)


def check_distributed(
    candidate: Candidate,
    dcase: DistributedCase,
    *,
    tiers: Sequence[Tier] = TIERS,
    timeout_s: float = 120.0,
) -> DistributedVerdict:
    """Run ``candidate`` on ``dcase.world_size`` local processes and compare
    every rank with the single-process full-batch step.

    ``candidate`` must be importable by name (a module-level function): the
    ranks are spawned processes that import it.  Raises
    :class:`DistributedCheckError` if a rank raises, hangs past ``timeout_s``
    (counted once every rank has started; starting has 120 s of its own) or
    dies; never leaves a process behind.
    """
    __tracebackhide__ = True
    if not isinstance(dcase, DistributedCase):
        raise TypeError(f"dcase must be an equiv.DistributedCase, got {type(dcase).__name__}")
    if not (timeout_s > 0 and math.isfinite(timeout_s)):
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
    try:
        pickle.dumps(candidate)
    except Exception as exc:
        raise TypeError(
            f"candidate {candidate_name(candidate)} cannot be sent to spawned ranks ({exc}); "
            "define it at module level in an importable module"
        ) from None
    check_signature(candidate)
    name = candidate_name(candidate)
    reasons = not_applicable_reasons(candidate, dcase.case)
    if reasons:  # nothing to run: every rank says why the case does not apply
        verdict = Verdict(case=dcase.case, candidate=name, mismatches=(), not_applicable=reasons)
        return DistributedVerdict(case=dcase, candidate=name, ranks=(verdict,) * dcase.world_size)
    if dcase.case.device.startswith("cuda") and torch.cuda.device_count() < dcase.world_size:
        raise ValueError(
            f"{dcase.world_size} ranks on {dcase.case.device!r} need as many GPUs, {torch.cuda.device_count()} visible"
        )
    references = ReferenceRuns.of(dcase.case, tiers)
    tier_dtypes: list[tuple[str, str]] = [
        (tier, str(references.dtype(tier)).removeprefix("torch.")) for tier in references.tiers
    ]
    per_rank = _launch(candidate, dcase, tier_dtypes, timeout_s)
    verdicts = []
    for results in per_rank:
        runs: dict[Tier, list[Snapshot]] = {tier: results[tier]["snapshots"] for tier in references.tiers}
        verdicts.append(references.verdict(name, runs))
    comm: dict[str, tuple[CommStats, ...]] = {
        tier: tuple(CommStats(tuple(r[tier]["calls"]), tuple(r[tier]["bytes"])) for r in per_rank)
        for tier in references.tiers
    }
    return DistributedVerdict(case=dcase, candidate=name, ranks=tuple(verdicts), comm=comm)

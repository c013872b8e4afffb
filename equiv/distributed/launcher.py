"""The launcher: run a task on W freshly spawned ranks, each in an initialised
process group, and report a rank that raises, hangs or dies by name.

:func:`run_on_ranks` is what the distributed checker
(:mod:`equiv.checking.distributed`) and the FSDP2 cost sweep
(:mod:`equiv.cost.fsdp`) both run through.  Ranks are fresh processes with a
deadline (started by a fork server that has imported torch once, see
:func:`_context`): a rank that raises, hangs or dies ends the run with
:class:`DistributedCheckError` naming the rank, where it was (its last
``progress``) and what the caller was running; no rank outlives the call.
"""

from __future__ import annotations

import math
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from equiv.distributed.matching import CollectiveLog

__all__ = ["DistributedCheckError", "RankTask", "run_on_ranks"]

#: Seconds a rank that already failed gives the others to report before all are stopped.
_GRACE_S = 3.0
#: Seconds the ranks may take to start (spawn, import torch, join the group) before timeout_s applies.
_STARTUP_S = 120.0


class DistributedCheckError(RuntimeError):
    """A rank raised, hung or died; the message names the rank(s) and the case."""



class RankTask(Protocol):
    """What :func:`run_on_ranks` runs on each rank, once the process group is up.

    ``progress(text)`` records where the rank is (named in fault reports).
    The return value goes back to the caller (it must be picklable).
    """

    def __call__(self, rank: int, world_size: int, progress: Callable[[str], None]) -> Any: ...




def _rank_main(
    rank: int, task: RankTask, world_size: int, device_type: str, backend: str, workdir: str, timeout_s: float,
    match_collectives: bool = False,
) -> None:
    """One spawned rank: join the group, run ``task``, save what it returns
    (with ``match_collectives``: its collectives recorded and compared with
    its peers', see :mod:`equiv.distributed.matching`)."""
    out = Path(workdir)
    progress = out / f"rank{rank}.progress"
    log: CollectiveLog | None = None
    try:
        torch.set_num_threads(1)
        if device_type == "cuda":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend, init_method=f"file://{out / 'store'}", rank=rank, world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        progress.write_text("ready")
        if match_collectives:
            store = dist.FileStore(str(out / "collectives"), world_size)
            log = CollectiveLog(store, rank, world_size, where=progress.read_text)
            log.install()

        def report(text: str) -> None:
            progress.write_text(text)

        result = task(rank, world_size, report)
        if log is not None:
            progress.write_text("after its task")
            log.end_of_task()
        progress.write_text("finished")
        torch.save(result, out / f"rank{rank}.pt")
    except BaseException:
        if log is not None and log.mismatch is not None:
            (out / f"rank{rank}.mismatch").write_text(log.mismatch)
        (out / f"rank{rank}.error").write_text(traceback.format_exc())
        raise SystemExit(1) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _context() -> Any:
    """Where ranks come from: a fork server that has imported torch and equiv
    once, so a launch does not pay for it again (about 5 s of every start
    on two cores).  A rank still starts as a clean child of that server, as
    with spawn: nothing of the caller's state is inherited, CUDA included
    (the server never initialises it).  The server is started on the first
    launch and ends with the calling process."""
    context = mp.get_context("forkserver")
    # "equiv" is the facade: importing it imports the checker, whose tasks are
    # the usual ones (named as a string: the launcher itself imports nothing above it).
    context.set_forkserver_preload(["torch", "torch.distributed.fsdp", "equiv"])
    return context


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        return f"killed by signal {-code}"
    return f"exit code {code}"


def run_on_ranks(
    task: RankTask,
    world_size: int,
    *,
    device: str = "cpu",
    backend: str | None = None,
    timeout_s: float = 120.0,
    describe: str = "",
    match_collectives: bool = False,
) -> list[Any]:
    """Run ``task(rank, world_size, progress)`` on ``world_size`` spawned
    processes, each in an initialised process group (gloo on CPU, NCCL on
    CUDA, unless ``backend`` says otherwise), and return what each returned,
    in rank order.

    ``task`` must be picklable (a module-level function, or an instance of a
    module-level class).  Raises :class:`DistributedCheckError` naming the
    rank(s) and ``describe`` if a rank raises, hangs past ``timeout_s``
    (counted once every rank has started; starting has 120 s of its own) or
    dies; never leaves a process behind.

    ``match_collectives``: record every collective each rank makes and
    compare it with its peers' (:mod:`equiv.distributed.matching`), so ranks
    whose collectives do not line up end at once with a report of which rank
    called what, where, instead of a backend error or a wait until the
    timeout.  It costs a few file-store operations per collective: leave it
    off where steps are timed.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if not (timeout_s > 0 and math.isfinite(timeout_s)):
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
    device_type = torch.device(device).type
    if device_type == "cuda" and torch.cuda.device_count() < world_size:
        raise ValueError(f"{world_size} ranks on {device!r} need as many GPUs, {torch.cuda.device_count()} visible")
    if backend is None:
        backend = "nccl" if device_type == "cuda" else "gloo"
    context = _context()
    with tempfile.TemporaryDirectory(prefix="equiv-ranks-") as workdir:
        out = Path(workdir)
        processes = [
            context.Process(
                target=_rank_main, args=(rank, task, world_size, device_type, backend, workdir, timeout_s,
                                         match_collectives),
                daemon=True,
            )
            for rank in range(world_size)
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
                # A collective mismatch is the root cause: the peers are left waiting, no grace needed.
                grace_over = grace_over or (failed and any((out / f"rank{r}.mismatch").exists()
                                                           for r in range(len(processes))))
                if (failed and all(code is not None for code in codes)) or grace_over:
                    raise DistributedCheckError(_failure_report(out, processes, describe))
                if time.monotonic() > deadline:
                    raise DistributedCheckError(
                        f"the distributed check did not finish within {timeout_s:g} s"
                        f"{'' if started else f' (+ {_STARTUP_S:g} s to start)'}: "
                        + _failure_report(out, processes, describe, hung=True)
                    )
                time.sleep(0.05)
            return [torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in range(world_size)]
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


def _progress(out: Path, rank: int) -> str:
    progress_file = out / f"rank{rank}.progress"
    return progress_file.read_text() if progress_file.exists() else "not started"


def _failure_report(out: Path, processes: list[Any], describe: str, hung: bool = False) -> str:
    found = [path.read_text() for path in (out / f"rank{rank}.mismatch" for rank in range(len(processes)))
             if path.exists()]
    if found:  # the root cause: the other ranks' errors (a peer left, a wait timed out) follow from it
        return f"{found[0]}; {describe}" if describe else found[0]
    lines = []
    # Root causes first: ranks that failed before ranks still running; among
    # those that raised, the first to raise (the others often fail because it
    # left a collective, e.g. an FSDP all-gather, waiting), then silent deaths.
    def raised_at(rank: int) -> tuple[bool, int, int]:
        error = out / f"rank{rank}.error"
        return (not error.exists(), error.stat().st_mtime_ns if error.exists() else 0, rank)

    order = sorted(range(len(processes)), key=raised_at)
    order.sort(key=lambda r: processes[r].exitcode in (None, 0))
    for rank in order:
        code = processes[rank].exitcode
        error = out / f"rank{rank}.error"
        progress = _progress(out, rank)
        if error.exists():
            last = error.read_text().strip().splitlines()[-1]
            lines.append(f"rank {rank} raised ({progress}): {last}")
        elif code not in (None, 0):
            lines.append(f"rank {rank} died with {_describe_exit(code)} ({progress}) and reported nothing")
        elif code is None:
            lines.append(f"rank {rank} {'hung' if hung else 'was stopped'} ({progress})")
    if describe:
        lines.append(describe)
    return "; ".join(lines)


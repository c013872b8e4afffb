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
import multiprocessing
import os
import re
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from equiv.distributed.matching import CollectiveLog
from equiv.outcomes import Fault

__all__ = [
    "DistributedCheckError",
    "Launcher",
    "RankOutcome",
    "RankState",
    "RankTask",
    "UnguardedMainError",
    "fault_of",
    "fault_report",
    "run_on_ranks",
    "run_rank_task",
]

#: Seconds a rank that already failed gives the others to report before all are stopped.
_GRACE_S = 3.0
#: Seconds the ranks may take to start (spawn, import torch, join the group) before timeout_s applies.
_STARTUP_S = 120.0


class DistributedCheckError(RuntimeError):
    """A rank raised, hung or died; the message names the rank(s) and the case,
    ``fault`` (:class:`~equiv.outcomes.Fault`) says which, as data: read it,
    never the message."""

    def __init__(self, message: str, fault: Fault = Fault.RAISED) -> None:
        super().__init__(message)
        self.fault = fault

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (str(self), self.fault)


class UnguardedMainError(RuntimeError):
    """The ranks could not start: each one imports the calling script again
    (spawned processes do), and the script's module-level code launched ranks
    again there.  Not a fault of the step, so never a verdict: the call
    belongs under ``if __name__ == "__main__":``."""


#: A rank's exit code for "my script launched ranks again while I was importing it"
#: (see :func:`_refuse_launch_while_bootstrapping`); any code no rank exits with otherwise.
_UNGUARDED_MAIN_EXIT = 87


def _refuse_launch_while_bootstrapping() -> None:
    """In a rank still importing its parent's main script (multiprocessing's own
    test before it refuses to start a process, ``spawn._check_not_importing_main``):
    end this rank at once with :data:`_UNGUARDED_MAIN_EXIT`, silently, so its
    parent raises one :class:`UnguardedMainError` instead of every rank printing
    multiprocessing's bootstrapping traceback and the check ending as a rank that died."""
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        sys.stdout.flush()
        os._exit(_UNGUARDED_MAIN_EXIT)


def _unguarded_main(describe: str) -> UnguardedMainError:
    main = getattr(sys.modules.get("__main__"), "__file__", None) or "your script"
    return UnguardedMainError(
        f"{describe or 'the check'}: the ranks never started, because each one imports {main} again (a spawned "
        "process does) and its module-level code calls equiv again there: put that call under "
        '`if __name__ == "__main__":` (https://docs.python.org/3/library/multiprocessing.html'
        "#the-spawn-and-forkserver-start-methods)"
    )


class RankTask(Protocol):
    """What :func:`run_on_ranks` runs on each rank, once the process group is up.

    ``progress(text)`` records where the rank is (named in fault reports).
    The return value goes back to the caller (it must be picklable).
    """

    def __call__(self, rank: int, world_size: int, progress: Callable[[str], None]) -> Any: ...


class Launcher(Protocol):
    """What runs a task on W ranks and returns what each returned, in rank
    order, or raises :class:`DistributedCheckError`: :func:`run_on_ranks`
    (spawned ranks), or :meth:`equiv.distributed.torchrun.TorchrunRanks.run`
    (the ranks torchrun started, this process rank 0)."""

    def __call__(
        self,
        task: RankTask,
        world_size: int,
        *,
        device: str = "cpu",
        backend: str | None = None,
        timeout_s: float = 120.0,
        describe: str = "",
        match_collectives: bool = False,
    ) -> list[Any]: ...


@dataclass
class RankOutcome:
    """How one rank's task ended: its result, or the traceback it raised (and
    the collective mismatch found there, the root cause when set)."""

    result: Any = None
    error: str | None = None
    mismatch: str | None = None
    #: When it raised (``time.time()``): the first to raise is named first.
    raised_at: float | None = None


def run_rank_task(
    task: RankTask,
    rank: int,
    world_size: int,
    progress: Callable[[str], None],
    where: Callable[[], str],
    collective_store: dist.Store | None = None,
) -> RankOutcome:
    """Run ``task`` on this rank, in an initialised process group; with a
    ``collective_store``, its collectives are recorded there and compared
    with its peers' (:mod:`equiv.distributed.matching`).  What every launcher
    runs on a rank (:func:`run_on_ranks`'s spawned ranks, torchrun's)."""
    log: CollectiveLog | None = None
    try:
        if collective_store is not None:
            log = CollectiveLog(collective_store, rank, world_size, where=where)
            log.install()
        result = task(rank, world_size, progress)
        if log is not None:
            progress("after its task")
            log.end_of_task()
        return RankOutcome(result=result)
    except BaseException:
        return RankOutcome(
            error=traceback.format_exc(), mismatch=None if log is None else log.mismatch, raised_at=time.time()
        )
    finally:
        if log is not None:
            log.uninstall()


def _rank_main(
    rank: int,
    task: RankTask,
    world_size: int,
    device_type: str,
    backend: str,
    workdir: str,
    timeout_s: float,
    match_collectives: bool = False,
) -> None:
    """One spawned rank: join the group, run ``task``, save what it returns
    (with ``match_collectives``: its collectives recorded and compared with
    its peers', see :mod:`equiv.distributed.matching`)."""
    out = Path(workdir)
    progress = out / f"rank{rank}.progress"
    try:
        torch.set_num_threads(1)
        if device_type == "cuda":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend,
            init_method=f"file://{out / 'store'}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        progress.write_text("ready")
        store = dist.FileStore(str(out / "collectives"), world_size) if match_collectives else None

        def report(text: str) -> None:
            progress.write_text(text)

        outcome = run_rank_task(task, rank, world_size, report, progress.read_text, store)
        if outcome.error is not None:
            if outcome.mismatch is not None:
                (out / f"rank{rank}.mismatch").write_text(outcome.mismatch)
            (out / f"rank{rank}.error").write_text(outcome.error)
            raise SystemExit(1)
        progress.write_text("finished")
        torch.save(outcome.result, out / f"rank{rank}.pt")
    except SystemExit:
        raise
    except BaseException:
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


#: What :func:`_exit_code` gives a rank that exited with code 0 but saved no result.
_EXITED_WITHOUT_RESULT = -1000


def _exit_code(out: Path, rank: int, process: Any) -> int | None:
    """The rank's exit code, where a rank that exited with code 0 but saved no result
    (the step called ``os._exit(0)``) is :data:`_EXITED_WITHOUT_RESULT`: a rank that died,
    never one that finished (a finished rank saves its result before it exits)."""
    code: int | None = process.exitcode
    if code == 0 and not (out / f"rank{rank}.pt").exists():
        return _EXITED_WITHOUT_RESULT
    return code


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code == _EXITED_WITHOUT_RESULT:
        return "exit code 0 before its task returned (os._exit in the step?)"
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
    device_type, backend = _launch_settings(world_size, device, backend, timeout_s)
    context = _context()
    with tempfile.TemporaryDirectory(prefix="equiv-ranks-") as workdir:
        out = Path(workdir)
        processes = [
            context.Process(
                target=_rank_main,
                args=(rank, task, world_size, device_type, backend, workdir, timeout_s, match_collectives),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        try:
            for process in processes:
                process.start()
            _wait(out, processes, LaunchClock(timeout_s), describe)
            return [torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in range(world_size)]
        finally:
            _stop(processes)


def _launch_settings(world_size: int, device: str, backend: str | None, timeout_s: float) -> tuple[str, str]:
    """The device type and backend of a launch, refused (a ValueError naming the value)
    when no rank could run it."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if not (timeout_s > 0 and math.isfinite(timeout_s)):
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
    _refuse_launch_while_bootstrapping()
    device_type = torch.device(device).type
    if device_type == "cuda" and torch.cuda.device_count() < world_size:
        raise ValueError(f"{world_size} ranks on {device!r} need as many GPUs, {torch.cuda.device_count()} visible")
    return device_type, backend if backend is not None else "nccl" if device_type == "cuda" else "gloo"


@dataclass
class LaunchClock:
    """When a launch's ranks have taken too long.  Start-up (spawning, importing
    torch, joining the group) has ``startup_s`` of its own; the check's
    ``timeout_s`` runs from when every rank is ready.  A rank that failed gives
    the others ``grace_s`` to report theirs before all are stopped."""

    timeout_s: float
    startup_s: float = _STARTUP_S
    grace_s: float = _GRACE_S
    #: Every rank is ready (the check's timeout runs).
    started: bool = False
    #: ``time.monotonic()`` when the first failure was seen (None: none yet).
    first_failure: float | None = None
    deadline: float = field(init=False)

    def __post_init__(self) -> None:
        self.deadline = time.monotonic() + self.startup_s + self.timeout_s

    def started_if(self, ready: Callable[[], bool]) -> None:
        """Start the check's timeout once every rank is ``ready`` (asked only until they are)."""
        if not self.started and ready():
            self.started = True
            self.deadline = min(self.deadline, time.monotonic() + self.timeout_s)

    def failing(self, failed: bool) -> None:
        """Start the grace at the first poll that saw a rank ``failed``."""
        if failed and self.first_failure is None:
            self.first_failure = time.monotonic()

    @property
    def grace_over(self) -> bool:
        return self.first_failure is not None and time.monotonic() - self.first_failure > self.grace_s

    @property
    def hung(self) -> bool:
        return time.monotonic() > self.deadline

    def hung_words(self) -> str:
        """The start of a hang's report: how long the ranks had."""
        to_start = "" if self.started else f" (+ {self.startup_s:g} s to start)"
        return f"the distributed check did not finish within {self.timeout_s:g} s{to_start}: "


def _wait(out: Path, processes: list[Any], clock: LaunchClock, describe: str) -> None:
    """Poll the spawned ranks until every one exited cleanly; raise the fault of ranks
    that raised, died, mismatched their collectives or hung (past ``clock``'s deadline)."""
    ranks = range(len(processes))

    def ready() -> bool:
        return all((out / f"rank{r}.progress").exists() for r in ranks)

    while True:
        clock.started_if(ready)
        codes = [_exit_code(out, rank, p) for rank, p in enumerate(processes)]
        if all(code == 0 for code in codes):
            return
        if _UNGUARDED_MAIN_EXIT in codes and not clock.started:
            raise _unguarded_main(describe)
        failed = any(code not in (None, 0) for code in codes)
        clock.failing(failed)
        # A collective mismatch is the root cause: the peers are left waiting, no grace needed.
        mismatch = failed and any((out / f"rank{r}.mismatch").exists() for r in ranks)
        if (failed and all(code is not None for code in codes)) or clock.grace_over or mismatch:
            raise _fault(out, processes, describe)
        if clock.hung:
            raise _fault(out, processes, describe, hung=clock.hung_words())
        time.sleep(0.05)


def _stop(processes: list[Any]) -> None:
    """No worker outlives the call, whatever happened."""
    launched = [process for process in processes if process.pid is not None]  # start() may have raised
    for process in launched:
        if process.is_alive():
            process.terminate()
    for process in launched:
        process.join(timeout=5)
        if process.is_alive():
            process.kill()
            process.join()


@dataclass(frozen=True)
class RankState:
    """What a launcher knows of one rank when a run goes wrong."""

    rank: int
    #: Its last progress report ("not started" if none).
    progress: str
    #: The traceback it raised, if it did.
    error: str | None = None
    raised_at: float = 0.0
    mismatch: str | None = None
    #: True while it runs; else how it ended, e.g. "exit code 1" (None: ended cleanly).
    running: bool = False
    death: str | None = None


#: A backend's error for a collective that waited past the process group's timeout
#: (gloo: "Timed out waiting 5000ms for recv operation"; NCCL's watchdog: "collective operation timeout").
_TIMED_OUT = re.compile(r"Timed out waiting \d+ ?ms for|collective operation timeout")


def _waited_on(states: list[RankState], hung: bool) -> bool:
    """Whether a rank still running is the root cause: the deadline passed (``hung``), or a
    peer gave up waiting for it in a collective (its backend's timeout, which the process
    group's timeout, the check's own, can fire a moment before the launcher's deadline)."""
    return any(state.running for state in states) and (
        hung or any(state.error is not None and _TIMED_OUT.search(state.error) is not None for state in states)
    )


def fault_report(states: list[RankState], describe: str, hung: bool = False) -> str:
    """The report of a run that went wrong, root causes first: a collective
    mismatch; at a deadline (``hung``), the ranks still running, then the peers
    that timed out waiting for them in a collective (named so, not by their
    backend's timeout error); else ranks that raised (the first to raise first:
    the others often fail because it left a collective waiting), then ranks that
    died silently, then ranks still running (stopped)."""
    found = [state.mismatch for state in states if state.mismatch is not None]
    if found:  # the root cause: the other ranks' errors (a peer left, a wait timed out) follow from it
        return f"{found[0]}; {describe}" if describe else found[0]
    lines = []
    # At the deadline a rank still running is the root cause: a peer that raised meanwhile was
    # almost always left waiting for it in a collective until the backend's own timeout
    # (the process group's timeout is the check's), so the hung rank is named first.
    waited_on = _waited_on(states, hung)
    order = sorted(
        states,
        key=lambda s: (
            s.running != waited_on,
            s.error is None and s.death is None,
            s.error is None,
            s.raised_at,
            s.rank,
        ),
    )
    for state in order:
        if state.error is not None and waited_on and _TIMED_OUT.search(state.error):
            lines.append(f"rank {state.rank} was waiting in a collective ({state.progress}) and timed out there")
        elif state.error is not None:
            lines.append(f"rank {state.rank} raised ({state.progress}): {state.error.strip().splitlines()[-1]}")
        elif state.death is not None:
            lines.append(f"rank {state.rank} died with {state.death} ({state.progress}) and reported nothing")
        elif state.running:
            lines.append(f"rank {state.rank} {'hung' if waited_on else 'was stopped'} ({state.progress})")
    if describe:
        lines.append(describe)
    return "; ".join(lines)


def fault_of(states: list[RankState], hung: bool = False) -> Fault:
    """What went wrong, the root cause first: a collective mismatch, then a rank
    still running at the deadline (``hung``) or while a peer timed out waiting for
    it in a collective, then a rank that died without
    reporting (its peers' errors, a connection closed, follow from it), else a
    rank that raised."""
    if any(state.mismatch is not None for state in states):
        return Fault.COLLECTIVE_MISMATCH
    if _waited_on(states, hung):
        return Fault.HUNG
    if any(state.death is not None and state.error is None for state in states):
        return Fault.DIED
    return Fault.RAISED


def _fault(out: Path, processes: list[Any], describe: str, hung: str = "") -> DistributedCheckError:
    """The error of a run that went wrong; ``hung``: what the deadline says, when it passed."""
    states = _rank_states(out, processes)
    return DistributedCheckError(hung + fault_report(states, describe, hung=bool(hung)), fault_of(states, bool(hung)))


def _rank_states(out: Path, processes: list[Any]) -> list[RankState]:
    states = []
    for rank, process in enumerate(processes):
        error, mismatch, progress = (out / f"rank{rank}.{name}" for name in ("error", "mismatch", "progress"))
        code = _exit_code(out, rank, process)
        states.append(
            RankState(
                rank=rank,
                progress=progress.read_text() if progress.exists() else "not started",
                error=error.read_text() if error.exists() else None,
                raised_at=error.stat().st_mtime if error.exists() else 0.0,
                mismatch=mismatch.read_text() if mismatch.exists() else None,
                running=code is None,
                death=_describe_exit(code) if code not in (None, 0) else None,
            )
        )
    return states

"""The ranks ``torchrun`` started, as a launcher: a check run where users run training.

    torchrun --standalone --nproc-per-node 2 -m equiv check-distributed mypkg.train:step

Every process torchrun starts reads the standard environment (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``, see
:class:`TorchrunEnv`) and runs the same command.  Rank 0 drives: it runs the
check itself (the single-process references, the judge, a rerun for the
precision class), and each time the check needs the ranks it posts the task in
torchrun's rendezvous store and runs its own share (:meth:`TorchrunRanks.run`,
a :class:`~equiv.distributed.launcher.Launcher` like
:func:`~equiv.distributed.launcher.run_on_ranks`).  The other ranks serve
(:meth:`TorchrunRanks.serve`): they run each posted task and post what it
returned, until rank 0 posts the end and its exit code.

Faults are reported as for spawned ranks
(:func:`~equiv.distributed.launcher.fault_report`): a rank that raises, makes
mismatched collectives or hangs past the timeout (counted once every rank is
ready for the task) ends the check on rank 0 with a
:class:`~equiv.distributed.launcher.DistributedCheckError` naming it and where
it was.  Each task runs in a thread of its own, so the process watching it is
never the one stuck in a collective.  A rank that dies is seen by torchrun's
agent, which stops the others: rank 0 then says so, with where each rank
was, before it exits.
"""

from __future__ import annotations

import io
import os
import signal
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from equiv.distributed.launcher import (
    DistributedCheckError,
    LaunchClock,
    RankOutcome,
    RankState,
    RankTask,
    fault_of,
    fault_report,
    run_rank_task,
)

__all__ = ["TorchrunEnv", "TorchrunRanks"]

#: The variables torchrun sets for every process it starts.
_REQUIRED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
#: Seconds a rank that already failed gives the others to report before rank 0 reports.
_GRACE_S = 3.0
#: Seconds the ranks may take to pick up a task (and join the group, the first time) before timeout_s applies.
_STARTUP_S = 120.0
_POLL_S = 0.02


@dataclass(frozen=True)
class TorchrunEnv:
    """This process's place among the ranks torchrun started."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    #: torchrun's agent hosts the store at MASTER_ADDR:MASTER_PORT (every rank a client).
    agent_store: bool
    #: Keys of this run (torchrun's run id and restart count), so a restarted run starts afresh.
    run_key: str

    @classmethod
    def read(cls, environ: Mapping[str, str] | None = None) -> TorchrunEnv | None:
        """The environment torchrun sets, or None outside torchrun (none of it
        set); raises ``ValueError`` naming what is missing or malformed."""
        environ = os.environ if environ is None else environ
        present = [name for name in _REQUIRED if name in environ]
        if not present:
            return None
        missing = [name for name in _REQUIRED if name not in environ]
        if missing:
            raise ValueError(
                f"started as one of several ranks ({', '.join(present)} set) but {', '.join(missing)} "
                "not set: start the command with torchrun (e.g. torchrun --standalone --nproc-per-node 2 -m equiv ...)"
            )
        try:
            rank, world_size, local_rank, port = (
                int(environ[name]) for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")
            )
        except ValueError:
            raise ValueError(
                "RANK, WORLD_SIZE, LOCAL_RANK and MASTER_PORT must be integers, got "
                + ", ".join(f"{n}={environ[n]!r}" for n in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"))
            ) from None
        if not 0 <= rank < world_size:
            raise ValueError(f"RANK must be in [0, WORLD_SIZE={world_size}), got {rank}")
        return cls(
            rank=rank,
            world_size=world_size,
            local_rank=local_rank,
            master_addr=environ["MASTER_ADDR"],
            master_port=port,
            agent_store=environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
            run_key=f"{environ.get('TORCHELASTIC_RUN_ID', 'none')}/{environ.get('TORCHELASTIC_RESTART_COUNT', '0')}",
        )


def _dumps(value: Any) -> Any:
    """``value`` as a store value: bytes (the store's stubs say str; it stores bytes as they are)."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _loads(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


class TorchrunRanks:
    """This process as one of torchrun's ranks (see the module's docstring).

    Use as a context manager; rank 0 calls :meth:`run` as the check's
    launcher and :meth:`end` with the exit code, every other rank
    :meth:`serve`, which returns that code.
    """

    def __init__(self, env: TorchrunEnv) -> None:
        self.env = env
        self._prefix = f"equiv/{env.run_key}/"
        self._launches = 0
        self._group: tuple[str, str] | None = None  # (device type, backend) once the process group is up
        self._worker: threading.Thread | None = None

    # ------------------------------------------------------------ the store
    def _client(self) -> dist.Store:
        """A connection of its own to the rendezvous store (one per thread:
        the task's thread writes while the main thread watches)."""
        # Under torchrun the agent hosts the store; started by hand, rank 0 hosts it.
        hosts = self.env.rank == 0 and not self.env.agent_store
        store = dist.TCPStore(
            self.env.master_addr,
            self.env.master_port,
            world_size=self.env.world_size if hosts else None,
            is_master=hosts,
            timeout=timedelta(seconds=_STARTUP_S),
            wait_for_workers=False,
        )
        return dist.PrefixStore(self._prefix, store)

    def __enter__(self) -> TorchrunRanks:
        self._store = self._client()
        if self.env.rank == 0:
            # torchrun's agent stops every rank when one dies: say so, and where each rank was.
            self._previous_handler = signal.signal(signal.SIGTERM, self._stopped)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.env.rank == 0:
            signal.signal(signal.SIGTERM, self._previous_handler)

    @property
    def task_running(self) -> bool:
        """Whether this rank's share of a task is still running (stuck in a
        collective after a fault elsewhere)."""
        return self._worker is not None and self._worker.is_alive()

    def _has(self, key: str) -> bool:
        return bool(self._store.check([key]))

    # ------------------------------------------------------- one rank's share
    def _run_share(self, launch: int, command: dict[str, Any]) -> None:
        """This rank's share of a posted task, in the task's own thread: join
        the group (the first time), run it, post how it ended."""
        store = self._client()
        rank, key = self.env.rank, f"{launch}/"
        where = ["ready"]

        def progress(text: str) -> None:
            where[0] = text
            store.set(f"{key}progress/{rank}", text)

        try:
            device_type, backend = command["device_type"], command["backend"]
            if device_type == "cuda":
                torch.cuda.set_device(self.env.local_rank)  # per thread: each task's thread sets it
            if self._group is None:
                dist.init_process_group(
                    backend,
                    store=dist.PrefixStore("group", store),
                    rank=rank,
                    world_size=self.env.world_size,
                    timeout=timedelta(seconds=command["timeout_s"] + _STARTUP_S),
                )
                self._group = (device_type, backend)
            elif self._group != (device_type, backend):
                raise ValueError(
                    f"the ranks joined a {self._group[1]} group on {self._group[0]}; this task "
                    f"needs {backend} on {device_type}"
                )
            store.set(f"{key}ready/{rank}", "1")
            progress("ready")
            collectives = dist.PrefixStore(f"{key}collectives", store) if command["match_collectives"] else None
            outcome = run_rank_task(command["task"], rank, self.env.world_size, progress, lambda: where[0], collectives)
        except BaseException as exc:
            outcome = RankOutcome(error=f"{type(exc).__name__}: {exc}", raised_at=time.time())
            store.set(f"{key}ready/{rank}", "1")
        store.set(f"{key}outcome/{rank}", _dumps(outcome))

    def _start_share(self, launch: int, command: dict[str, Any]) -> threading.Thread:
        thread = threading.Thread(
            target=self._run_share, args=(launch, command), daemon=True, name=f"equiv-rank{self.env.rank}-task{launch}"
        )
        thread.start()
        self._worker = thread
        return thread

    # ------------------------------------------------------------ rank 0
    def run(
        self,
        task: RankTask,
        world_size: int,
        *,
        device: str = "cpu",
        backend: str | None = None,
        timeout_s: float = 120.0,
        describe: str = "",
        match_collectives: bool = False,
    ) -> list[Any]:
        """Rank 0: run ``task`` on every rank torchrun started and return what
        each returned, in rank order (a
        :class:`~equiv.distributed.launcher.Launcher`); raises
        :class:`DistributedCheckError` as :func:`run_on_ranks` does."""
        if self.env.rank != 0:
            raise RuntimeError(f"only rank 0 drives the ranks; this is rank {self.env.rank} (call serve())")
        if world_size != self.env.world_size:
            raise ValueError(
                f"the case has {world_size} ranks; torchrun started {self.env.world_size} "
                f"(--nproc-per-node x --nnodes): give a split with one entry per rank"
            )
        device_type = torch.device(device).type
        command = {
            "task": task,
            "device_type": device_type,
            "timeout_s": timeout_s,
            "match_collectives": match_collectives,
            "backend": backend or ("nccl" if device_type == "cuda" else "gloo"),
        }
        launch = self._launches
        self._launches += 1
        posted = _dumps(command)
        self._store.set(f"task/{launch}", posted)
        # Rank 0 runs what every rank runs: the task as posted, unpickled (a step sent by name is loaded).
        self._start_share(launch, _loads(posted))
        return self._results(launch, LaunchClock(timeout_s, startup_s=_STARTUP_S, grace_s=_GRACE_S), describe)

    def _results(self, launch: int, clock: LaunchClock, describe: str) -> list[Any]:
        """What every rank returned from ``launch``, in rank order, once all have; raises the
        :class:`DistributedCheckError` of ranks that raised, died, mismatched or hung."""
        key = f"{launch}/"
        ranks = range(self.env.world_size)
        outcomes: dict[int, RankOutcome] = {}

        def ready() -> bool:
            return all(self._has(f"{key}ready/{r}") for r in ranks)

        while True:
            clock.started_if(ready)
            for r in ranks:
                if r not in outcomes and self._has(f"{key}outcome/{r}"):
                    outcomes[r] = _loads(self._store.get(f"{key}outcome/{r}"))
            failed = any(o.error is not None for o in outcomes.values())
            if len(outcomes) == len(ranks) and not failed:
                return [outcomes[r].result for r in ranks]
            clock.failing(failed)
            stop = len(outcomes) == len(ranks) or any(o.mismatch is not None for o in outcomes.values())
            hung = clock.hung
            if (failed and (stop or clock.grace_over)) or hung:
                states = self._states(launch, outcomes)
                report = fault_report(states, describe, hung=hung and not failed)
                if hung and not failed:
                    report = clock.hung_words() + report
                raise DistributedCheckError(report, fault_of(states, hung=hung and not failed))
            time.sleep(_POLL_S)

    def _states(self, launch: int, outcomes: dict[int, RankOutcome]) -> list[RankState]:
        states = []
        for r in range(self.env.world_size):
            progress_key = f"{launch}/progress/{r}"
            progress = self._store.get(progress_key).decode() if self._has(progress_key) else "not started"
            outcome = outcomes.get(r)
            states.append(
                RankState(
                    rank=r,
                    progress=progress,
                    running=outcome is None,
                    error=None if outcome is None else outcome.error,
                    raised_at=0.0 if outcome is None or outcome.raised_at is None else outcome.raised_at,
                    mismatch=None if outcome is None else outcome.mismatch,
                )
            )
        return states

    def end(self, code: int) -> None:
        """Rank 0: tell every rank the check is over and the exit code; leave
        the process group if every task finished (a rank may be stuck in a
        collective after a fault: then the caller exits without waiting)."""
        self._store.set(f"task/{self._launches}", _dumps({"end": code}))
        self._leave()

    def _leave(self) -> None:
        if self.task_running:
            return
        if dist.is_initialized():
            dist.destroy_process_group()

    def _stopped(self, signum: int, frame: FrameType | None) -> None:
        """SIGTERM on rank 0: torchrun's agent stops every rank when one exits."""
        try:
            self._store.set_timeout(timedelta(seconds=2))
            where = "; ".join(f"rank {s.rank}: {s.progress}" for s in self._states(max(self._launches - 1, 0), {}))
        except Exception:  # the store went with the agent
            where = "unknown (the rendezvous store is gone)"
        print(
            f"equiv: torchrun is stopping the ranks: a rank exited without reporting (it died or was killed). "
            f"Where each rank was: {where}",
            file=sys.stderr,
            flush=True,
        )
        os._exit(3)

    # ------------------------------------------------------- ranks > 0
    def serve(self) -> int:
        """Ranks other than 0: run each task rank 0 posts, until it posts the
        end; returns its exit code.  While a task runs, an end posted after
        it (rank 0 gave up on a fault) is returned at once, even if the task
        is stuck in a collective (the caller then exits without waiting)."""
        if self.env.rank == 0:
            raise RuntimeError("rank 0 drives the ranks (call run() and end()), it does not serve")
        launch = 0
        while True:
            command = self._wait_for(f"task/{launch}")
            if "end" in command:
                self._leave()
                return int(command["end"])
            thread = self._start_share(launch, command)
            while thread.is_alive():
                if self._has(f"task/{launch + 1}"):
                    following = _loads(self._store.get(f"task/{launch + 1}"))
                    if "end" in following:
                        return int(following["end"])
                time.sleep(_POLL_S)
            launch += 1

    def _wait_for(self, key: str) -> dict[str, Any]:
        # No limit of its own: rank 0 bounds every task and posts the end; if
        # rank 0 dies, torchrun's agent stops this rank.
        while not self._has(key):
            time.sleep(_POLL_S)
        value: dict[str, Any] = _loads(self._store.get(key))
        return value

"""Fan independent tasks out over Ray, or run them in this process (issue 45's ``--ray [ADDRESS]``).

:func:`fan_out` calls ``function(*argument)`` for each tuple of ``arguments`` and returns the results in the
order of ``arguments``, whatever order they finish in:

- ``address=False`` (the default): a plain loop in this process; Ray is never imported.
- ``address=None`` or ``True``: a local Ray started here with ``workers`` CPUs (the machine's count when
  ``None``), shut down when the tasks are done. Its workers import what this process imports: this process's
  ``sys.path`` goes to them as ``PYTHONPATH`` (a checkout on the path, or a test's folder, would otherwise be
  missing there), and it listens on 127.0.0.1 only. A Ray already started in this process is used as it is.
- ``address="host:port"`` (or ``"auto"``, ``"ray://host:10001"``): ``ray.init(address=...)`` joins that
  cluster, whose nodes must have equiv (the same version) and the function's module installed; ``workers``
  caps the tasks in flight (the cluster's CPUs when ``None``).

Each task is a Ray task of one CPU, never retried (a subject that crashes its worker would crash it again),
and at most ``workers`` run at once, so a task's clock starts when it is handed out: one still running after
``timeout_s`` (``EQUIV_FANOUT_TASK_TIMEOUT_S``, 900 s by default) is cancelled with the others and named in a
:class:`FanOutError`, as is a task that raised (its exception's type and first line) or whose worker died.
A task is named by its first argument when that is a string (a sweep's subject), else by its index.

Ray's own cost, measured on a 2-core machine (ray 2.60.0): idle, importing it ~0.3 s, starting a local Ray
~2.5 s, the first task on a fresh worker ~1 s (a Python process importing the task's module), shutting down
~1.4 s; shared with other work (load 6-10), a one-task call 6-18 s in all. Worth it for many tasks of a second
or more (a sweep's subjects), not for milliseconds; benchmarks/test_fanout_speed.py measures the rest.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["TIMEOUT_ENV", "FanOutError", "fan_out"]

#: The environment variable that sets the per-task timeout (seconds) when ``timeout_s`` is not given.
TIMEOUT_ENV = "EQUIV_FANOUT_TASK_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 900.0
INSTALL_HINT = "pip install 'equiv[ray]'"

Progress = Callable[[int, int, str], None]


class FanOutError(RuntimeError):
    """A task of :func:`fan_out` raised, timed out, or lost its Ray worker; ``label`` names it."""

    def __init__(self, label: str, message: str) -> None:
        super().__init__(message)
        self.label = label


def fan_out(
    function: Callable[..., Any],
    arguments: Sequence[tuple[Any, ...]],
    *,
    address: str | bool | None = False,
    workers: int | None = None,
    progress: Progress | None = None,
    timeout_s: float | None = None,
) -> list[Any]:
    """``[function(*argument) for argument in arguments]``, in this process or as Ray tasks (module docstring);
    ``progress(done, total, label)`` is called after each task finishes, in the order they finish."""
    _check_options(address, workers, timeout_s)
    labels = [_label(index, argument) for index, argument in enumerate(arguments)]
    if address is False or not arguments:  # nothing to fan out: no Ray started for it
        return _in_process(function, arguments, labels, progress)
    limit = _timeout(timeout_s)
    ray = _import_ray(address)
    started_here = False
    if not ray.is_initialized():
        _start_ray(ray, address, workers)
        started_here = True
    try:
        if workers is None:
            workers = max(1, int(ray.cluster_resources().get("CPU", 1)))
        return _on_ray(ray, function, arguments, labels, workers=workers, limit=limit, progress=progress)
    finally:
        if started_here:
            ray.shutdown()


def _check_options(address: object, workers: object, timeout_s: object) -> None:
    if not (address is None or isinstance(address, bool) or (isinstance(address, str) and address.strip())):
        raise TypeError(f"fan_out: address={address!r}; expected False, None/True or a Ray address string")
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
        raise ValueError(f"fan_out: workers={workers!r}; expected a positive integer or None")
    if timeout_s is not None and (
        isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or timeout_s <= 0
    ):
        raise ValueError(f"fan_out: timeout_s={timeout_s!r}; expected a positive number of seconds or None")


def _label(index: int, argument: tuple[Any, ...]) -> str:
    if not isinstance(argument, tuple):
        raise TypeError(f"fan_out: arguments[{index}] is {type(argument).__name__}; expected a tuple of arguments")
    return argument[0] if argument and isinstance(argument[0], str) else f"task {index}"


def _timeout(timeout_s: float | None) -> float:
    if timeout_s is not None:
        return float(timeout_s)
    text = os.environ.get(TIMEOUT_ENV, "")
    if not text:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if value <= 0:
        raise ValueError(f"{TIMEOUT_ENV}={text!r}; expected a positive number of seconds")
    return value


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def _in_process(
    function: Callable[..., Any], arguments: Sequence[tuple[Any, ...]], labels: list[str], progress: Progress | None
) -> list[Any]:
    results = []
    for done, (argument, label) in enumerate(zip(arguments, labels, strict=True), start=1):
        try:
            results.append(function(*argument))
        except Exception as error:
            raise FanOutError(label, f"fan_out: {label} raised {_first_line(error)}") from error
        if progress is not None:
            progress(done, len(arguments), label)
    return results


def _import_ray(address: str | bool | None) -> Any:
    try:
        import ray
    except ImportError:
        raise ImportError(f"fan_out(address={address!r}) needs Ray, which is not installed: {INSTALL_HINT}") from None
    return ray


def _start_ray(ray: Any, address: str | bool | None, workers: int | None) -> None:
    """ray.init quietly (its INFO lines and the workers' output would interleave with a sweep's progress)."""
    quiet = {"include_dashboard": False, "logging_level": logging.ERROR, "log_to_driver": False}
    if isinstance(address, str):
        try:
            ray.init(address=address, **quiet)
        except Exception as error:  # Ray's own message is many lines; its first cause says why (a token missing)
            cause: BaseException = error
            while cause.__cause__ is not None:
                cause = cause.__cause__
            raise ConnectionError(
                f"fan_out: no Ray cluster joined at address={address!r}: {_first_line(cause)}"
            ) from error
        return
    # The workers import the task's module by name: give them this process's path, which holds it. Through the
    # environment Ray's processes start with, not a runtime_env: Ray starts a runtime_env's workers on demand,
    # which made the first tasks 4-5x slower here (3.7-4.6 s against 0.7-0.8 s for two no-ops on 2 busy cores).
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(entry for entry in sys.path if entry)
    try:
        ray.init(num_cpus=workers or os.cpu_count() or 1, _node_ip_address="127.0.0.1", **quiet)
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved


def _on_ray(
    ray: Any,
    function: Callable[..., Any],
    arguments: Sequence[tuple[Any, ...]],
    labels: list[str],
    *,
    workers: int,
    limit: float,
    progress: Progress | None,
) -> list[Any]:
    """At most ``workers`` tasks in flight, each with its deadline from when it was handed out."""
    remote = ray.remote(num_cpus=1, max_retries=0)(function)
    results: list[Any] = [None] * len(arguments)
    pending = list(range(len(arguments)))[::-1]
    in_flight: dict[Any, tuple[int, float]] = {}  # ref -> (index, deadline)
    done = 0
    try:
        while pending or in_flight:
            while pending and len(in_flight) < workers:
                index = pending.pop()
                in_flight[remote.remote(*arguments[index])] = (index, time.monotonic() + limit)
            soonest = min(deadline for _, deadline in in_flight.values())
            ready, _ = ray.wait(list(in_flight), num_returns=1, timeout=max(0.0, soonest - time.monotonic()))
            if not ready:
                late = [index for index, deadline in in_flight.values() if deadline <= time.monotonic()]
                if late:
                    label = labels[late[0]]
                    raise FanOutError(
                        label,
                        f"fan_out: {label} did not finish within {limit:g} s on Ray (timeout_s= or {TIMEOUT_ENV})",
                    )
                continue
            for ref in ready:
                index, _ = in_flight.pop(ref)
                results[index] = _result(ray, ref, labels[index])
                done += 1
                if progress is not None:
                    progress(done, len(arguments), labels[index])
    finally:
        for ref in in_flight:  # on an error: nothing left running on the cluster
            ray.cancel(ref, force=True)
    return results


def _result(ray: Any, ref: Any, label: str) -> Any:
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as error:
        cause = getattr(error, "cause", None) or error
        raise FanOutError(label, f"fan_out: {label} raised {_first_line(cause)}") from cause
    except ray.exceptions.RayError as error:  # the worker died (killed, out of memory) or the task was lost
        raise FanOutError(label, f"fan_out: the Ray worker running {label} failed: {_first_line(error)}") from error

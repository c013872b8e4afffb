"""equiv.distributed.fanout.fan_out (issue 45's --ray): the same results in this process and on a local Ray,
in the order of the arguments; progress once per task; a task that raised, died or hung named.

The Ray tests start a local Ray of 2 CPUs each (~5 s: start-up, first task, shutdown): marked slow."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any

import pytest

from equiv.distributed.fanout import FanOutError, fan_out


def square_after(subject: str, delay: float, value: int) -> tuple[str, int, int]:
    """A toy subject: sleeps, then returns its square and the process that ran it."""
    time.sleep(delay)
    return subject, value * value, os.getpid()


def raises_for(subject: str, value: int) -> int:
    if subject == "bad":
        raise ValueError(f"no square for {value}\nsecond line")
    return value * value


def dies_for(subject: str) -> str:
    if subject == "dies":
        os._exit(3)  # the worker process dies, as a segfault or the OOM killer would end it
    return subject


def hangs_for(subject: str) -> str:
    if subject == "hangs":
        time.sleep(120)
    return subject


# the later subjects finish first on 2 workers: order must come from the arguments, not from finishing
ARGUMENTS = [("a", 0.6, 1), ("b", 0.4, 2), ("c", 0.0, 3), ("d", 0.0, 4)]


def _recorder() -> tuple[list[tuple[int, int, str]], Any]:
    calls: list[tuple[int, int, str]] = []
    return calls, lambda done, total, label: calls.append((done, total, label))


def test_in_process_results_in_order_with_progress_per_task() -> None:
    calls, progress = _recorder()
    results = fan_out(square_after, ARGUMENTS, progress=progress)
    assert [(subject, square) for subject, square, _ in results] == [("a", 1), ("b", 4), ("c", 9), ("d", 16)]
    assert {pid for _, _, pid in results} == {os.getpid()}
    assert calls == [(1, 4, "a"), (2, 4, "b"), (3, 4, "c"), (4, 4, "d")]


def test_in_process_never_imports_ray_and_ray_missing_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # any `import ray` now raises ImportError
    assert fan_out(raises_for, [("x", 2)], address=False) == [4]
    with pytest.raises(ImportError) as missing:
        fan_out(raises_for, [("x", 2)], address=None)
    message = str(missing.value)
    assert "pip install 'equiv[ray]'" in message and "\n" not in message, message


def test_in_process_a_failing_task_is_named() -> None:
    with pytest.raises(FanOutError) as failed:
        fan_out(raises_for, [("good", 1), ("bad", 2), ("never", 3)])
    assert failed.value.label == "bad"
    assert str(failed.value) == "fan_out: bad raised ValueError: no square for 2"
    assert isinstance(failed.value.__cause__, ValueError)


def test_a_task_is_named_by_its_index_when_its_first_argument_is_not_a_string() -> None:
    with pytest.raises(FanOutError, match=r"^fan_out: task 1 raised ZeroDivisionError"):
        fan_out(lambda value: 1 / value, [(1,), (0,)])


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"address": 7}, "address=7"),
        ({"address": ""}, "address=''"),
        ({"workers": 0}, "workers=0"),
        ({"workers": 1.5}, "workers=1.5"),
        ({"timeout_s": -1}, "timeout_s=-1"),
    ],
)
def test_bad_options_are_refused_naming_the_value(options: dict[str, Any], named: str) -> None:
    with pytest.raises((TypeError, ValueError), match=f"^fan_out: {named};"):
        fan_out(raises_for, [("x", 1)], **options)


def test_a_bad_timeout_in_the_environment_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EQUIV_FANOUT_TASK_TIMEOUT_S", "soon")  # refused before Ray is imported or started
    with pytest.raises(ValueError, match=r"^EQUIV_FANOUT_TASK_TIMEOUT_S='soon'; expected a positive number"):
        fan_out(raises_for, [("x", 1)], address=None, workers=1)


@pytest.mark.slow
def test_a_local_ray_of_two_workers_gives_the_in_process_results_in_order() -> None:
    ray_module = pytest.importorskip("ray")
    calls, progress = _recorder()
    results = fan_out(square_after, ARGUMENTS, address=None, workers=2, progress=progress)
    in_process = fan_out(square_after, ARGUMENTS)
    assert [row[:2] for row in results] == [row[:2] for row in in_process]
    assert os.getpid() not in {pid for _, _, pid in results}  # run by Ray's workers
    # once per task, counted up, every subject once (in the order they finished)
    assert [(done, total) for done, total, _ in calls] == [(1, 4), (2, 4), (3, 4), (4, 4)]
    assert sorted(label for _, _, label in calls) == ["a", "b", "c", "d"]
    assert not ray_module.is_initialized()  # the Ray fan_out started is shut down


@pytest.mark.slow
def test_on_ray_a_failing_task_is_named_with_its_exception() -> None:
    pytest.importorskip("ray")
    with pytest.raises(FanOutError) as failed:
        fan_out(raises_for, [("good", 1), ("bad", 2), ("other", 3)], address=True, workers=2)
    assert failed.value.label == "bad"
    assert str(failed.value) == "fan_out: bad raised ValueError: no square for 2"


@pytest.mark.slow
def test_on_ray_a_worker_that_dies_is_named_not_waited_for() -> None:
    pytest.importorskip("ray")
    start = time.monotonic()
    with pytest.raises(FanOutError) as failed:
        fan_out(dies_for, [("fine",), ("dies",)], address=None, workers=2, timeout_s=60)
    assert failed.value.label == "dies"
    assert str(failed.value).startswith("fan_out: the Ray worker running dies failed: "), str(failed.value)
    assert time.monotonic() - start < 50  # named when the worker died, not at the timeout


@pytest.mark.slow
def test_on_ray_a_task_past_its_timeout_is_named_and_cancelled() -> None:
    pytest.importorskip("ray")
    start = time.monotonic()
    with pytest.raises(FanOutError) as failed:
        fan_out(hangs_for, [("fine",), ("hangs",)], address=None, workers=2, timeout_s=20)
    assert failed.value.label == "hangs"
    assert str(failed.value) == (
        "fan_out: hangs did not finish within 20 s on Ray (timeout_s= or EQUIV_FANOUT_TASK_TIMEOUT_S)"
    )
    # the task sleeps 120 s: cancelled, and Ray shut down without it (the timeout leaves room for a fresh
    # worker's start-up, which imports torch: ~5 s on a busy 2-core machine)
    assert time.monotonic() - start < 60


def test_no_arguments_start_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # Ray is not even imported for an empty fan-out
    assert fan_out(raises_for, [], address=None) == []


@pytest.mark.slow
def test_a_ray_address_is_joined_and_its_cluster_left_running() -> None:
    """``--ray ADDRESS``: a cluster someone else started (here a local one in another process, its workers given
    this checkout and this folder); fan_out joins it, and leaves it running when done."""
    ray_module = pytest.importorskip("ray")
    head = subprocess.Popen(
        [sys.executable, "-c", HEAD],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        # a loopback test cluster: no token to hand over (Ray's token authentication is for real clusters)
        env={**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONPATH": os.pathsep.join(filter(None, sys.path))},
    )
    try:
        assert head.stdout is not None and head.stdin is not None
        address = head.stdout.readline().strip()
        assert address, "the head process printed no address"
        calls, progress = _recorder()
        results = fan_out(square_after, ARGUMENTS, address=address, workers=2, progress=progress)
        assert [row[:2] for row in results] == [("a", 1), ("b", 4), ("c", 9), ("d", 16)]
        assert sorted(label for _, _, label in calls) == ["a", "b", "c", "d"]
        assert not ray_module.is_initialized()  # this process left the cluster...
        assert head.poll() is None  # ... and the cluster it joined still runs
    finally:
        if head.stdin is not None:
            head.stdin.close()  # the head shuts its Ray down and exits
        head.wait(timeout=120)


#: A process that starts a local Ray, prints its address and keeps it until its standard input closes.
HEAD = """
import logging, sys, ray
ray.init(num_cpus=2, _node_ip_address="127.0.0.1", include_dashboard=False, logging_level=logging.ERROR)
print(ray.get_runtime_context().gcs_address, flush=True)
sys.stdin.read()
ray.shutdown()
"""

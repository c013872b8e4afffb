"""equiv chooses its threads (issue 36): one on small cases unless the user said, restored after."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import equiv
import equiv.checking.threads as threads_module
from equiv.checking.threads import THREADS_ENV, chosen_threads
from equiv.cli import EXIT_EQUIVALENT, main

CASE = equiv.Case(batch_size=4, micro_batch_sizes=(2, 2), steps=1)
#: torch's count in a user's process before a check (the suite itself runs on one thread).
BEFORE = 2
SEEN: list[int] = []


def recording_step(model: Any, optimizer: Any, micro_batches: Any, loss_fn: Any) -> None:
    """The reference accumulation, noting the thread count it ran with."""
    SEEN.append(torch.get_num_threads())
    equiv.accumulator_step(model, optimizer, micro_batches, loss_fn)


def raising_step(model: Any, optimizer: Any, micro_batches: Any, loss_fn: Any) -> None:
    SEEN.append(torch.get_num_threads())
    raise RuntimeError("broken")


@pytest.fixture(autouse=True)
def users_process(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A user's shell: no OMP_NUM_THREADS, torch at BEFORE threads; the suite's count back after."""
    monkeypatch.delenv(THREADS_ENV, raising=False)
    suite = torch.get_num_threads()
    torch.set_num_threads(BEFORE)
    SEEN.clear()
    yield
    torch.set_num_threads(suite)


def test_a_small_case_runs_on_one_thread_and_the_count_is_restored() -> None:
    assert equiv.check(recording_step, CASE)
    assert SEEN and set(SEEN) == {1}
    assert torch.get_num_threads() == BEFORE


def test_the_count_is_restored_when_the_step_raises() -> None:
    with pytest.raises(equiv.CandidateError):
        equiv.check(raising_step, CASE)
    assert SEEN == [1] and torch.get_num_threads() == BEFORE


def test_omp_num_threads_in_the_environment_leaves_torchs_count(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(THREADS_ENV, "2")
    assert equiv.check(recording_step, CASE)
    assert set(SEEN) == {BEFORE}


def test_an_explicit_count_wins_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(THREADS_ENV, "2")
    assert equiv.check(recording_step, CASE, threads=3)
    assert set(SEEN) == {3} and torch.get_num_threads() == BEFORE


def test_a_large_model_keeps_torchs_count(monkeypatch: pytest.MonkeyPatch) -> None:
    parameters = sum(p.numel() for p in CASE.build_model().module.parameters())
    monkeypatch.setattr(threads_module, "SMALL_MODEL_PARAMETERS", parameters - 1)
    assert chosen_threads(None, [CASE]) is None
    assert equiv.check(recording_step, CASE)
    assert set(SEEN) == {BEFORE}


def test_verify_searches_on_one_thread_and_restores_the_count() -> None:
    result = equiv.verify(recording_step, max_examples=3, seed=0, replay_in_fresh_process=False)
    assert not result.found, result
    assert SEEN and set(SEEN) == {1} and torch.get_num_threads() == BEFORE
    SEEN.clear()
    equiv.verify(recording_step, max_examples=2, seed=0, replay_in_fresh_process=False, threads=2)
    assert set(SEEN) == {2}


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_a_bad_thread_count_is_refused_naming_it(bad: Any) -> None:
    with pytest.raises(ValueError, match=f"threads must be a whole number >= 1 .*got {bad!r}"):
        equiv.check(recording_step, CASE, threads=bad)
    assert torch.get_num_threads() == BEFORE


RECORDING_STEP_FILE = """
import pathlib, torch, equiv

def step(model, optimizer, micro_batches, loss_fn):
    with open(pathlib.Path(__file__).with_suffix(".threads"), "a") as seen:
        seen.write(f"{torch.get_num_threads()}\\n")
    equiv.accumulator_step(model, optimizer, micro_batches, loss_fn)
"""


def test_the_cli_takes_threads_and_restores_the_count(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "recording.py").write_text(RECORDING_STEP_FILE)
    seen = tmp_path / "recording.threads"
    target = f"{tmp_path / 'recording.py'}:step"
    case = ["--case", '{"batch_size": 4, "micro_batch_sizes": [2, 2], "steps": 1}']
    assert main(["check", target, *case, "--threads", "3"]) == EXIT_EQUIVALENT
    assert set(seen.read_text().split()) == {"3"} and torch.get_num_threads() == BEFORE
    seen.unlink()
    assert main(["check", target, *case]) == EXIT_EQUIVALENT
    assert set(seen.read_text().split()) == {"1"} and torch.get_num_threads() == BEFORE
    with pytest.raises(SystemExit) as refused:
        main(["verify", target, "--threads", "0"])
    assert refused.value.code == 2
    assert "argument --threads: expected a whole number >= 1, got 0" in capsys.readouterr().err

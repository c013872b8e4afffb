"""A step that ends itself (``sys.exit``, ``KeyboardInterrupt``, ``os._exit``) is a raised or
dead step, named with the case, never a silent pass; the user's Ctrl-C ends a command with one
line and exit code 130, leaving no process behind; a hung rank is named as the hang (issue #42).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

import equiv
import equiv.testing
from equiv.cli import EXIT_INTERRUPTED, EXIT_STEP_FAILED, main
from equiv.distributed.launcher import DistributedCheckError, RankState, fault_of, fault_report
from equiv.judging.contract import CandidateError
from equiv.judging.deadline import counting_interrupts, interrupts_received
from equiv.outcomes import Fault, Outcome

STEPS = """
import os, sys, time
from pathlib import Path
import torch.distributed as dist
import equiv

def exits_0(model, optimizer, micro_batches, loss_fn):
    sys.exit(0)

def exits_with_text(model, optimizer, micro_batches, loss_fn):
    sys.exit("done here")

def interrupts_itself(model, optimizer, micro_batches, loss_fn):
    raise KeyboardInterrupt

def sleeps(model, optimizer, micro_batches, loss_fn):
    Path(os.environ["EQUIV_TEST_MARK"]).touch()
    time.sleep(600)

def rank_1_exits(model, optimizer, micro_batches, loss_fn):
    if dist.get_rank() == 1:
        sys.exit(0)
    equiv.accumulator_step(model, optimizer, micro_batches, loss_fn)

def rank_1_os_exits(model, optimizer, micro_batches, loss_fn):
    if dist.get_rank() == 1:
        os._exit(0)
    equiv.accumulator_step(model, optimizer, micro_batches, loss_fn)

def os_exits(model, optimizer, micro_batches, loss_fn):
    os._exit(0)

def rank_1_hangs(model, optimizer, micro_batches, loss_fn):
    if dist.get_rank() == 1:
        time.sleep(600)
    equiv.accumulator_step(model, optimizer, micro_batches, loss_fn)
"""
TOY = equiv.Case(
    batch_size=8,
    micro_batch_sizes=(1, 3, 4),
    model="scalar_linear",
    data="toy_2x",
    optimizer_kwargs={"lr": 0.02},
    steps=1,
)
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def steps(tmp_path: Path) -> Path:
    path = tmp_path / "ending_steps.py"
    path.write_text(STEPS)
    return path


def _load(steps: Path, name: str) -> object:
    return equiv.judging.contract.load_candidate(f"{steps}:{name}")


# ------------------------------------------------------------------ item 9: a step that ends itself
@pytest.mark.parametrize(
    ("name", "said"),
    [
        ("exits_0", "called sys.exit(0)"),
        ("exits_with_text", "called sys.exit('done here')"),
        ("os_exits", "called os._exit(0)"),
        ("interrupts_itself", "raised KeyboardInterrupt itself"),
    ],
)
def test_a_step_that_ends_itself_is_a_raised_step_named_with_the_case(steps: Path, name: str, said: str) -> None:
    with pytest.raises(CandidateError, match=r"at step 0 in float\d+, so nothing was judged there") as info:
        equiv.check(_load(steps, name), TOY, timeout=60)  # type: ignore[arg-type]
    assert said in str(info.value) and repr(TOY) in str(info.value)
    assert isinstance(info.value.__cause__, (SystemExit, KeyboardInterrupt))
    assert os._exit.__name__ == "_exit"  # the real one, put back


@pytest.mark.parametrize("name", ["exits_0", "interrupts_itself", "os_exits"])
def test_equiv_check_exits_3_not_0_when_the_step_exits(
    steps: Path, name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["check", f"{steps}:{name}", "--case", '{"batch_size": 4, "micro_batch_sizes": [1, 3]}'])
    out = capsys.readouterr().out
    assert code == EXIT_STEP_FAILED
    assert "1 raised, of 1 case(s)" in out and "--case" in out


def test_assert_equivalent_fails_the_test_when_the_step_exits(steps: Path) -> None:
    # The pytest route: before, SystemExit from the step ended pytest's session with nothing judged.
    with pytest.raises(CandidateError, match=r"called sys.exit\(0\)"):
        equiv.testing.assert_equivalent(_load(steps, "exits_0"), TOY)  # type: ignore[arg-type]


def test_verify_reports_a_step_that_calls_sys_exit_as_raised(steps: Path) -> None:
    # Inside the Hypothesis search: the first drawn case ends the search as a raised step, never a pass.
    result = equiv.verify(_load(steps, "exits_0"), max_examples=3, seed=0, timeout=60)  # type: ignore[arg-type]
    assert result.status is Outcome.STEP_ERROR and result.counterexample is not None  # the case, named
    assert "called sys.exit(0)" in (result.error or "")


def test_a_real_sigint_in_the_step_still_interrupts() -> None:
    # The rule: a KeyboardInterrupt is the user's Ctrl-C when a SIGINT arrived while the step ran.
    before = interrupts_received()
    with pytest.raises(KeyboardInterrupt), counting_interrupts():
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)
    assert interrupts_received() == before + 1
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


# ------------------------------------------------------------------ item 10: Ctrl-C
def _interrupt(command: list[str], mark: Path, tmp_path: Path) -> tuple[int, str, list[psutil.Process]]:
    """Run the ``equiv`` command in its own session, wait until the step runs, Ctrl-C it as a
    terminal does (SIGINT to the whole process group): exit code, stderr, processes left."""
    env = {**os.environ, "EQUIV_TEST_MARK": str(mark), "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(
        [sys.executable, "-m", "equiv", *command],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        waited = time.monotonic()
        while not mark.exists():
            assert process.poll() is None, process.communicate()
            assert time.monotonic() - waited < 120, "the step never started"
            time.sleep(0.1)
        os.killpg(process.pid, signal.SIGINT)
        _, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    left: list[psutil.Process] = []
    for _ in range(50):  # a fork server notices its parent is gone within moments
        left = [p for p in psutil.process_iter() if _session(p) == process.pid]
        if not left:
            break
        time.sleep(0.1)
    return process.returncode, stderr, left


def _session(process: psutil.Process) -> int | None:
    try:
        return os.getsid(process.pid)
    except OSError:
        return None


@pytest.mark.slow
@pytest.mark.parametrize(
    ("command", "during"),
    [
        ("check", "during case 'toy 2.04, 4 x 2'"),
        ("verify", "during the search's first case"),
    ],
)
def test_ctrl_c_during_equiv_check_or_verify_is_one_line_and_exit_130(
    steps: Path, tmp_path: Path, command: str, during: str
) -> None:
    code, stderr, left = _interrupt([command, f"{steps}:sleeps"], tmp_path / "mark", tmp_path)
    lines = stderr.strip().splitlines()
    assert code == EXIT_INTERRUPTED, stderr
    assert "Traceback" not in stderr
    assert lines[-1] == f"equiv: interrupted (Ctrl-C) {during}; nothing judged after it"
    assert sum(line.startswith("equiv:") for line in lines) == 1
    assert not left


@pytest.mark.distributed
def test_ctrl_c_during_check_distributed_ends_every_rank(steps: Path, tmp_path: Path) -> None:
    code, stderr, left = _interrupt(
        ["check-distributed", f"{steps}:sleeps", "--split", "2;2", "--timeout", "60"], tmp_path / "mark", tmp_path
    )
    assert code == EXIT_INTERRUPTED, stderr
    assert "Traceback" not in stderr
    assert stderr.strip().splitlines()[-1].startswith("equiv: interrupted (Ctrl-C) during case '--split'")
    assert not left, [p.cmdline() for p in left]


# ------------------------------------------------------------------ items 9 and 11 on ranks
@pytest.mark.distributed
@pytest.mark.parametrize(
    ("name", "fault", "said"),
    [
        (
            "rank_1_exits",
            Fault.RAISED,
            "rank 1 raised (exact tier, step 0: in the candidate): "
            "equiv.judging.contract.CandidateError: candidate rank_1_exits called sys.exit(0)",
        ),
        ("rank_1_os_exits", Fault.DIED, "rank 1 died with exit code 0 before its task returned"),
    ],
)
def test_a_rank_that_exits_is_named_never_a_pass(steps: Path, name: str, fault: Fault, said: str) -> None:
    dcase = equiv.DistributedCase.of(equiv.Case(batch_size=4, micro_batch_sizes=(2, 2)), [[2], [2]])
    with pytest.raises(DistributedCheckError) as info:
        equiv.check_distributed(_load(steps, name), dcase, timeout_s=30)  # type: ignore[arg-type]
    assert info.value.fault is fault and said in str(info.value)


def test_a_hung_rank_is_named_before_the_peer_that_timed_out_waiting_for_it() -> None:
    gloo = (
        "Traceback ...\nRuntimeError: [../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] "
        "Timed out waiting 5000ms for recv operation to complete"
    )
    states = [
        RankState(0, "exact tier, step 0: in the candidate", error=gloo, raised_at=1.0, death="exit code 1"),
        RankState(1, "exact tier, step 0: in the candidate", running=True),
    ]
    report = fault_report(states, "case X", hung=True)
    assert report == (
        "rank 1 hung (exact tier, step 0: in the candidate); rank 0 was waiting in a collective "
        "(exact tier, step 0: in the candidate) and timed out there; case X"
    )
    assert fault_of(states, hung=True) is Fault.HUNG
    # The peer's timeout reported a moment before the deadline: the same hang, not rank 0's error.
    assert fault_report(states, "case X") == report and fault_of(states) is Fault.HUNG
    # With no rank left running, a rank's own error is named as it raised.
    assert fault_report(states[:1], "case X").startswith(
        "rank 0 raised (exact tier, step 0: in the candidate): RuntimeError: [../third_party/gloo"
    )
    assert fault_of(states[:1]) is Fault.RAISED
    other = [
        RankState(0, "step 0", error="ValueError: my step is broken", raised_at=1.0, death="exit code 1"),
        RankState(1, "step 0", running=True),
    ]
    assert fault_report(other, "case X") == (
        "rank 0 raised (step 0): ValueError: my step is broken; rank 1 was stopped (step 0); case X"
    )


@pytest.mark.distributed
def test_check_distributed_names_the_hung_rank_and_runs_no_case_after_it(
    steps: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = main(["check-distributed", f"{steps}:rank_1_hangs", "--timeout", "4"])
    out = capsys.readouterr().out
    assert code == EXIT_STEP_FAILED
    assert "rank 1 hung (exact tier, step 0: in the candidate)" in out
    assert "rank 0 raised" not in out
    assert "1 hung, 5 not run, of 6 case(s)" in out
    assert "the other 5 case(s) were not run: the step hung on 'uneven shards, SGD'" in out

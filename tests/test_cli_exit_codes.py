"""Exit codes that mean one thing, and a shell that never hangs.

0 equivalent, 1 counterexample, 2 usage error (checked before any work),
3 the user's step raised or hung, 4 equiv itself failed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import jsonschema
import pytest
import torch

import equiv
import equiv.cli
from equiv.cases.standard import STANDARD_CASES
from equiv.cli import EXIT_COUNTEREXAMPLE, EXIT_INTERNAL_ERROR, EXIT_STEP_FAILED, EXIT_USAGE, main
from equiv.judging.contract import bind
from equiv.outcomes import Fault
from equiv.results.protocol import schema

STEPS = """
import threading, time
import equiv

def hangs(model, optimizer, micro_batches, loss_fn):
    while True:
        time.sleep(1)

def raises(model, optimizer, micro_batches, loss_fn):
    raise RuntimeError("my step is broken")

def leaves_a_thread(model, optimizer, micro_batches, loss_fn):
    threading.Thread(target=time.sleep, args=(3600,), name="prefetcher").start()
    equiv.accumulator_step(model, optimizer, micro_batches, loss_fn)

def textbook(model, optimizer, micro_batches, loss_fn):
    optimizer.zero_grad()
    for x, y in micro_batches:
        (loss_fn(model(x), y) / len(micro_batches)).backward()
    optimizer.step()

def tiny():
    import torch
    return torch.nn.Linear(4, 2)

def batches(step, batch_size, generator):
    import torch
    return torch.randn(batch_size, 4, generator=generator), torch.randn(batch_size, 2, generator=generator)
"""
TOY = equiv.Case(
    batch_size=8,
    micro_batch_sizes=(1, 3, 4),
    model="scalar_linear",
    data="toy_2x",
    optimizer_kwargs={"lr": 0.02},
    steps=1,
)


@pytest.fixture
def steps(tmp_path: Path) -> Path:
    path = tmp_path / "exit_steps.py"
    path.write_text(STEPS)
    return path


def _case_json(case: equiv.Case = TOY) -> str:
    return json.dumps(case.to_dict())


def test_a_hanging_step_ends_the_check_at_the_timeout_with_exit_3(
    steps: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    started = time.monotonic()
    assert main(["check", f"{steps}:hangs", "--case", _case_json(), "--timeout", "2"]) == EXIT_STEP_FAILED
    assert time.monotonic() - started < 30
    out = capsys.readouterr().out
    assert "ERROR --case: candidate hangs did not finish step 0 in float32 within the check's limit of 2 s" in out


def test_after_a_hang_the_other_standard_cases_are_not_run(
    steps: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    started = time.monotonic()
    out = tmp_path / "hung.json"
    assert main(["check", f"{steps}:hangs", "--timeout", "1", "--json", str(out)]) == EXIT_STEP_FAILED
    assert time.monotonic() - started < 30
    text = capsys.readouterr().out
    first = next(iter(STANDARD_CASES))
    assert f"not run: the step hung on {first!r}" in text
    # Issue 36: one hang and 21 cases never run were tallied "0 not, 22 step error", read as "22 not".
    rest = len(STANDARD_CASES) - 1
    assert f"0 equivalent, 0 not equivalent, 1 hung, {rest} not run, of {len(STANDARD_CASES)} case(s)" in text
    written = json.loads(out.read_text())
    jsonschema.validate(written, schema())
    assert written["counts"] == {
        "equivalent": 0,
        "not equivalent": 0,
        "not applicable": 0,
        "inherently non-equivalent": 0,
        "raised": 0,
        "hung": 1,
        "died": 0,
        "collective mismatch": 0,
        "not run": rest,
    }
    rows = {row["case_name"]: row for row in written["cases"]}
    assert rows[first]["fault"] == "hung" and sum(row.get("not_run", False) for row in rows.values()) == rest


def test_a_step_that_raises_everywhere_is_tallied_raised_never_not_equivalent(
    steps: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["check", f"{steps}:raises"]) == EXIT_STEP_FAILED
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    step = bind(equiv.cli.load_target(f"{steps}:raises"))
    raised = sum(not step.not_applicable_reasons(case) for case in STANDARD_CASES.values())
    assert raised > 1
    assert summary == (
        f"0 equivalent, 0 not equivalent, {len(STANDARD_CASES) - raised} not applicable, "
        f"{raised} raised, of {len(STANDARD_CASES)} case(s)"
    )


def test_a_distributed_fault_stops_the_torchrun_cases_and_counts_the_rest_as_not_run(
    steps: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from equiv.checking.distributed_search import standard_distributed_cases
    from equiv.cli.distributed import _check_distributed_cases
    from equiv.distributed.launcher import DistributedCheckError

    def hangs_on_every_rank(task: object, world_size: int, **options: object) -> list[object]:
        raise DistributedCheckError("rank 1 hung past 5 s in step 0", Fault.HUNG)

    args = argparse.Namespace(
        target=f"{steps}:textbook", engine="ddp", timeout=5.0, train_dtype=None, strict_precision=False, format="text"
    )
    cases = standard_distributed_cases(2, "ddp")
    candidate = equiv.cli.load_target(args.target)
    code = _check_distributed_cases(args, candidate, cases, hangs_on_every_rank, None, stop_on_fault=True)
    assert code == EXIT_STEP_FAILED
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    assert summary == (
        f"0 equivalent, 0 not equivalent, 1 hung, {len(cases) - 1} not run, of {len(cases)} case(s) on 2 ranks (ddp)"
    )


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc (a folder that takes no new file)")
@pytest.mark.parametrize("command", ["check", "verify"])
def test_an_unwritable_json_path_is_a_usage_error_before_any_work(
    steps: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    # Issue 36: --json /proc/x.json ended, after all the work, in exit 4 "internal error" (as root,
    # os.access says every folder is writable; only opening the file tells).
    started = time.monotonic()
    assert main([command, f"{steps}:textbook", "--json", "/proc/equiv-out.json"]) == EXIT_USAGE
    assert time.monotonic() - started < 20
    assert "--json '/proc/equiv-out.json' cannot be created in the folder '/proc'" in capsys.readouterr().err


def test_the_json_path_check_leaves_an_existing_file_alone_and_creates_none(steps: Path, tmp_path: Path) -> None:
    from equiv.cli.inputs import _output

    kept = tmp_path / "kept.json"
    kept.write_text("old")
    assert _output(kept, "--json") == kept and kept.read_text() == "old"
    fresh = tmp_path / "fresh.json"
    assert _output(fresh, "--json") == fresh and not fresh.exists()


def test_an_unsupported_optimizer_in_a_case_is_a_usage_error(steps: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Issue 36: '"optimizer": "LBFGS"' was exit 4 from inside the full-batch reference.
    case = json.dumps({**TOY.to_dict(), "optimizer": "LBFGS"})
    assert main(["check", f"{steps}:textbook", "--case", case]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "optimizer 'LBFGS' is not supported" in err and "supported: " in err and "SGD" in err


def test_a_hanging_step_ends_the_search_without_shrinking(steps: Path, capsys: pytest.CaptureFixture[str]) -> None:
    started = time.monotonic()
    assert (
        main(["verify", f"{steps}:hangs", "--seed", "0", "--max-examples", "5", "--timeout", "1"]) == EXIT_STEP_FAILED
    )
    assert time.monotonic() - started < 30
    assert "did not finish step" in capsys.readouterr().out


def test_a_step_that_raises_is_exit_3_not_a_counterexample(steps: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", f"{steps}:raises", "--case", _case_json()]) == EXIT_STEP_FAILED
    assert "my step is broken" in capsys.readouterr().out
    assert main(["verify", f"{steps}:raises", "--seed", "0", "--max-examples", "3"]) == EXIT_STEP_FAILED


def test_a_counterexample_is_exit_1(steps: Path) -> None:
    assert main(["check", f"{steps}:textbook", "--case", _case_json()]) == EXIT_COUNTEREXAMPLE


def test_the_command_exits_although_the_step_left_a_non_daemon_thread(steps: Path, tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "equiv", "check", f"{steps}:leaves_a_thread", "--case", _case_json()],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "ok    --case" in done.stdout
    assert "non-daemon thread(s) running ('prefetcher'" in done.stderr and "exiting without waiting" in done.stderr


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        pytest.param(
            ["check", "{steps}:textbook", "--case", "@{tmp}/missing.json"],
            "cannot read the --case file",
            id="case-file-missing",
        ),
        pytest.param(
            ["check", "{steps}:textbook", "--json", "{tmp}/no/such/folder/out.json"],
            "does not exist",
            id="json-folder-missing",
        ),
        pytest.param(
            ["verify", "{steps}:textbook", "--json", "{tmp}/no/such/folder/out.json"],
            "does not exist",
            id="verify-json-folder-missing",
        ),
        pytest.param(
            ["report", "peers", "--out", "{tmp}/no/such/folder/peers.md"],
            "does not exist",
            id="report-out-folder-missing",
        ),
        pytest.param(
            ["check", "{steps}:textbook", "--case", "LR"], "rejected: Invalid learning rate: -1", id="negative-lr"
        ),
        pytest.param(
            ["check", "{steps}:textbook", "--case", "DIVERGES"], "the case itself diverges", id="diverging-case"
        ),
        pytest.param(["check", "{steps}:textbook", "--timeout", "-1"], "--timeout must be", id="negative-timeout"),
    ],
)
def test_usage_errors_exit_2_before_any_work(
    steps: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    cases = {
        "LR": json.dumps({**TOY.to_dict(), "optimizer_kwargs": {"lr": -1}}),
        "DIVERGES": _case_json(TOY.replace(optimizer_kwargs={"lr": 1e200}, steps=3)),
    }
    argv = [cases.get(arg, arg.format(steps=steps, tmp=tmp_path)) for arg in argv]
    started = time.monotonic()
    assert main(argv) == EXIT_USAGE
    assert time.monotonic() - started < 20  # refused up front, not after the run
    assert message in capsys.readouterr().err
    assert not (tmp_path / "no").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible here: cuda is a valid device")
def test_a_cuda_device_on_a_cpu_machine_is_a_usage_error(steps: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", f"{steps}:textbook", "--device", "cuda"]) == EXIT_USAGE
    assert "--device: device 'cuda' asked for" in capsys.readouterr().err
    assert main(["check", f"{steps}:textbook", "--case", json.dumps({**TOY.to_dict(), "device": "cuda"})]) == EXIT_USAGE


def test_a_failure_of_equiv_itself_is_exit_4_with_the_traceback(
    steps: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise KeyError("an equiv bug")

    monkeypatch.setattr("equiv.cli.checks.check_cases", broken)
    assert main(["check", f"{steps}:textbook"]) == EXIT_INTERNAL_ERROR
    err = capsys.readouterr().err
    assert "Traceback" in err and "KeyError: 'an equiv bug'" in err
    assert "internal error" in err and "not your step" in err


def test_the_version_is_printed(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.startswith("equiv ")


def test_a_case_from_json_imports_nothing_the_user_did_not_name(
    steps: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    marker = tmp_path / "PWNED"
    hostile = {**TOY.to_dict(), "model": "os:system", "model_kwargs": {"command": f"touch {marker}"}, "data": "random"}
    assert main(["check", f"{steps}:textbook", "--case", json.dumps(hostile)]) == EXIT_USAGE
    assert "would import module 'os', which was not named" in capsys.readouterr().err
    assert not marker.exists()


def test_a_case_naming_factories_beside_the_step_replays_from_the_command_line(
    steps: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    own = {
        **TOY.to_dict(),
        "model": "exit_steps:tiny",
        "data": "exit_steps:batches",
        "batch_size": 3,
        "micro_batch_sizes": [1, 2],
    }
    # The step's own module is allowed, and its folder is where the case's imports resolve.
    assert main(["check", f"{steps}:textbook", "--case", json.dumps(own)]) == EXIT_COUNTEREXAMPLE
    assert "FAIL  --case" in capsys.readouterr().out
    other = {**own, "model": "json:loads"}
    assert main(["check", f"{steps}:textbook", "--case", json.dumps(other)]) == EXIT_USAGE
    assert "would import module 'json', which was not named" in capsys.readouterr().err
    # Allowed, it is imported: json.loads is no model factory, a usage error too, but a different one.
    assert main(["check", f"{steps}:textbook", "--case", json.dumps(other), "--allow-import", "json"]) == EXIT_USAGE
    assert "the case cannot be run: bad arguments {} for model 'json:loads'" in capsys.readouterr().err


def test_tb_shows_the_step_s_own_traceback(steps: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", f"{steps}:raises", "--case", _case_json(), "--tb"]) == EXIT_STEP_FAILED
    out = capsys.readouterr().out
    assert "Traceback (most recent call last)" in out and 'raise RuntimeError("my step is broken")' in out
    assert main(["verify", f"{steps}:raises", "--seed", "0", "--max-examples", "3", "--tb"]) == EXIT_STEP_FAILED
    assert "The step's traceback:" in capsys.readouterr().out
    assert main(["check", f"{steps}:raises", "--case", _case_json()]) == EXIT_STEP_FAILED
    assert "Traceback" not in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["verify", "{steps}:textbook", "--max-examples", "0"],
            "argument --max-examples: expected a whole number >= 1",
        ),
        (["verify", "{steps}:textbook", "--max-batch-size", "0"], "argument --max-batch-size: expected a whole number"),
        (["verify", "{steps}:textbook", "--families", ","], "argument --families: expected comma-separated names"),
        (
            ["verify-distributed", "{steps}:textbook", "--timeout", "0"],
            "argument --timeout: expected a number of seconds > 0, got '0'",
        ),
        (["verify-distributed", "{steps}:textbook", "--engines", ""], "argument --engines: expected comma-separated"),
        (["check-distributed", "{steps}:textbook", "--nproc", "0"], "argument --nproc: expected a whole number >= 1"),
    ],
    ids=["verify-examples", "verify-batch", "verify-families", "distributed-timeout", "distributed-engines", "nproc"],
)
def test_a_zero_or_empty_flag_is_refused_never_read_as_its_default(
    steps: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    with pytest.raises(SystemExit) as refused:
        main([arg.format(steps=steps) for arg in argv])
    assert refused.value.code == EXIT_USAGE
    assert message in capsys.readouterr().err

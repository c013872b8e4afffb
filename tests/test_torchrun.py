"""``equiv check-distributed`` under torchrun: the launcher users already have.

Each test starts ``torchrun`` (as ``python -m torch.distributed.run``, what the
``torchrun`` script runs) on 2 CPU ranks with gloo, about 5 s a run; the
step is named as users name it, ``MODULE:FUNC`` or ``path/to/file.py:FUNC``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from equiv.distributed.torchrun import TorchrunEnv

pytestmark = pytest.mark.distributed

_STEPS = textwrap.dedent("""
    import torch.distributed as dist

    import equiv


    def raises_on_rank_1(model, optimizer, micro_batches, loss_fn):
        if dist.get_rank() == 1:
            raise RuntimeError("boom on rank 1")
        equiv.accumulator_step(model, optimizer, micro_batches, loss_fn)


    def dies_on_rank_1(model, optimizer, micro_batches, loss_fn):
        import os
        if dist.get_rank() == 1:
            os._exit(7)
        equiv.accumulator_step(model, optimizer, micro_batches, loss_fn)
""")


def _torchrun(*args: str, cwd: Path, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("RANK", None)  # never inherited from an outer launcher
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_torchrun_checks_a_correct_step_and_a_per_rank_mean_from_the_shell(tmp_path: Path) -> None:
    standalone = ("--standalone", "--nproc-per-node", "2", "-m", "equiv", "check-distributed")
    good = _torchrun(*standalone, "equiv:accumulator_step", "--json", str(tmp_path / "good.json"), cwd=tmp_path)
    assert good.returncode == 0, good.stdout + good.stderr
    # The standard splits: ranks holding different samples, micro-batch counts and real tokens.
    # ... an active clip norm: the reference step takes max_grad_norm and clips by the global norm once; and Muon.
    assert "6 equivalent, 0 not equivalent, of 6 case(s) on 2 ranks (ddp)" in good.stdout, good.stdout
    assert "ok    clipped (max_grad_norm), Adam" in good.stdout
    verdicts = json.loads((tmp_path / "good.json").read_text())["cases"]
    assert [v["status"] for v in verdicts] == ["equivalent"] * 6
    # transformers #34242: each rank's own mean, averaged by DDP; the split holds 3 and 3 + 1 samples.
    bad = _torchrun(
        *standalone,
        "equiv.zoo.distributed_bugs:local_mean_per_rank",
        "--split",
        "1,2;1,3",
        "--json",
        str(tmp_path / "bad.json"),
        cwd=tmp_path,
    )
    assert bad.returncode != 0, bad.stdout  # torchrun's own code: a rank exited non-zero
    assert "FAIL  --split" in bad.stdout and "Not equivalent to full-batch training" in bad.stdout, bad.stdout
    assert "micro-batches per rank [[1, 2], [1, 3]]" in bad.stdout
    assert "exitcode  : 1" in bad.stderr  # the verdict's exit code, in torchrun's summary
    (verdict,) = json.loads((tmp_path / "bad.json").read_text())["cases"]
    assert verdict["status"] == "not_equivalent" and verdict["case"]["rank_micro_batch_sizes"] == [[1, 2], [1, 3]]


def test_a_rank_that_raises_or_dies_under_torchrun_is_named(tmp_path: Path) -> None:
    (tmp_path / "steps.py").write_text(_STEPS)
    standalone = ("--standalone", "--nproc-per-node", "2", "-m", "equiv", "check-distributed")
    raised = _torchrun(*standalone, "steps.py:raises_on_rank_1", "--split", "1,2;3", "--timeout", "30", cwd=tmp_path)
    assert "ERROR --split: rank 1 raised (exact tier, step 0: in the candidate)" in raised.stdout, raised.stdout
    assert "boom on rank 1" in raised.stdout
    assert "exitcode  : 3" in raised.stderr, raised.stderr  # 3: the step raised, no verdict
    died = _torchrun(*standalone, "steps.py:dies_on_rank_1", "--split", "1,2;3", "--timeout", "30", cwd=tmp_path)
    assert "a rank exited without reporting" in died.stderr and "rank 1: exact tier, step 0" in died.stderr, died.stderr
    assert "exitcode  : 7" in died.stderr  # torchrun names the rank that died and how


def test_two_machines_are_two_torchrun_commands_meeting_at_one_rendezvous(tmp_path: Path) -> None:
    # What docs/distributed.md tells users to run on each machine, here both on this one.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = (
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        "equiv-test",
        "-m",
        "equiv",
        "check-distributed",
        "equiv.zoo.distributed_bugs:RAGGED_TOKEN_STEPS",
        "--split",
        "1;2",
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    nodes = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", *command],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outputs = [node.communicate(timeout=180) for node in nodes]
    # The target is a dict, not a step: every rank refuses it before any work, on both machines.
    assert all(node.returncode != 0 for node in nodes)
    assert any("is a dict, not a callable step" in err for _, err in outputs), outputs
    nodes = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", *command[:-3], "equiv:accumulator_step", "--split", "1;2"],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outputs = [node.communicate(timeout=180) for node in nodes]
    assert all(node.returncode == 0 for node in nodes), outputs
    # Rank 0 (on whichever machine the rendezvous made it) prints the verdict; the other prints nothing.
    printed = [out for out, _ in outputs if out.strip()]
    assert len(printed) == 1 and "ok    --split" in printed[0], outputs


def test_torchrun_environment_is_read_or_refused_by_name() -> None:
    assert TorchrunEnv.read({}) is None
    env = TorchrunEnv.read(
        {
            "RANK": "1",
            "WORLD_SIZE": "2",
            "LOCAL_RANK": "1",
            "MASTER_ADDR": "node0",
            "MASTER_PORT": "29500",
            "TORCHELASTIC_USE_AGENT_STORE": "True",
        }
    )
    assert env is not None and (env.rank, env.world_size, env.local_rank, env.agent_store) == (1, 2, 1, True)
    with pytest.raises(ValueError, match="MASTER_ADDR, MASTER_PORT not set: start the command with torchrun"):
        TorchrunEnv.read({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"})
    with pytest.raises(ValueError, match="RANK must be in"):
        TorchrunEnv.read({"RANK": "2", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "a", "MASTER_PORT": "1"})


def test_without_torchrun_the_ranks_are_spawned_and_a_split_must_match_them(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from equiv.cli import main

    assert main(["check-distributed", "equiv:accumulator_step", "--nproc", "3", "--split", "1;2,1;3"]) == 0
    assert "ok    --split" in capsys.readouterr().out
    assert main(["check-distributed", "equiv:accumulator_step", "--split", "1;2;3"]) == 2
    assert "--split gives 3 rank(s), [[1], [2], [3]]; the check runs 2" in capsys.readouterr().err
    with pytest.raises(SystemExit) as refused:  # argparse: a split that is not sizes
        main(["check-distributed", "equiv:accumulator_step", "--split", "1;x"])
    assert refused.value.code == 2
    assert "a split is each rank's micro-batch sizes, ranks separated by ';'" in capsys.readouterr().err

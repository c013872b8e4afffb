"""``equiv.audit`` on a DeepSpeed engine (issue 46), launched by torchrun on gloo with ``DS_ACCELERATOR=cpu``:
ZeRO stages 0, 1 and 2, the engine handed over or its module and optimizer, a client torch AdamW or DeepSpeed's
own FusedAdam (replayed as torch's AdamW with the hyperparameters its kernel takes), the config's clipping read
from the engine.  tests/data/audit_under_deepspeed.py runs the scenarios; one torchrun launch per world size."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("deepspeed")
pytestmark = pytest.mark.distributed

SCRIPT = Path(__file__).parent / "data" / "audit_under_deepspeed.py"
LAUNCH = (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node")
#: correct loops: every window equivalent
CORRECT_2 = (
    "zero1-correct",
    "zero2-correct",
    "zero0-correct-fused",
    "zero1-correct-module-fused-clip",
    "zero2-correct-clip-module-fused",
)
CORRECT_3 = ("zero1-correct-module", "zero2-correct-fused-clip")
#: per-rank token means and means of micro-batch means: every window flagged, the normaliser named
FLAGGED_2 = ("zero1-rank_mean-module", "zero2-rank_mean", "zero2-mean_of_means-fused")
FLAGGED_3 = ("zero1-rank_mean", "zero2-rank_mean-module-fused")


def audits(world: int, kinds: tuple[str, ...], tmp_path: Path) -> dict[str, dict[str, Any]]:
    out = tmp_path / f"deepspeed-{world}.jsonl"
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "DS_ACCELERATOR": "cpu",
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent.parent), os.environ.get("PYTHONPATH", "")]),
    }
    env.pop("RANK", None)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(world),
            str(SCRIPT),
            str(out),
            *kinds,
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return {result["kind"]: result for result in map(json.loads, out.read_text().splitlines())}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    return audits(2, (*CORRECT_2, *FLAGGED_2), tmp_path_factory.mktemp("two"))


@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    return audits(3, (*CORRECT_3, *FLAGGED_3), tmp_path_factory.mktemp("three"))


def _ranks(request: pytest.FixtureRequest, kind: str) -> tuple[dict[str, Any], int]:
    world = 2 if kind in (*CORRECT_2, *FLAGGED_2) else 3
    results = request.getfixturevalue("two_ranks" if world == 2 else "three_ranks")
    assert "error" not in results[kind], results[kind].get("error")
    return results[kind], world


@pytest.mark.parametrize("kind", (*CORRECT_2, *CORRECT_3))
def test_a_correct_deepspeed_loop_passes(request: pytest.FixtureRequest, kind: str) -> None:
    result, world = _ranks(request, kind)
    audit = result["audit"]
    assert audit["status"] == "equivalent" and audit["judged"] == 3, result["summary"]
    assert all([rank["rank"] for rank in window["ranks"]] == list(range(world)) for window in audit["windows"])
    # the config read and said once: the stage, the accumulation steps the engine divides by, its clipping
    stage = kind[4]
    assert f"ZeRO stage {stage}, gradient_accumulation_steps=3" in result["read"], result["read"]
    assert ("gradient_clipping=0.05" in result["read"]) == ("-clip" in kind), result["read"]
    assert ("optimizer FusedAdam" in result["read"]) == ("-fused" in kind), result["read"]


@pytest.mark.parametrize("kind", (*FLAGGED_2, *FLAGGED_3))
def test_a_per_rank_token_mean_or_a_mean_of_means_is_flagged_with_the_engine_named(
    request: pytest.FixtureRequest, kind: str
) -> None:
    result, world = _ranks(request, kind)
    windows = result["audit"]["windows"]
    assert all(window["status"] == "not_equivalent" for window in windows), result["summary"]
    first = windows[0]
    assert f"off on ranks {list(range(world))} of {world}" in result["summary"].splitlines()[1], result["summary"]
    expected = "per-rank mean" if "rank_mean" in kind else "mean of means"
    assert first["weights"]["normaliser"] == expected, first["weights"]
    # the engine's own division by the accumulation steps said, with the loss it needed
    assert "divided each micro-batch's loss by gradient_accumulation_steps=3" in first["setting"], first["setting"]
    assert f"times {world * 3} ({world} ranks x 3 steps" in first["setting"], first["setting"]

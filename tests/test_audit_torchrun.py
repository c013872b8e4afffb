"""``equiv.audit`` on every rank of a torchrun run (issue 35): the truth is the global
full-batch step of each window, computed across the ranks by the audit's own
collectives (equiv/auditing/ranks.py).

tests/data/audit_under_torchrun.py trains a tiny causal LM for three optimizer steps
per scenario on gloo ranks whose micro-batches hold different real-token counts (one
micro-batch of the last rank has none); rank 0 writes each audit's to_dict().  One
torchrun launch per world size, ~10 s on 2 cores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.distributed

SCRIPT = Path(__file__).parent / "data" / "audit_under_torchrun.py"
CORRECT = ("ddp_global_tokens", "fsdp2_global_tokens", "buffer_correct")
#: each kind of 2025-2026 bug, flagged from the step where it goes wrong (the first)
BUGS = ("ddp_rank_token_mean", "ddp_sync_left_off", "fsdp2_rank_token_mean", "fsdp2_sync_left_off",
        "buffer_scaled_by_index", "buffer_last_only", "buffer_last_left_out")


def audits_under_torchrun(world: int, kinds: tuple[str, ...], tmp_path: Path) -> dict[str, dict[str, Any]]:
    out = tmp_path / f"audits-{world}.jsonl"
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent.parent), os.environ.get("PYTHONPATH", "")])}
    env.pop("RANK", None)
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world), str(SCRIPT),
         str(out), *kinds], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return {result["kind"]: result for result in map(json.loads, out.read_text().splitlines())}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    return audits_under_torchrun(2, (*CORRECT, *BUGS, "tp_refused"), tmp_path_factory.mktemp("two"))


@pytest.mark.parametrize("kind", CORRECT)
def test_a_correct_loop_with_the_global_token_count_passes_on_two_ranks(two_ranks: dict[str, Any], kind: str) -> None:
    result = two_ranks[kind]
    audit = result["audit"]
    # ranks with different real-token counts, one micro-batch with none: every window judged and equivalent
    assert audit["status"] == "equivalent" and audit["judged"] == 3, result["summary"]
    for window in audit["windows"]:
        assert [rank["rank"] for rank in window["ranks"]] == [0, 1]
        assert all(rank["equivalent"] for rank in window["ranks"])
    assert "on rank 0 of 2: equivalent" in result["summary"]


@pytest.mark.parametrize("kind", BUGS)
def test_each_kind_is_flagged_on_the_step_where_it_goes_wrong(two_ranks: dict[str, Any], kind: str) -> None:
    result = two_ranks[kind]
    windows = result["audit"]["windows"]
    assert windows[0]["status"] == "not_equivalent", result["summary"]
    assert all(window["status"] == "not_equivalent" for window in windows), result["summary"]
    first = result["summary"].splitlines()[1]
    # the update ratio and cosine (or that the run did not move it), and which ranks are off
    assert "x the full-batch one, cosine" in first or "update 0x the full-batch one (not moved)" in first, first
    assert "off on ranks [0, 1] of 2" in first, first


PARAMETERS = 13 * 16 + (16 * 16 + 16) + (16 * 13 + 13)


def _window_bytes(floor_samples: int) -> int:
    """What a rank sends for one audited window: the float64 truth's gradients and item count (8 bytes
    each), each float32 floor sample's (4 bytes a gradient, 8 the count), and one 8-byte "still past
    its allowance?" per decision (one more than the samples run): the model's size, never the world's."""
    return (PARAMETERS + 1) * 8 + floor_samples * (PARAMETERS * 4 + 8) + (floor_samples + 1) * 8


def test_the_audit_sends_a_known_number_of_bytes_per_window(two_ranks: dict[str, Any]) -> None:
    # a correct run is within the roundoff term at once: the truth alone, no floor sample
    assert two_ranks["ddp_global_tokens"]["communicated"] == 3 * _window_bytes(0)
    # a failing one runs the three floor samples (together on both ranks) before it is called off
    assert two_ranks["ddp_rank_token_mean"]["communicated"] == 3 * _window_bytes(3)


def test_fsdp2_ranks_compare_their_own_shards(two_ranks: dict[str, Any]) -> None:
    # each rank steps and compares its shard of each parameter (the same bytes as DDP: the model's size)
    assert two_ranks["fsdp2_global_tokens"]["communicated"] == 3 * _window_bytes(0)
    off = two_ranks["fsdp2_sync_left_off"]["summary"].splitlines()[1]
    assert "update 0x the full-batch one (not moved)" in off, off  # sync left off: the shards never got a gradient


def test_a_tensor_parallel_model_is_refused_naming_what_to_use(two_ranks: dict[str, Any]) -> None:
    error = two_ranks["tp_refused"]["error"]
    assert error is not None and "tensor parallelism" in error and "equiv.check_distributed" in error


def test_three_ranks(tmp_path: Path) -> None:
    audits = audits_under_torchrun(3, ("ddp_global_tokens", "fsdp2_global_tokens", "ddp_rank_token_mean",
                                       "fsdp2_sync_left_off", "buffer_scaled_by_index"), tmp_path)
    for kind in ("ddp_global_tokens", "fsdp2_global_tokens"):  # 3 ranks: FSDP2's shards of 13 rows are uneven
        good = audits[kind]["audit"]
        assert good["status"] == "equivalent" and good["judged"] == 3, audits[kind]["summary"]
        assert [rank["rank"] for rank in good["windows"][0]["ranks"]] == [0, 1, 2]
    for kind in ("ddp_rank_token_mean", "fsdp2_sync_left_off", "buffer_scaled_by_index"):
        windows = audits[kind]["audit"]["windows"]
        assert all(window["status"] == "not_equivalent" for window in windows), audits[kind]["summary"]
    # bytes per rank do not grow with the world: the same as on two ranks
    assert audits["ddp_global_tokens"]["communicated"] == 3 * _window_bytes(0)


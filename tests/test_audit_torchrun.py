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
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.distributed

SCRIPT = Path(__file__).parent / "data" / "audit_under_torchrun.py"
CORRECT = ("ddp_global_tokens", "fsdp2_global_tokens", "buffer_correct")
#: each kind of 2025-2026 bug, flagged from the step where it goes wrong (the first)
BUGS = (
    "ddp_rank_token_mean",
    "ddp_sync_left_off",
    "fsdp2_rank_token_mean",
    "fsdp2_sync_left_off",
    "buffer_scaled_by_index",
    "buffer_last_only",
    "buffer_last_left_out",
)


def _launch(
    world: int, kinds: tuple[str, ...], out: Path, script: Path = SCRIPT, **env_settings: str
) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        **env_settings,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent.parent), os.environ.get("PYTHONPATH", "")]),
    }
    env.pop("RANK", None)
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(world),
            str(script),
            str(out),
            *kinds,
        ],
        cwd=out.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def audits_under_torchrun(world: int, kinds: tuple[str, ...], tmp_path: Path) -> dict[str, dict[str, Any]]:
    """Each scenario's audit as rank 0 wrote it (to_dict(), summary, bytes sent), run under torchrun."""
    out = tmp_path / f"audits-{world}.jsonl"
    done = _launch(world, kinds, out)
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
    """What a rank sends for one audited window: whether any rank's forward drew a random number (8 bytes),
    the float64 truth's gradients and item count (8 bytes each), each float32 floor sample's (4 bytes a
    gradient, 8 the count), and one 8-byte "still past its allowance?" per decision (one more than the
    samples run): the model's size, never the world's."""
    return 8 + (PARAMETERS + 1) * 8 + floor_samples * (PARAMETERS * 4 + 8) + (floor_samples + 1) * 8


def _witness_bytes(world: int, micro_batches: int) -> int:
    """What a rank sends for a failing window's witness (issue 44), all float64: the check that every rank holds
    the same gradient (2), each rank's micro-batch count (the world), the ranks' micro-batch gradients with
    their items in one zero-padded stack, and its slice's Gram, right-hand side and norm with its element count."""
    k = micro_batches
    return (2 + world + k * (PARAMETERS + 1) + k * k + k + 1 + 1) * 8


def test_the_audit_sends_a_known_number_of_bytes_per_window(two_ranks: dict[str, Any]) -> None:
    # a correct run is within the roundoff term at once: the truth alone, no floor sample, no witness
    assert two_ranks["ddp_global_tokens"]["communicated"] == 3 * _window_bytes(0)
    # a failing one runs the three floor samples (together on both ranks) before it is called off, then its
    # witness: 2 micro-batches a rank, but the second window's with no token on the last rank (left out)
    witness = _witness_bytes(2, 4) + _witness_bytes(2, 3) + _witness_bytes(2, 4)
    assert two_ranks["ddp_rank_token_mean"]["communicated"] == 3 * _window_bytes(3) + witness


def test_fsdp2_ranks_compare_their_own_shards(two_ranks: dict[str, Any]) -> None:
    # each rank replays on a copy sharded as the run's, steps and compares its own shards: its FSDP2's
    # all-gathers and reduce-scatters are counted too (more than the item counts alone)
    assert two_ranks["fsdp2_global_tokens"]["communicated"] > 3 * 16
    off = two_ranks["fsdp2_sync_left_off"]["summary"].splitlines()[1]
    assert "update 0x the full-batch one (not moved)" in off, off  # sync left off: the shards never got a gradient
    # ... so no gradient to re-weight: no witness (not weights of 0)
    assert all("weights" not in window for window in two_ranks["fsdp2_sync_left_off"]["audit"]["windows"])


def _applied_per_rank_means(world: int, window: int) -> list[float]:
    """The weights a per-rank token mean gives each micro-batch's loss sum: 1/(R N_r), its rank's tokens N_r
    (a micro-batch with no token has no gradient to weigh: left out), in rank order."""
    script = _torchrun_script()
    applied = []
    for rank in range(world):
        counts = [script.tokens(labels) for _, labels in script.rank_windows(rank, world)[window]]
        applied += [1 / (world * sum(counts)) for count in counts if count]
    return applied


def test_fsdp2_failing_windows_carry_the_witness_of_a_per_rank_mean(two_ranks: dict[str, Any]) -> None:
    # issue 44: each rank's shard of every rank's micro-batch gradient, the Gram summed over the shards
    result = two_ranks["fsdp2_rank_token_mean"]
    for index, window in enumerate(result["audit"]["windows"]):
        weights = window.get("weights")
        assert weights is not None, result["summary"]
        assert weights["run"] == pytest.approx(_applied_per_rank_means(2, index), rel=0.01), result["summary"]
        assert "per-rank mean" in weights["normaliser"].split(" or "), weights
        assert weights["residual"] < 1e-6, weights  # float32 run's rounding: a re-weighting, nothing else
    first = result["summary"].splitlines()[1]
    assert "per-rank mean" in first or "each rank's loss divided by its own items" in first, first
    assert all("weights" not in w for w in two_ranks["fsdp2_global_tokens"]["audit"]["windows"])


def test_the_fsdp2_witness_sends_one_float64_pass_per_micro_batch_and_the_gram(two_ranks: dict[str, Any]) -> None:
    # a correct window sends whether a forward drew a random number, the float64 truth's FSDP2 all-gathers and
    # reduce-scatters (one pass a micro-batch, 2 micro-batches), its item count and one decision (8 bytes each):
    # from it, one float64 pass's bytes
    correct_window, remainder = divmod(two_ranks["fsdp2_global_tokens"]["communicated"], 3)
    pass64, odd = divmod(correct_window - 8 - 8 - 8, 2)
    assert remainder == odd == 0
    # a failing one: the random draws' flag, the truth, three float32 floor samples (2 micro-batches at half a
    # float64 pass each, and the item count), four decisions
    failing_window = 8 + (2 * pass64 + 8) + 3 * (pass64 + 8) + 4 * 8

    def witness(k: int) -> int:
        """The witness of a window of k micro-batches (every rank's, with items), all float64: each rank's
        micro-batch count and whether any rank got a gradient, one pass per micro-batch, their items, the
        shards' Gram, right-hand side, norm and element count: never a whole gradient."""
        return (2 + 1) * 8 + k * pass64 + k * 8 + (k * k + k + 1 + 1) * 8

    # 2 micro-batches a rank, the second window's with no token on the last rank (left out)
    expected = 3 * failing_window + witness(4) + witness(3) + witness(4)
    assert two_ranks["fsdp2_rank_token_mean"]["communicated"] == expected


def test_functional_dropout_is_inherent_on_every_rank_under_ddp_and_fsdp2(tmp_path: Path) -> None:
    # No module names F.dropout: the forward's random draws are seen, every rank asks together whether they reach
    # the output (an FSDP2 copy's forwards all-gather), and no window is judged, so none passes on a widened floor.
    audits = audits_under_torchrun(2, ("ddp_dropout", "fsdp2_dropout"), tmp_path)
    for kind, result in audits.items():
        audit = result["audit"]
        assert audit["judged"] == 0 and len(audit["windows"]) == 3, result["summary"]
        assert all(window["status"] == "inherently_non_equivalent" for window in audit["windows"]), kind
        assert "draws random numbers that reach its output" in result["summary"], result["summary"]


def _torchrun_script() -> Any:
    """tests/data/audit_under_torchrun.py as a module (its data: each rank's windows)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("audit_under_torchrun", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_tensor_parallel_model_is_refused_naming_what_to_use(two_ranks: dict[str, Any]) -> None:
    error = two_ranks["tp_refused"]["error"]
    assert error is not None and "tensor parallelism" in error and "equiv.check_distributed" in error


def fsdp2_bytes_on_two_ranks(tmp_path: Path) -> int:
    return int(audits_under_torchrun(2, ("fsdp2_global_tokens",), tmp_path)["fsdp2_global_tokens"]["communicated"])


def test_three_ranks(tmp_path: Path) -> None:
    audits = audits_under_torchrun(
        3,
        (
            "ddp_global_tokens",
            "fsdp2_global_tokens",
            "ddp_rank_token_mean",
            "fsdp2_sync_left_off",
            "buffer_scaled_by_index",
            "fsdp2_rank_token_mean",
        ),
        tmp_path,
    )
    for kind in ("ddp_global_tokens", "fsdp2_global_tokens"):  # 3 ranks: FSDP2's shards of 13 rows are uneven
        good = audits[kind]["audit"]
        assert good["status"] == "equivalent" and good["judged"] == 3, audits[kind]["summary"]
        assert [rank["rank"] for rank in good["windows"][0]["ranks"]] == [0, 1, 2]
    for kind in ("ddp_rank_token_mean", "fsdp2_sync_left_off", "buffer_scaled_by_index", "fsdp2_rank_token_mean"):
        windows = audits[kind]["audit"]["windows"]
        assert all(window["status"] == "not_equivalent" for window in windows), audits[kind]["summary"]
    # the witness over FSDP2's uneven shards (13 rows on 3 ranks): the same weights as the loop applied
    for index, window in enumerate(audits["fsdp2_rank_token_mean"]["audit"]["windows"]):
        assert window["weights"]["run"] == pytest.approx(_applied_per_rank_means(3, index), rel=0.01), window
        assert "per-rank mean" in window["weights"]["normaliser"].split(" or "), window
    # bytes per rank do not grow with the world: the same as on two ranks under DDP, fewer under FSDP2
    assert audits["ddp_global_tokens"]["communicated"] == 3 * _window_bytes(0)
    assert audits["fsdp2_global_tokens"]["communicated"] <= fsdp2_bytes_on_two_ranks(tmp_path)


def test_a_rank_that_hangs_is_named_within_the_timeout_and_no_process_is_left(tmp_path: Path) -> None:
    start = time.monotonic()
    done = _launch(2, ("buffer_rank_1_hangs",), tmp_path / "out.jsonl", EQUIV_AUDIT_RANK_TIMEOUT_S="3")
    elapsed = time.monotonic() - start
    assert done.returncode != 0
    assert (
        "equiv.audit: rank 0 of 2 waited for the other ranks in the full-batch replay of optimizer step 1"
        in done.stderr
    ), done.stderr[-3000:]
    assert "did a rank hang, stop stepping, or raise?" in done.stderr
    assert elapsed < 60, elapsed  # rank 1 sleeps 120 s: torchrun ended it once rank 0 raised
    left = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True)
    assert left.stdout.strip() == "", left.stdout  # no rank of this run still alive

"""``equiv.audit`` on a DeepSpeed engine (issue 46), launched by torchrun on gloo with ``DS_ACCELERATOR=cpu``:
ZeRO stages 0, 1 and 2, the engine handed over or its module and optimizer, a client torch AdamW or DeepSpeed's
own FusedAdam (replayed as torch's AdamW with the hyperparameters its kernel takes), the config's clipping read
from the engine.  tests/data/audit_under_deepspeed.py runs the scenarios; one torchrun launch per world size."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from test_audit_torchrun import _launch

pytestmark = [pytest.mark.distributed, pytest.mark.deepspeed]

SCRIPT = Path(__file__).parent / "data" / "audit_under_deepspeed.py"
#: correct loops: every window equivalent
CORRECT_2 = (
    "zero1-correct",
    "zero2-correct",
    "zero0-correct-fused",
    "zero1-correct-module-fused-clip",
    "zero2-correct-clip-module-fused",
    "zero2-correct-bf16",
)
CORRECT_3 = ("zero1-correct-module", "zero2-correct-fused-clip", "zero1-correct-bf16-fused-clip")
#: per-rank token means and means of micro-batch means: every window flagged, the normaliser named
FLAGGED_2 = ("zero1-rank_mean-module", "zero2-rank_mean", "zero2-mean_of_means-fused")
FLAGGED_3 = ("zero1-rank_mean", "zero2-rank_mean-module-fused")
#: bf16 weights (ZeRO's fp32 partitions the master copy): flagged; the weights' rounding may leave them unnamed
FLAGGED_BF16 = ("zero2-rank_mean-bf16",)


def audits(world: int, kinds: tuple[str, ...], tmp_path: Path, script: Path = SCRIPT) -> dict[str, dict[str, Any]]:
    out = tmp_path / f"deepspeed-{world}.jsonl"
    done = _launch(world, kinds, out, script, DS_ACCELERATOR="cpu")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return {result["kind"]: result for result in map(json.loads, out.read_text().splitlines())}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    return audits(2, (*CORRECT_2, *FLAGGED_2, *FLAGGED_BF16), tmp_path_factory.mktemp("two"))


@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    return audits(3, (*CORRECT_3, *FLAGGED_3), tmp_path_factory.mktemp("three"))


def _ranks(request: pytest.FixtureRequest, kind: str) -> tuple[dict[str, Any], int]:
    world = 2 if kind in (*CORRECT_2, *FLAGGED_2, *FLAGGED_BF16) else 3
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
    assert (", bf16," in result["read"]) == ("-bf16" in kind), result["read"]


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


@pytest.mark.parametrize("kind", FLAGGED_BF16)
def test_a_per_rank_token_mean_with_bf16_weights_is_flagged(request: pytest.FixtureRequest, kind: str) -> None:
    result, _ = _ranks(request, kind)
    assert all(window["status"] == "not_equivalent" for window in result["audit"]["windows"]), result["summary"]


PEERS = Path(__file__).parent / "data" / "peers_under_deepspeed.py"
PEER_KINDS = ("trainer-llama", "trainer-gpt2_token_classification", "accelerate-correct", "accelerate-mean")


@pytest.fixture(scope="module")
def peers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    return audits(2, PEER_KINDS, tmp_path_factory.mktemp("peers"), script=PEERS)


def test_the_trainer_with_a_zero_2_config_passes_a_head_that_divides_by_num_items_in_batch(
    peers: dict[str, dict[str, Any]],
) -> None:
    result = peers["trainer-llama"]
    assert result["audit"]["status"] == "equivalent" and result["audit"]["judged"] >= 2, result["summary"]
    # the TrainingArguments read (max_grad_norm=1.0 by default, clipped by the engine) and the engine's config
    assert "max_grad_norm=1.0" in result["read"] and "ZeRO stage 2" in result["read"], result["read"]


def test_the_trainer_with_a_zero_2_config_flags_a_head_that_ignores_num_items_in_batch(
    peers: dict[str, dict[str, Any]],
) -> None:
    result = peers["trainer-gpt2_token_classification"]
    windows = result["audit"]["windows"]
    assert windows and all(window["status"] == "not_equivalent" for window in windows), result["summary"]
    assert "ignored num_items_in_batch" in windows[0]["setting"], windows[0]["setting"]


def test_accelerate_with_a_deepspeed_plugin_passes_a_correct_loop_and_flags_micro_batch_means(
    peers: dict[str, dict[str, Any]],
) -> None:
    correct, means = peers["accelerate-correct"], peers["accelerate-mean"]
    assert correct["audit"]["status"] == "equivalent" and correct["audit"]["judged"] == 2, correct["summary"]
    assert "gradient_clipping=1" in correct["read"], correct["read"]
    assert all(window["status"] == "not_equivalent" for window in means["audit"]["windows"]), means["summary"]
    # two micro-batches clipped: their weights' direction is a mean of means (and a sum of means alike)
    assert "mean of means" in means["audit"]["windows"][0]["weights"]["normaliser"], means["summary"]

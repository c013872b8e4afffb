"""``equiv.audit`` on ranks that Ray started (issue 45): inside Ray Train's TorchTrainer workers and inside a Ray
actor group that sets up torch.distributed itself (verl, NeMo RL, SkyRL), on gloo and the CPU, nothing of equiv
changed for it: a correct loop passes and a per-rank token mean is flagged on every step.

The loops are tests/data/audit_under_torchrun.py's (the torchrun tests' own), run by tests/data/audit_under_ray.py
on 2 ranks; one local Ray for the module (~5 s to start), each test ~15-30 s on 2 busy cores."""

from __future__ import annotations

import json
import os
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.distributed

DATA = Path(__file__).parent / "data"
ROOT = Path(__file__).parent.parent
CORRECT, PER_RANK_MEAN = "ddp_global_tokens", "ddp_rank_token_mean"


@pytest.fixture(scope="module")
def ray_module() -> Iterator[Any]:
    """A local Ray on 127.0.0.1 whose workers import this checkout's equiv and the loops in tests/data."""
    ray = pytest.importorskip("ray")
    pytest.importorskip("ray.train.torch")
    path = os.pathsep.join([str(DATA), str(ROOT), *(entry for entry in sys.path if entry)])
    # 4 logical CPUs on 2 cores: Ray Train's controller beside its 2 workers
    ray.init(
        num_cpus=4,
        _node_ip_address="127.0.0.1",
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": path, "OMP_NUM_THREADS": "1"}},
    )
    sys.path.insert(0, str(DATA))  # the driver imports the loops too (the actor class, the train function)
    try:
        yield ray
    finally:
        sys.path.remove(str(DATA))
        ray.shutdown()


def _read(out: Path) -> dict[str, dict[str, Any]]:
    return {result["kind"]: result for result in map(json.loads, out.read_text().splitlines())}


def _assert_pass_and_flagged(results: dict[str, dict[str, Any]], correct: str, per_rank_mean: str) -> None:
    good = results[correct]["audit"]
    # two ranks with different token counts, one micro-batch with none: every window judged, on both ranks
    assert good["status"] == "equivalent" and good["judged"] == 3, results[correct]["summary"]
    assert all([rank["rank"] for rank in window["ranks"]] == [0, 1] for window in good["windows"]), good
    bad = results[per_rank_mean]
    assert [window["status"] for window in bad["audit"]["windows"]] == ["not_equivalent"] * 3, bad["summary"]
    first = bad["summary"].splitlines()[1]
    assert "off on ranks [0, 1] of 2" in first, first
    # the witness names the per-rank mean the loop applied
    assert all("per-rank mean" in w["weights"]["normaliser"].split(" or ") for w in bad["audit"]["windows"]), bad


def test_the_audit_runs_inside_ray_train_torch_trainer_workers(ray_module: Any, tmp_path: Path) -> None:
    from audit_under_ray import train_loop_per_worker
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    out = tmp_path / "audits.jsonl"
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"kinds": [CORRECT, PER_RANK_MEAN], "out": str(out)},
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
        torch_config=TorchConfig(backend="gloo"),
        run_config=RunConfig(storage_path=str(tmp_path / "ray_results"), name="equiv-audit"),
    )
    trainer.fit()
    results = _read(out)
    assert results[CORRECT]["wrapped"] == "DistributedDataParallel"  # prepare_model's DDP is what was audited
    _assert_pass_and_flagged(results, CORRECT, PER_RANK_MEAN)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.mark.parametrize("engine", ["ddp", "fsdp2"])
def test_the_audit_runs_inside_a_ray_actor_group_with_its_own_process_group(
    ray_module: Any, tmp_path: Path, engine: str
) -> None:
    from audit_under_ray import Rank

    init_method = f"tcp://127.0.0.1:{_free_port()}"
    ranks = [Rank.remote(rank, 2, init_method) for rank in range(2)]  # type: ignore[attr-defined]
    out = tmp_path / "audits.jsonl"
    kinds = [f"{engine}_global_tokens", f"{engine}_rank_token_mean"]
    statuses = ray_module.get([rank.run.remote(kinds, str(out)) for rank in ranks], timeout=240)
    # every rank's own audit reached the same verdicts (rank 0 writes the details)
    assert statuses == [["equivalent", "not_equivalent"]] * 2, statuses
    ray_module.get([rank.close.remote() for rank in ranks], timeout=60)
    _assert_pass_and_flagged(_read(out), *kinds)

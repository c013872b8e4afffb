"""Loops audited under Ray (tests/test_audit_ray.py, issue 45): the torchrun scenarios of
audit_under_torchrun.py (same tiny causal LM, same per-rank windows with different token
counts, same loops), on ranks that Ray made instead of torchrun, in the two ways Ray users
get a process group:

- Ray Train's ``TorchTrainer``: its workers get a gloo group from Ray Train, and the model
  is wrapped by ``ray.train.torch.prepare_model`` (DDP), as Ray Train's guide writes it.
- A Ray actor group that sets up torch.distributed itself, as verl, NeMo RL and SkyRL do:
  N actors, each calling ``dist.init_process_group("gloo", rank=..., world_size=...,
  init_method="tcp://...")``, then DDP or FSDP2 as in the torchrun scenarios.

Rank 0 writes one JSON line per scenario (the audit's to_dict() and summary) to the file
it is given.  This module must be importable on Ray's workers (the test puts its folder on
their PYTHONPATH)."""

from __future__ import annotations

import json
from typing import Any

import ray
import torch
import torch.distributed as dist
from audit_under_torchrun import ddp_loop, rank_windows, scenario

import equiv
from equiv.auditing.runs import TinyLM


def _write(out: str, results: list[dict[str, Any]]) -> None:
    with open(out, "w", encoding="utf-8") as handle:
        for result in results:
            handle.write(json.dumps(result) + "\n")


def _prepared_scenario(kind: str, rank: int, world: int) -> dict[str, Any]:
    """A DDP scenario with the model wrapped by Ray Train's prepare_model instead of by hand."""
    from ray.train.torch import prepare_model

    torch.manual_seed(0)  # the same weights on every rank
    inner = TinyLM()
    model = prepare_model(inner)
    optimizer = torch.optim.AdamW(inner.parameters(), lr=1e-2)
    with equiv.audit(model, optimizer, loss=equiv.NextTokenCrossEntropy()) as audit:
        ddp_loop(kind, model, optimizer, rank_windows(rank, world), world)
    return {"kind": kind, "audit": audit.to_dict(), "summary": audit.summary(), "wrapped": type(model).__name__}


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """Ray Train's entry point on each of its workers (its gloo group is already up)."""
    import ray.train

    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    assert dist.is_initialized() and dist.get_world_size() == world
    results = [_prepared_scenario(kind, rank, world) for kind in config["kinds"]]
    if rank == 0:
        _write(config["out"], results)


@ray.remote(num_cpus=1)
class Rank:
    """One rank of an actor group that sets up its own process group (verl's, NeMo RL's, SkyRL's workers)."""

    def __init__(self, rank: int, world: int, init_method: str) -> None:
        dist.init_process_group("gloo", rank=rank, world_size=world, init_method=init_method)
        self.rank, self.world = rank, world

    def run(self, kinds: list[str], out: str) -> list[str]:
        results = [scenario(kind, self.rank, self.world) for kind in kinds]
        if self.rank == 0:
            _write(out, results)
        return [result["audit"]["status"] for result in results]

    def close(self) -> None:
        dist.destroy_process_group()

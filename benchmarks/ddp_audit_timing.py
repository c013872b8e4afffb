"""Run by benchmarks/test_audit_overhead.py::test_audit_ddp_overhead under torchrun (2 gloo
ranks): the 0.7M MLP of the audit benchmark wrapped in DDP (argv[3] "ddp") or a DeepSpeed ZeRO-2 engine
("deepspeed": ``DS_ACCELERATOR=cpu``, its accumulation and its optimizer step its own), a plain step and an
audited step (equiv.audit every=1, its own all-reduces across the ranks) alternately, each rank timing
its own; rank 0 writes the per-round times and the bytes the audit sent to argv[1]."""

from __future__ import annotations

import contextlib
import copy
import json
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import equiv

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from test_audit_overhead import MICRO_BATCHES, Classifier, _window


def ddp_step(model: DistributedDataParallel, optimizer: torch.optim.Optimizer, window) -> float:  # type: ignore[no-untyped-def]
    """DDP's accumulation: no_sync but on the last micro-batch; equal micro-batches, so sample means / N is exact."""
    start = time.perf_counter()
    for index, (inputs, targets) in enumerate(window):
        with model.no_sync() if index < len(window) - 1 else contextlib.nullcontext():
            (nn.functional.cross_entropy(model(inputs, targets), targets) / len(window)).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def deepspeed_step(engine, optimizer, window) -> float:  # type: ignore[no-untyped-def]
    """DeepSpeed's accumulation: engine.backward divides each micro-batch's mean by the accumulation steps
    (equal micro-batches: the window's mean), ZeRO-2 averages over the ranks, engine.step at the boundary."""
    start = time.perf_counter()
    for inputs, targets in window:
        engine.backward(nn.functional.cross_entropy(engine(inputs, targets), targets))
        engine.step()
    return time.perf_counter() - start


def engines(kind: str, inner: nn.Module) -> tuple[object, object, object, object]:
    """The plain and the audited model and optimizer, under DDP or a DeepSpeed ZeRO-2 engine."""
    copied = copy.deepcopy(inner)
    if kind == "ddp":
        return (
            DistributedDataParallel(inner),
            torch.optim.AdamW(inner.parameters(), lr=1e-3),
            DistributedDataParallel(copied),
            torch.optim.AdamW(copied.parameters(), lr=1e-3),
        )
    import deepspeed

    config = {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": MICRO_BATCHES,
        "zero_optimization": {"stage": 2},
        "gradient_clipping": 0.0,
    }
    made = []
    for module in (inner, copied):
        engine, optimizer, _, _ = deepspeed.initialize(
            model=module, optimizer=torch.optim.AdamW(module.parameters(), lr=1e-3), config=config
        )
        made += [engine, optimizer]
    return made[0], made[1], made[2], made[3]


def main() -> None:
    kind = sys.argv[3] if len(sys.argv) > 3 else "ddp"
    if kind == "deepspeed":
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    else:
        dist.init_process_group("gloo")
    rank, rounds = dist.get_rank(), int(sys.argv[2])
    torch.manual_seed(0)
    inner = Classifier()
    parameters = sum(p.numel() for p in inner.parameters())
    plain_model, plain_optimizer, audited_model, audited_optimizer = engines(kind, inner)
    step = ddp_step if kind == "ddp" else deepspeed_step
    generator = torch.Generator().manual_seed(rank)
    plain: list[float] = []
    audited: list[float] = []
    verdicts: list[bool] = []
    with equiv.audit(audited_model, audited_optimizer, loss=equiv.CrossEntropy()) as watched:
        for _ in range(rounds + 1):  # the first round warms both up, untimed
            window = _window(generator)
            plain.append(step(plain_model, plain_optimizer, window))
            audited.append(step(audited_model, audited_optimizer, window))
    verdicts = [window.equivalent for window in watched.windows]
    assert watched.ranks is not None
    if rank == 0:
        with open(sys.argv[1], "w", encoding="utf-8") as out:
            json.dump(
                {
                    "plain_s": plain[1:],
                    "audited_s": audited[1:],
                    "verdicts": verdicts,
                    "communicated_bytes": watched.ranks.communicated,
                    "audited_windows": len(watched.windows),
                    "world_size": dist.get_world_size(),
                    "micro_batches": MICRO_BATCHES,
                    "parameters": parameters,
                    "engine": kind,
                },
                out,
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

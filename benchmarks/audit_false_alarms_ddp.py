"""Run by benchmarks/test_audit_false_alarms.py::test_audit_false_alarms under torchrun (2 gloo
ranks): a correct DDP loop (each rank its own padded sequences, the loss summed over the
window's global real-token count times the world size, ``no_sync`` but on the last
micro-batch, AdamW) audited with ``every=1``, in segments of fresh seeds; rank 0 writes each
judged window's worst ratio to its allowance on any rank, and whether it was flagged, to argv[1].

argv: out, segments, windows per segment, first seed."""

from __future__ import annotations

import contextlib
import json
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import equiv
from equiv.auditing.runs import LENGTH, TinyLM, padded_sequences

TOKENS = equiv.NextTokenCrossEntropy()


def _window(generator: torch.Generator, seed: int, micro_batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Micro-batches of 2 sequences of real lengths 2..LENGTH, drawn per rank (token counts differ)."""
    window = []
    for index in range(micro_batches):
        lengths = torch.randint(2, LENGTH + 1, (2,), generator=generator).tolist()
        sequences = padded_sequences(lengths, seed=seed * 1000 + index)
        window.append((torch.stack([s[0] for s in sequences]), torch.stack([s[1] for s in sequences])))
    return window


def segment(seed: int, windows: int, rank: int, world: int) -> list[dict[str, object]]:
    torch.manual_seed(seed)  # the same weights on every rank
    inner = TinyLM()
    model = DistributedDataParallel(inner)
    optimizer = torch.optim.AdamW(inner.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(1000 * seed + rank)
    micro_batches = 2 + seed % 3
    with equiv.audit(model, optimizer, loss=TOKENS) as watched:
        for step in range(windows):
            window = _window(generator, 10_000 * seed + 100 * step + rank, micro_batches)
            local = torch.tensor([float(sum(int(TOKENS.count(labels)) for _, labels in window))], dtype=torch.float64)
            dist.all_reduce(local)
            global_tokens = float(local.item())
            for index, (ids, labels) in enumerate(window):
                last = index == len(window) - 1
                with contextlib.nullcontext() if last else model.no_sync():
                    (TOKENS.sum(model(ids, labels), labels) / global_tokens * world).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return [
        {
            "worst_ratio": max(r.worst_ratio for r in w.ranks),
            "flagged": not w.equivalent,
            "step": w.step,
            "seed": seed,
            "line": w.line(),
        }
        for w in watched.windows
        if w.judged
    ]


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    out, segments, per_segment, first_seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    records: list[dict[str, object]] = []
    for seed in range(first_seed, first_seed + segments):
        records += segment(seed, per_segment, rank, world)
    if rank == 0:
        with open(out, "w", encoding="utf-8") as handle:
            json.dump(
                {"windows": records, "world_size": world, "parameters": sum(p.numel() for p in TinyLM().parameters())},
                handle,
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

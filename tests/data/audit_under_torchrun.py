"""Loops audited under torchrun (tests/test_audit_torchrun.py): each scenario trains a
tiny causal LM for three optimizer steps on every rank, inside ``equiv.audit``, and
rank 0 writes one JSON line per scenario (the audit's to_dict(), its summary, the bytes
the audit's collectives sent) to the file given as argv[1].  argv[2:] names the scenarios.

The data: per rank, windows of 2 micro-batches of 2 padded sequences whose real lengths
differ by rank and by window (so per-rank token counts differ), and one micro-batch on
the last rank with no real next-token target at all (sequences of length 1)."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel

import equiv
from equiv.auditing.runs import TinyLM, padded_sequences

MICRO_BATCHES, WINDOWS = 2, 3


def rank_windows(rank: int, world: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    windows = []
    for window in range(WINDOWS):
        micro = []
        for index in range(MICRO_BATCHES):
            if rank == world - 1 and window == 1 and index == 0:
                lengths = [1, 1]  # no real next-token target on this rank's micro-batch
            else:
                lengths = [2 + (rank * 3 + window + index) % 7, 8 - (rank + index) % 5]
            sequences = padded_sequences(lengths, seed=100 * rank + 10 * window + index)
            micro.append((torch.stack([s[0] for s in sequences]), torch.stack([s[1] for s in sequences])))
        windows.append(micro)
    return windows


def summed_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100, reduction="sum"
    )


def tokens(labels: torch.Tensor) -> int:
    return int((labels[:, 1:] != -100).sum())


def all_reduced(value: float) -> float:
    total = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(total)
    return float(total.item())


def ddp_loop(kind: str, model: nn.Module, optimizer: torch.optim.Optimizer, windows, world: int) -> None:
    """DDP averages gradients over the ranks: a loss over the global count is multiplied by the world size."""
    for window in windows:
        local = sum(tokens(labels) for _, labels in window)
        global_tokens = all_reduced(local)
        for index, (ids, labels) in enumerate(window):
            last = index == len(window) - 1
            sync_off = model.no_sync() if (not last or kind == "ddp_sync_left_off") else contextlib.nullcontext()
            with sync_off:
                loss = summed_loss(model(ids, labels), labels)
                if kind == "ddp_rank_token_mean":  # each rank's own token mean, averaged by DDP
                    loss = loss / local
                else:
                    loss = loss / global_tokens * world
                loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def fsdp2_loop(kind: str, model: nn.Module, optimizer: torch.optim.Optimizer, windows, world: int) -> None:
    """FSDP2's accumulation: gradient sync off but on the window's last micro-batch; FSDP2 averages the
    reduce-scattered gradients over the ranks, so a loss over the global count is multiplied by the world."""
    for window in windows:
        local = sum(tokens(labels) for _, labels in window)
        global_tokens = all_reduced(local)
        for index, (ids, labels) in enumerate(window):
            last = index == len(window) - 1
            model.set_requires_gradient_sync(last and kind != "fsdp2_sync_left_off")
            loss = summed_loss(model(ids, labels), labels)
            loss = loss / local if kind == "fsdp2_rank_token_mean" else loss / global_tokens * world
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def buffer_loop(kind: str, model: nn.Module, optimizer: torch.optim.Optimizer, windows, world: int) -> None:
    """A gradient buffer of the loop's own, reduced across the ranks once per window (as
    Megatron's and DeepSpeed's main_grad buffers are), the loss over the global count."""
    for window in windows:
        global_tokens = all_reduced(sum(tokens(labels) for _, labels in window))
        buffers = [torch.zeros_like(p) for p in model.parameters()]
        for index, (ids, labels) in enumerate(window):
            (summed_loss(model(ids, labels), labels) / global_tokens).backward()
            last = index == len(window) - 1
            if kind == "buffer_last_left_out" and last:  # DeepSpeed PR #7985: reduced before the last one
                for buffer in buffers:
                    dist.all_reduce(buffer)
            for buffer, param in zip(buffers, model.parameters(), strict=True):
                grad = param.grad if param.grad is not None else torch.zeros_like(param)
                if kind == "buffer_scaled_by_index":  # Megatron PR #3023: micro-batch i scaled by DP^(i-GA+1)
                    buffer.add_(grad * float(world) ** (index - len(window) + 1))
                elif kind == "buffer_last_only":  # the buffer overwritten by each micro-batch
                    buffer.copy_(grad)
                else:
                    buffer.add_(grad)
            model.zero_grad(set_to_none=True)
        if kind != "buffer_last_left_out":
            for buffer in buffers:
                dist.all_reduce(buffer)
        for buffer, param in zip(buffers, model.parameters(), strict=True):
            param.grad = buffer
        if kind == "buffer_rank_1_hangs" and dist.get_rank() == 1 and window is windows[1]:
            time.sleep(120)  # hangs before its optimizer step: rank 0's audit waits for it
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


class DroppingLM(TinyLM):
    """TinyLM with functional dropout in its training-mode forward (as a transformers attention's is): no module
    names it, so the audit finds it by the forward's random draws."""

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        hidden = F.dropout(torch.tanh(self.mix(self.embed(input_ids))), p=0.1, training=self.training)
        return self.head(hidden)


def scenario(kind: str, rank: int, world: int) -> dict:
    torch.manual_seed(0)  # the same weights on every rank
    inner = DroppingLM() if kind.endswith("_dropout") else TinyLM()
    if kind.startswith("fsdp2"):
        from torch.distributed.fsdp import fully_shard

        fully_shard(inner.mix)
        fully_shard(inner)
    model: nn.Module = DistributedDataParallel(inner) if kind.startswith("ddp") else inner
    optimizer = torch.optim.AdamW(inner.parameters(), lr=1e-2)
    windows = rank_windows(rank, world)
    loop = ddp_loop if kind.startswith("ddp") else fsdp2_loop if kind.startswith("fsdp2") else buffer_loop
    with equiv.audit(model, optimizer, loss=equiv.NextTokenCrossEntropy()) as audit:
        loop(kind, model, optimizer, windows, world)
    return {
        "kind": kind,
        "audit": audit.to_dict(),
        "summary": audit.summary(),
        "communicated": audit.ranks.communicated if audit.ranks is not None else None,
    }


def tensor_parallel_is_refused() -> dict:
    """A tensor-parallel model: its ranks share their micro-batches, so the union of theirs is not the batch."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = TinyLM()
    parallelize_module(model, init_device_mesh("cpu", (dist.get_world_size(),)), {"mix": ColwiseParallel()})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    try:
        with equiv.audit(model, optimizer, loss=equiv.NextTokenCrossEntropy()):
            pass
    except RuntimeError as error:
        return {"kind": "tp_refused", "error": str(error)}
    return {"kind": "tp_refused", "error": None}


def trainer(kind: str) -> dict:
    """The transformers Trainer as the README audits it (two lines: the callback), launched by torchrun:
    DDP on gloo, each rank its shard of the batches; its defaults (max_grad_norm=1.0) read."""
    from equiv.auditing.runs import trainer_run

    audit = trainer_run(loss_kwargs=kind == "trainer", max_grad_norm=None)
    return {
        "kind": kind,
        "audit": audit.to_dict(),
        "summary": audit.summary(),
        "read": audit.read,
        "communicated": audit.ranks.communicated if audit.ranks is not None else None,
    }


def lightning(kind: str) -> dict:
    """Lightning's Trainer.fit with the audit's callback, launched by torchrun: its DDP strategy on the
    ranks torchrun started (accumulate_grad_batches=3 over each rank's share of 7 batches)."""
    from equiv.auditing.runs import lightning_tail_run

    audit = lightning_tail_run(strategy="ddp", devices=int(os.environ["WORLD_SIZE"]), num_nodes=1)
    return {
        "kind": kind,
        "audit": audit.to_dict(),
        "summary": audit.summary(),
        "read": audit.read,
        "communicated": audit.ranks.communicated if audit.ranks is not None else None,
    }


def main() -> None:
    out, kinds = sys.argv[1], sys.argv[2:]
    if kinds != ["lightning"]:  # Lightning starts its own process group on the ranks torchrun made
        dist.init_process_group("gloo")
    else:
        import pytorch_lightning  # noqa: F401  (imported before: the group is Lightning's to make)
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    results = [
        tensor_parallel_is_refused()
        if kind == "tp_refused"
        else trainer(kind)
        if kind.startswith("trainer")
        else lightning(kind)
        if kind == "lightning"
        else scenario(kind, rank, world)
        for kind in kinds
    ]
    if rank == 0:
        with open(out, "w", encoding="utf-8") as handle:
            for result in results:
                handle.write(json.dumps(result) + "\n")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

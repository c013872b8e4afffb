"""Loops audited under a DeepSpeed engine (tests/test_audit_deepspeed.py), launched by torchrun on gloo with
``DS_ACCELERATOR=cpu``: each scenario builds ``deepspeed.initialize`` over a tiny causal LM (ZeRO stage, optimizer
and clipping from the scenario's name), trains three optimizer steps of ``gradient_accumulation_steps`` micro-batches
per rank with ``engine.backward`` / ``engine.step`` as DeepSpeed users do, inside ``equiv.audit``, and rank 0
writes one JSON line per scenario (to_dict(), summary, what was read) to argv[1].  argv[2:] names the scenarios:

``zero{0,1,2}-{correct,rank_mean,mean_of_means}[-clip][-module][-fused]``

* correct: each micro-batch's summed token loss over the window's global token count, times the ranks (DeepSpeed
  averages over them) and times gradient_accumulation_steps (engine.backward divides by it): the full batch;
* rank_mean: over this rank's own window tokens (a per-rank token mean);
* mean_of_means: each micro-batch's own token mean (what engine.backward's GAS division assumes is right);
* clip: the config's gradient_clipping (0.05, so that it acts), never told to the audit;
* module: the audit handed engine.module and engine.optimizer (else the engine itself, no optimizer);
* fused: the config's optimizer (DeepSpeed's FusedAdam); else a client torch.optim.AdamW;
* bf16: the config's bf16 (the model's weights in bfloat16, ZeRO's fp32 partitions the master copy).
"""

from __future__ import annotations

import json
import os
import sys

import deepspeed
import torch
import torch.distributed as dist

# The same loss and token count as the torchrun scenarios' (this script's folder is on sys.path when run).
from audit_under_torchrun import summed_loss, tokens

import equiv
from equiv.auditing.runs import TinyLM, padded_sequences

GAS, WINDOWS = 3, 3


def rank_windows(rank: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    windows = []
    for window in range(WINDOWS):
        micro = []
        for index in range(GAS):
            lengths = [2 + (rank * 3 + window + 2 * index) % 7, 8 - (rank + index) % 5]
            sequences = padded_sequences(lengths, seed=100 * rank + 10 * window + index)
            micro.append((torch.stack([s[0] for s in sequences]), torch.stack([s[1] for s in sequences])))
        windows.append(micro)
    return windows


def scenario(kind: str, rank: int, world: int) -> dict:
    stage = int(kind[4])
    torch.manual_seed(0)
    model = TinyLM()
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": GAS,
        "zero_optimization": {"stage": stage},
        "gradient_clipping": 0.05 if "-clip" in kind else 0.0,
        "bf16": {"enabled": "-bf16" in kind},
    }
    if "-fused" in kind:
        config["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    else:
        client = torch.optim.AdamW(model.parameters(), lr=1e-2)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=client, config=config)
    handed = (engine.module, engine.optimizer) if "-module" in kind else (engine,)
    with equiv.audit(*handed, loss=equiv.NextTokenCrossEntropy()) as audit:
        for window in rank_windows(rank):
            local = sum(tokens(labels) for _, labels in window)
            total = torch.tensor([float(local)], dtype=torch.float64)
            dist.all_reduce(total)
            for ids, labels in window:
                loss = summed_loss(engine(ids, labels), labels)
                if "rank_mean" in kind:
                    loss = loss / local
                elif "mean_of_means" in kind:
                    loss = loss / max(tokens(labels), 1)
                else:
                    loss = loss / float(total) * world * GAS
                engine.backward(loss)
                engine.step()
    return {"kind": kind, "audit": audit.to_dict(), "summary": audit.summary(), "read": audit.read}


def main() -> None:
    out, kinds = sys.argv[1], sys.argv[2:]
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    results = []
    for kind in kinds:
        try:
            results.append(scenario(kind, rank, world))
        except Exception as error:  # named in the file: the test says which scenario and why
            results.append({"kind": kind, "error": f"{type(error).__name__}: {error}"})
            if os.environ.get("EQUIV_DS_RAISE"):
                raise
    if rank == 0:
        with open(out, "w") as handle:
            for result in results:
                handle.write(json.dumps(result) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Steps as DeepSpeed users write them, for ``check_distributed(..., engine="deepspeed")``.

The step is handed the ``deepspeed.initialize(...)`` engine (ZeRO-1 or -2, one
``gradient_accumulation_steps`` per micro-batch of the rank) and its ZeRO optimizer, and
calls ``engine.backward(loss)`` and ``engine.step()`` once per micro-batch, as DeepSpeed's
own examples do.  What DeepSpeed does to the loss it is given:

- ``engine.backward`` divides it by ``gradient_accumulation_steps`` (``scale_wrt_gas``,
  ``deepspeed/runtime/engine.py``);
- ZeRO-1/2 reduce the accumulated gradient into flat partitions and average it over the
  data-parallel ranks (divide by the world size W);
- ``engine.step()`` steps the optimizer at the accumulation boundary only.

So the full-batch gradient, ``sum over every item of every rank / N`` (N the items of the
whole window, all-reduced), comes out of each micro-batch's loss
``loss_sum * W * GAS / N``: GAS undoes the engine's division, W the ranks' averaging.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from equiv.batches import MicroBatches
from equiv.losses import item_count, loss_sum_and_count
from equiv.outcomes import Outcome
from equiv.zoo.distributed_bugs import Fsdp2Entry

__all__ = ["DEEPSPEED_ZOO", "deepspeed_global_item_count", "deepspeed_local_token_mean", "deepspeed_mean_of_means"]


def _window(engine: Any, micro_batches: MicroBatches, loss_of: Callable[[Tensor, Tensor], Tensor]) -> None:
    """Every micro-batch through ``engine.backward`` and ``engine.step`` (the optimizer steps at the boundary)."""
    for inputs, targets in micro_batches:
        engine.backward(loss_of(engine(inputs), targets))
        engine.step()


def deepspeed_global_item_count(
    engine: Any, optimizer: Any, micro_batches: MicroBatches, loss_fn: Callable[..., Tensor]
) -> None:
    """Correct: each micro-batch's summed loss over the window's all-reduced item count, times the world
    size (ZeRO's average over ranks) and ``gradient_accumulation_steps`` (engine.backward's division)."""
    items = torch.tensor(float(sum(item_count(loss_fn, targets) for _, targets in micro_batches)), dtype=torch.float64)
    dist.all_reduce(items)
    scale = dist.get_world_size() * len(micro_batches) / float(items)
    _window(engine, micro_batches, lambda output, targets: loss_sum_and_count(loss_fn, output, targets)[0] * scale)


def deepspeed_local_token_mean(
    engine: Any, optimizer: Any, micro_batches: MicroBatches, loss_fn: Callable[..., Tensor]
) -> None:
    """Each rank's summed loss over its OWN item count (times GAS, which engine.backward divides out), then
    ZeRO averages the ranks: a mean of per-rank means, wrong whenever ranks hold different numbers of
    items (transformers #34191 / #34242's per-device normalisation, under DeepSpeed)."""
    rank_items = float(sum(item_count(loss_fn, targets) for _, targets in micro_batches))
    scale = len(micro_batches) / rank_items
    _window(engine, micro_batches, lambda output, targets: loss_sum_and_count(loss_fn, output, targets)[0] * scale)


def deepspeed_mean_of_means(
    engine: Any, optimizer: Any, micro_batches: MicroBatches, loss_fn: Callable[..., Tensor]
) -> None:
    """Each micro-batch's mean loss handed to engine.backward as DeepSpeed's examples do: the engine divides
    by GAS and ZeRO averages the ranks, a mean of micro-batch means, wrong whenever micro-batches hold
    different numbers of items (transformers #34191's mean of micro-batch means, under DeepSpeed)."""
    _window(engine, micro_batches, loss_fn)


#: The DeepSpeed zoo as reports/equivalence.md checks it under ZeRO-1 and ZeRO-2 (the entry type FSDP2's zoo uses:
#: a step, what it must give, one line, the upstream report).
DEEPSPEED_ZOO: dict[str, Fsdp2Entry] = {
    "deepspeed_global_item_count": Fsdp2Entry(
        deepspeed_global_item_count,
        expected=Outcome.EQUIVALENT,
        what="summed loss / all-reduced item count x ranks x gradient_accumulation_steps",
    ),
    "deepspeed_local_token_mean": Fsdp2Entry(
        deepspeed_local_token_mean,
        what="each rank's own item mean (x gradient_accumulation_steps), averaged by ZeRO",
        upstream="transformers #34191 / #34242",
    ),
    "deepspeed_mean_of_means": Fsdp2Entry(
        deepspeed_mean_of_means,
        what="each micro-batch's mean to engine.backward (divided by gradient_accumulation_steps)",
        upstream="transformers #34191",
    ),
}

"""Three workloads to measure accumulation on, each with a fixed global batch.

An activation-heavy transformer, a parameter-heavy MLP and a convolutional
net, named on the command line (``equiv plan mlp``) and in the benchmarks by
their key in :data:`WORKLOADS`.  Each model is a :class:`BlockNet` whose
blocks can be activation-checkpointed, the alternative to accumulating that
users reach for.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from equiv.batches import Batch
from equiv.losses import CrossEntropy, TokenCrossEntropy

__all__ = ["WORKLOADS", "BlockNet", "CountItems", "LossSum", "Workload", "build_workload_model"]

#: ``loss_sum(output, targets)``: the SUM of the loss over a micro-batch's items.
LossSum = Callable[[Tensor, Tensor], Tensor]
#: ``count_items(targets)``: how many items that sum is over (samples, or tokens).
CountItems = Callable[[Tensor], int]


class BlockNet(nn.Module):
    """stem -> blocks -> head, where each block can be activation-checkpointed:
    its activations are dropped after the forward pass and recomputed in backward."""

    def __init__(self, stem: nn.Module, blocks: Sequence[nn.Module], head: nn.Module) -> None:
        super().__init__()
        self.stem = stem
        self.blocks = nn.ModuleList(blocks)
        self.head = head
        self.checkpoint_blocks = False

    def forward(self, x: Tensor) -> Tensor:
        h = self.stem(x)
        for block in self.blocks:
            # use_reentrant=False: the variant PyTorch recommends, works with any input.
            h = checkpoint(block, h, use_reentrant=False) if self.checkpoint_blocks else block(h)
        return self.head(h)


class _TokenStem(nn.Module):
    def __init__(self, vocab_size: int, width: int, seq_len: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, width)
        self.position = nn.Parameter(torch.randn(seq_len, width) * 0.02)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.embed(tokens) + self.position


@dataclass(frozen=True, slots=True, kw_only=True)
class Workload:
    """A model, how to draw its global batch, and its summed loss."""

    name: str
    description: str
    global_batch_size: int
    build: Callable[[], BlockNet]
    make_batch: Callable[[int, torch.Generator], Batch]
    loss_sum: LossSum
    #: Items the summed loss is over (samples, or tokens): the normaliser.
    count_items: CountItems


def _transformer() -> Workload:
    vocab, width, seq_len, layers = 128, 64, 64, 2

    def build() -> BlockNet:
        # dropout=0: a benchmark must do the same work every round.
        blocks = [
            nn.TransformerEncoderLayer(
                width,
                nhead=4,
                dim_feedforward=4 * width,
                dropout=0.0,
                activation="gelu",
                batch_first=True,
                norm_first=True,
            )
            for _ in range(layers)
        ]
        head = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, vocab))
        return BlockNet(_TokenStem(vocab, width, seq_len), blocks, head)

    def make_batch(size: int, generator: torch.Generator) -> Batch:
        tokens = torch.randint(0, vocab, (size, seq_len + 1), generator=generator)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    return Workload(
        name="transformer",
        description=f"{layers} pre-norm transformer layers, width {width}, {seq_len} tokens, vocabulary {vocab}",
        global_batch_size=64,
        build=build,
        make_batch=make_batch,
        loss_sum=TokenCrossEntropy().sum,
        count_items=lambda targets: targets.numel(),  # no padding: every token counts
    )


def _mlp() -> Workload:
    width, classes = 1024, 10

    def build() -> BlockNet:
        blocks = [nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(2)]
        return BlockNet(nn.Identity(), blocks, nn.Linear(width, classes))

    def make_batch(size: int, generator: torch.Generator) -> Batch:
        return torch.randn(size, width, generator=generator), torch.randint(0, classes, (size,), generator=generator)

    return Workload(
        name="mlp",
        description=f"MLP {width}-{width}-{width}-{classes}, ReLU (2.1M parameters)",
        global_batch_size=256,
        build=build,
        make_batch=make_batch,
        loss_sum=CrossEntropy().sum,
        count_items=lambda targets: targets.shape[0],
    )


def _convnet() -> Workload:
    classes = 10

    def conv_block(c_in: int, c_out: int) -> nn.Module:
        return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))

    def build() -> BlockNet:
        blocks = [conv_block(3, 16), conv_block(16, 32), conv_block(32, 64)]
        return BlockNet(nn.Identity(), blocks, nn.Sequential(nn.Flatten(), nn.Linear(64 * 4 * 4, classes)))

    def make_batch(size: int, generator: torch.Generator) -> Batch:
        images = torch.randn(size, 3, 32, 32, generator=generator)
        return images, torch.randint(0, classes, (size,), generator=generator)

    return Workload(
        name="convnet",
        description="3 conv-ReLU-maxpool blocks (16, 32, 64 channels) on 3x32x32 images",
        global_batch_size=64,
        build=build,
        make_batch=make_batch,
        loss_sum=CrossEntropy().sum,
        count_items=lambda targets: targets.shape[0],
    )


WORKLOADS: dict[str, Workload] = {w.name: w for w in (_transformer(), _mlp(), _convnet())}


def build_workload_model(workload: Workload, *, seed: int = 0, device: torch.device | str = "cpu") -> BlockNet:
    """The workload's model with weights drawn from ``seed`` (global RNG untouched)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = workload.build()
    return model.to(device)

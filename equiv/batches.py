"""A batch, its micro-batches, and how a batch is cut into them.

Every layer speaks of micro-batches the same way: a list of ``(inputs,
targets)`` pairs, consecutive pieces of one batch, in order, sizes possibly
uneven.  This is the type the candidate contract hands a step.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

__all__ = ["Batch", "MicroBatches", "even_sizes", "split_batch"]

#: One batch, or one micro-batch: inputs and targets with the same leading size.
Batch = tuple[Tensor, Tensor]
#: Consecutive pieces of one batch, in order; sizes may differ.
MicroBatches = list[Batch]


def even_sizes(batch_size: int, n_micro_batches: int) -> list[int]:
    """``n_micro_batches`` sizes summing to ``batch_size``, as even as possible:
    the first ``batch_size % n_micro_batches`` get one sample more."""
    if not 1 <= n_micro_batches <= batch_size:
        raise ValueError(f"n_micro_batches must be in 1..{batch_size} (the batch size), got {n_micro_batches}")
    base, extra = divmod(batch_size, n_micro_batches)
    return [base + 1] * extra + [base] * (n_micro_batches - extra)


def split_batch(batch: Batch, sizes: Sequence[int], *, copy: bool = False) -> MicroBatches:
    """Cut ``batch`` into consecutive micro-batches of ``sizes`` samples.

    Views by default (no memory beyond the batch's, what a training loop
    does); ``copy=True`` clones each piece, so a step that writes into its
    inputs cannot change the batch other runs of the same case read.
    """
    inputs, targets = batch
    if sum(sizes) != inputs.shape[0] or any(size < 1 for size in sizes):
        raise ValueError(
            f"micro-batch sizes {list(sizes)} must be positive and add up to the batch's {inputs.shape[0]} samples"
        )
    pieces = zip(inputs.split(list(sizes)), targets.split(list(sizes)), strict=True)
    if copy:
        return [(x.clone(), y.clone()) for x, y in pieces]
    return list(pieces)

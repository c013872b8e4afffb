"""Context parallelism for the distributed check: which positions of every sequence a rank holds.

``engine="cp"`` serves each data rank's micro-batches with C ranks (a
context-parallel group): every rank of the group sees the same samples, and
rank ``r`` keeps slice ``r % C`` of every sequence's positions, inputs and
targets alike (C contiguous slices of equal length).  Each computes the
per-token loss on its own positions; the normaliser that makes the step the
full-batch one is the count of real tokens over every rank's slices and every
micro-batch of the window, and the gradients are reduced over every rank (data
x context), as Megatron reduces them over its DP x CP group
(``get_data_parallel_group(with_context_parallel=True)``).  ``"cp"`` wraps the
model in DDP over all ranks, ``"fsdp2+cp"`` shards it with FSDP2 over all
ranks.

Sequence parallelism is the same split over a tensor-parallel group: under
``engine="tp"`` a position-wise model is not sharded by the nn.Linear plan
but served by its T TP ranks, each holding slice ``r % T`` of every sequence,
the model replicated and wrapped in DDP over them, as Megatron's sequence
parallelism hands each TP rank its slice of the router's tokens and reduces
the replicated (sequence-parallel) weights' gradients over TP.  The engine
installs the same layout, its group the TP group, so a step reads its size
as Megatron reads ``tp_cp_group.size()``.

A step reads the groups as a Megatron step reads ``parallel_state``:
:func:`layout` gives this rank's :class:`ContextParallelLayout` (its slice, the
pure data-parallel group of the ranks holding the same slice of the other data
ranks' samples, and its own context-parallel group), installed by the engine
before the step runs.

Only a model whose outputs at a position depend on that position's input
alone can be split so without exchanging activations (attention would need
ring attention); :data:`POSITIONWISE_MODELS` names those.  The token-level MoE
is one but for its router's sequence-wise routing counts, which it sums over
:func:`sequence_group` in the forward, as Megatron's router sums them over its
TP x CP group (Megatron-LM #1652).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

__all__ = [
    "POSITIONWISE_LOSSES",
    "POSITIONWISE_MODELS",
    "ContextParallelLayout",
    "clear_layout",
    "install_layout",
    "layout",
    "position_slice",
    "sequence_group",
]

#: Registered model families whose output at each position depends on that
#: position's input only (embedding -> per-token MLP -> logits; the token-level
#: MoE, its routing counts summed over :func:`sequence_group`), with the loss each takes.
POSITIONWISE_MODELS: tuple[str, ...] = ("token_mlp", "token_moe")
#: The loss each of :data:`POSITIONWISE_MODELS` is split with (a sum over tokens).
POSITIONWISE_LOSSES: dict[str, str] = {"token_mlp": "token_cross_entropy", "token_moe": "token_mse_aux"}


def position_slice(seq_len: int, context_parallel: int, index: int) -> slice:
    """Slice ``index`` of ``context_parallel`` contiguous, equal slices of ``seq_len`` positions.

    Args:
        seq_len: positions per sequence (a multiple of ``context_parallel``).
        context_parallel: ranks per context-parallel group.
        index: this rank's place in its group, 0 to ``context_parallel - 1``.

    Returns:
        The positions the rank holds.
    """
    if seq_len % context_parallel:
        raise ValueError(
            f"context parallelism over {context_parallel} ranks needs a sequence length divisible by "
            f"{context_parallel}, got seq_len={seq_len}"
        )
    if not 0 <= index < context_parallel:
        raise ValueError(f"index must be in 0..{context_parallel - 1}, got {index}")
    width = seq_len // context_parallel
    return slice(index * width, (index + 1) * width)


@dataclass(frozen=True)
class ContextParallelLayout:
    """Where this rank sits in the data x context grid (rank r: data rank r // size, slice r % size)."""

    #: Ranks per context-parallel group (C).
    size: int
    #: This rank's slice of every sequence, 0 to ``size - 1``.
    index: int
    #: The ranks holding this same slice of every data rank's samples: Megatron's
    #: ``get_data_parallel_group()`` (pure DP, without the context ranks).
    data_parallel_group: dist.ProcessGroup
    #: This data rank's ``size`` ranks, which see the same samples.
    context_parallel_group: dist.ProcessGroup


_LAYOUT: list[ContextParallelLayout] = []


def install_layout(context_parallel: int) -> ContextParallelLayout:
    """Make the groups of a data x ``context_parallel`` grid over the initialised
    world (a collective: every rank calls it, in the same order) and make them
    what :func:`layout` returns on this rank.

    Args:
        context_parallel: ranks per context-parallel group; the world size must be a multiple.

    Returns:
        This rank's layout.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    if context_parallel < 1 or world % context_parallel:
        raise ValueError(f"a world of {world} ranks cannot be split into context-parallel groups of {context_parallel}")
    data_groups = [dist.new_group(list(range(index, world, context_parallel))) for index in range(context_parallel)]
    context_groups = [
        dist.new_group(list(range(start, start + context_parallel))) for start in range(0, world, context_parallel)
    ]
    installed = ContextParallelLayout(
        size=context_parallel,
        index=rank % context_parallel,
        data_parallel_group=data_groups[rank % context_parallel],
        context_parallel_group=context_groups[rank // context_parallel],
    )
    _LAYOUT[:] = [installed]
    return installed


def layout() -> ContextParallelLayout:
    """This rank's context-parallel layout, as the engine installed it.

    Returns:
        The layout.

    Raises:
        RuntimeError: no context-parallel engine runs on this rank.
    """
    if not _LAYOUT:
        raise RuntimeError(
            "no context-parallel layout on this rank: the step runs under engine 'cp' or 'fsdp2+cp' "
            "(equiv.check_distributed(..., engine='cp')), or sequence-parallel under 'tp' (a "
            "position-wise model)"
        )
    return _LAYOUT[0]


def clear_layout() -> None:
    """Forget this rank's layout (an engine without context parallelism runs next)."""
    _LAYOUT.clear()


def sequence_group() -> dist.ProcessGroup | None:
    """The ranks holding the other slices of this rank's sequences, or None where
    a rank (or a single process) holds whole sequences.

    Returns:
        The installed layout's context-parallel group, else None.
    """
    return _LAYOUT[0].context_parallel_group if _LAYOUT else None

"""A case run by several ranks: :class:`DistributedCase`, each rank's micro-batches
(and its tensor- or context-parallel group), checked by
:func:`equiv.check_distributed` (:mod:`equiv.checking.distributed`, which
re-exports it where it was first published)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from equiv.cases.case import Case, InvalidCase
from equiv.distributed.context_parallel import POSITIONWISE_LOSSES, POSITIONWISE_MODELS, position_slice

__all__ = ["DistributedCase"]


@dataclass(frozen=True, kw_only=True, slots=True)
class DistributedCase:
    """A case run by ``len(rank_micro_batch_sizes)`` ranks.

    ``rank_micro_batch_sizes[r]`` cuts rank r's shard into micro-batches; the
    shards are consecutive pieces of each step's global batch, in rank order.
    ``case`` supplies everything else; its ``batch_size`` and
    ``micro_batch_sizes`` are derived (all ranks' micro-batches, in order).

    With ``tensor_parallel`` = T > 1 each entry of ``rank_micro_batch_sizes``
    is a data rank served by T tensor-parallel ranks that all see its
    micro-batches: ``world_size`` is data ranks x T, and rank r is data rank
    r // T (engines "tp" with one data rank, "fsdp2+tp" with several).

    With ``context_parallel`` = C > 1 each data rank is served by C ranks that
    see the same samples, rank r holding slice r % C of every sequence's
    positions (C contiguous, equal slices; engines "cp" and "fsdp2+cp").
    A position-wise model under ``tensor_parallel`` = T > 1 is split the same
    way over its T ranks (sequence parallelism, engine "tp"):
    :attr:`sequence_slices`.
    """

    case: Case
    rank_micro_batch_sizes: tuple[tuple[int, ...], ...]
    tensor_parallel: int = 1
    context_parallel: int = 1

    @classmethod
    def of(
        cls,
        base: Case,
        rank_micro_batch_sizes: Sequence[Sequence[int]],
        *,
        tensor_parallel: int = 1,
        context_parallel: int = 1,
    ) -> DistributedCase:
        for name, value in (("tensor_parallel", tensor_parallel), ("context_parallel", context_parallel)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidCase(
                    f"{name} must be a positive int (ranks per {name.replace('_', '-')} group), got {value!r}"
                )
        if tensor_parallel > 1 and context_parallel > 1:
            raise InvalidCase(
                f"tensor_parallel={tensor_parallel} and context_parallel={context_parallel}: "
                "a case splits its ranks one way, not both"
            )
        ranks = tuple(tuple(sizes) for sizes in rank_micro_batch_sizes)
        if not ranks:
            raise InvalidCase("rank_micro_batch_sizes needs at least one rank, got ()")
        for rank, sizes in enumerate(ranks):
            if not sizes or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes):
                raise InvalidCase(
                    f"rank {rank} has micro-batch sizes {sizes}; every rank needs at least one micro-batch "
                    "of at least one sample"
                )
        flat = tuple(size for sizes in ranks for size in sizes)
        case = base.replace(batch_size=sum(flat), micro_batch_sizes=list(flat))
        if context_parallel > 1:
            _check_context_parallel_case(case, context_parallel)
        elif tensor_parallel > 1 and case.model in POSITIONWISE_MODELS:  # sequence parallel
            _check_context_parallel_case(case, tensor_parallel, "tensor_parallel")
        return cls(
            case=case, rank_micro_batch_sizes=ranks, tensor_parallel=tensor_parallel, context_parallel=context_parallel
        )

    @property
    def data_ranks(self) -> int:
        return len(self.rank_micro_batch_sizes)

    @property
    def ranks_per_data_rank(self) -> int:
        """The ranks that see one data rank's samples: its TP or CP group."""
        return self.tensor_parallel * self.context_parallel

    @property
    def sequence_slices(self) -> int:
        """How many ranks split every sequence's positions: the context-parallel
        group, or the tensor-parallel group of a position-wise model (sequence
        parallelism); 1 where every rank holds whole sequences."""
        if self.context_parallel > 1:
            return self.context_parallel
        if self.tensor_parallel > 1 and self.case.model in POSITIONWISE_MODELS:
            return self.tensor_parallel
        return 1

    @property
    def world_size(self) -> int:
        return self.data_ranks * self.ranks_per_data_rank

    def data_rank(self, rank: int) -> int:
        """Which entry of ``rank_micro_batch_sizes`` rank ``rank`` trains on."""
        return rank // self.ranks_per_data_rank

    def rank_slice(self, rank: int) -> slice | tuple[slice, slice]:
        """What rank ``rank`` keeps of every batch: its data rank's samples, and
        under context (or sequence) parallelism its slice of every sequence's positions."""
        data_rank = self.data_rank(rank)
        start = sum(sum(sizes) for sizes in self.rank_micro_batch_sizes[:data_rank])
        samples = slice(start, start + sum(self.rank_micro_batch_sizes[data_rank]))
        slices = self.sequence_slices
        if slices == 1:
            return samples
        return samples, position_slice(_sequence_length(self.case), slices, rank % slices)

    def rank_micro_batches(self, rank: int) -> tuple[int, ...]:
        """Rank ``rank``'s micro-batch sizes (its data rank's)."""
        return self.rank_micro_batch_sizes[self.data_rank(rank)]

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "case": self.case.to_dict(),
            "rank_micro_batch_sizes": [list(s) for s in self.rank_micro_batch_sizes],
        }
        for name in ("tensor_parallel", "context_parallel"):
            if getattr(self, name) != 1:
                out[name] = getattr(self, name)
        return out

    def source(self, prefix: str = "") -> str:
        """The expression that builds this case again, every name behind ``prefix``
        (``"equiv."`` where only ``import equiv`` is in scope: a Reproduce line).

        Args:
            prefix: what goes before ``DistributedCase`` and ``Case``.

        Returns:
            ``DistributedCase.of(Case(...), [[...], ...])``, with ``tensor_parallel=T`` when T > 1
            (``context_parallel=C`` when C > 1).
        """
        tp = "" if self.tensor_parallel == 1 else f", tensor_parallel={self.tensor_parallel}"
        tp += "" if self.context_parallel == 1 else f", context_parallel={self.context_parallel}"
        shards = [list(s) for s in self.rank_micro_batch_sizes]
        return f"{prefix}DistributedCase.of({prefix}{self.case!r}, {shards!r}{tp})"

    def __repr__(self) -> str:
        return self.source()


def _sequence_length(case: Case) -> int:
    shape = case.build_model().output_shape
    assert shape is not None and len(shape) == 2, shape  # checked by _check_context_parallel_case
    return shape[0]


def _check_context_parallel_case(case: Case, context_parallel: int, name: str = "context_parallel") -> None:
    """A case context (or sequence) parallelism can split: a position-wise token
    model and a token loss, its sequence length a multiple of the group (``name``)."""
    if case.model not in POSITIONWISE_MODELS or case.loss != POSITIONWISE_LOSSES[case.model]:
        raise InvalidCase(
            f"{name}={context_parallel} splits every sequence's positions over ranks: it needs "
            f"a position-wise token model {list(POSITIONWISE_MODELS)} (no attention across the slices) "
            f"with its loss {POSITIONWISE_LOSSES}, got model={case.model!r}, loss={case.loss!r}"
        )
    seq_len = _sequence_length(case)
    if seq_len % context_parallel:
        raise InvalidCase(
            f"{name}={context_parallel} needs a sequence length divisible by it, got "
            f"seq_len={seq_len} (model_kwargs={dict(case.model_kwargs)!r})"
        )

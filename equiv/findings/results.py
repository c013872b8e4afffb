"""What the equivalence report's checks and searches found, as plain data: what :mod:`equiv.reporting` renders.

Nothing here measures, and nothing here imports what does (tests/test_layout.py):
the tables are pandas DataFrames whose cells are already the text the report
prints, and the rest is the numbers and reprs the report's prose names (a
search's seed, the case it ran).  :mod:`equiv.findings` fills them in.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

__all__ = [
    "FSDP2_POLICY_LABELS",
    "RANK_FAULT",
    "DistributedFindings",
    "DistributedSearchFindings",
    "EquivalenceFindings",
    "Fsdp2Findings",
    "MoeFindings",
    "SearchFindings",
    "TensorParallelFindings",
    "ZooSearchFindings",
]

#: What a distributed cell says of a rank fault (a deadlock or mismatched collectives): its table's cells and
#: the section's prose both use it.
RANK_FAULT = "a rank hung or made mismatched collectives"
#: FSDP2's gradient-sync policies (``equiv.cost.fsdp.POLICIES``, in its order) as the cost table names them.
FSDP2_POLICY_LABELS = {
    "sync_once_per_window": "sync once per window",
    "sync_every_micro_batch": "sync every micro-batch",
}


@dataclass(frozen=True)
class SearchFindings:
    """The report's own searches: the reference, the bug zoo, the inherent models."""

    seed: int
    #: cases each bug search could draw
    bug_search_examples: int
    #: one row per bug: found?, the shrunk case, how many cases it took
    bug_zoo: pd.DataFrame
    bugs_found: int
    #: cases the reference's search drew
    reference_examples: int
    reference_found: bool
    #: repr of the reference's counterexample ("None" when there is none)
    reference_counterexample: str
    #: model family x optimizer: how many drawn cases of the reference were equivalent
    equivalent_cases: pd.DataFrame
    #: models with layers no accumulation can reproduce, and the checker's verdict and reason
    inherent: pd.DataFrame


@dataclass(frozen=True)
class Fsdp2Findings:
    """FSDP2 verdicts on uneven shards, and one run's communication and memory per rank as N grows."""

    verdicts: pd.DataFrame
    costs: pd.DataFrame
    #: world size -> the samples per micro-batch, per rank, its verdicts were checked on
    shards: dict[int, list[list[int]]]
    #: repr of the case every verdict ran
    case: str
    #: the cost sweep's workload, in words, and its global batch
    workload_description: str
    workload_global_batch_size: int


#: The DeepSpeed section's shards (samples per micro-batch, per rank): one gradient_accumulation_steps for every
#: rank (the same micro-batch count), uneven shard sizes and item counts.
DEEPSPEED_SHARDS = [[1, 2, 3], [2, 1, 1]]


@dataclass(frozen=True)
class DistributedFindings:
    """DDP on 2 gloo ranks, its communication as N grows, FSDP2, and the loss-scale windows."""

    #: samples per micro-batch, per rank
    shards: list[list[int]]
    #: repr of the distributed case the verdicts ran
    case: str
    verdicts: pd.DataFrame
    communication: pd.DataFrame
    fsdp2: Fsdp2Findings
    #: repr of the loss-scale case (one overflowing sample is set per row)
    loss_scale_case: str
    loss_scale: pd.DataFrame
    #: DeepSpeed's engines (ZeRO-1 and -2) on the DeepSpeed zoo; None where DeepSpeed is not installed
    deepspeed: pd.DataFrame | None = None
    #: DeepSpeed's own collectives per step as N grows (ZeRO-1 and -2); None where DeepSpeed is not installed
    deepspeed_communication: pd.DataFrame | None = None


@dataclass(frozen=True)
class DistributedSearchFindings:
    """Every step of the distributed search zoo searched at one seed: what was found, shrunk to what."""

    table: pd.DataFrame
    examples: int
    seed: int
    #: the most ranks a case could draw (data x context under context parallelism)
    max_world_size: int = 3


@dataclass(frozen=True)
class ZooSearchFindings:
    """A single-process zoo searched with :func:`equiv.verify` at one seed: each entry's outcome and shrunk case."""

    table: pd.DataFrame
    #: the most cases each search could draw
    examples: int
    seed: int


@dataclass(frozen=True)
class TensorParallelFindings:
    """The TP zoo checked under TP and FSDP2 + TP, and searched under TP."""

    table: pd.DataFrame
    #: the search's cases and seed
    examples: int
    seed: int


@dataclass(frozen=True)
class MoeFindings:
    """Load-balancing losses under accumulation: verdicts, and why a batch-wise one is inherent."""

    table: pd.DataFrame
    #: the checker's reasons a batch-wise balance loss is inherently not equivalent
    inherent_reason: tuple[str, ...]


@dataclass(frozen=True)
class EquivalenceFindings:
    """Everything reports/equivalence.md shows.  The standard cases and the MoE
    section always; the searched and spawned sections only when measured (None otherwise)."""

    #: the checker's allowance: FLOOR_FACTOR x floor + ROUNDOFF_UNITS_PER_STEP x steps x unit roundoff x scale
    floor_factor: float
    roundoff_units_per_step: float
    #: the reference accumulator on every standard case, then the bug zoo on them, one row per (candidate, case)
    reference: pd.DataFrame
    bugs: pd.DataFrame
    #: the standard cases: name and a repr that reproduces it
    cases: pd.DataFrame
    moe: MoeFindings
    searches: SearchFindings | None = None
    distributed: DistributedFindings | None = None
    distributed_search: DistributedSearchFindings | None = None
    #: one row per step run under torchrun, one column per standard split
    torchrun: pd.DataFrame | None = None
    tensor_parallel: TensorParallelFindings | None = None
    #: one row per pipeline setting, one column per schedule
    pipeline: pd.DataFrame | None = None
    #: the context-parallel zoo searched under "cp" / "fsdp2+cp"
    context_parallel_search: DistributedSearchFindings | None = None
    #: the router aux / z-loss zoo searched on the MoE model under DDP and FSDP2
    aux_loss_search: DistributedSearchFindings | None = None
    #: the reference on every packed loss and the packed-sequence zoo, searched
    packed_search: ZooSearchFindings | None = None
    #: the reference on every RL policy loss and the normaliser zoo, searched
    policy_search: ZooSearchFindings | None = None
    #: the accumulation buffer's precision zoo, each entry for its user's training precision
    precision_search: ZooSearchFindings | None = None

"""The parallel engines, one record each: what an engine is, stated once.

An engine is how the ranks of a distributed check hold the model and the
batch: data parallel (DDP, FSDP2), tensor parallel, context parallel, their
FSDP2 compositions, and pipeline parallel.  Each :class:`Engine` says

- its name (what ``check_distributed(..., engine=...)`` takes) and how a
  verdict describes it;
- how its ranks split the work: whether it shards parameters (FSDP2), what a
  data rank's group of ranks splits (:attr:`Engine.group`: nothing, the weights
  over a tensor-parallel group, or every sequence's positions over a
  context-parallel one), and how many data ranks it runs;
- the models and the ranks per group a search may draw under it;
- its ``apply_*`` functions, run in order on the model, as torchtitan's
  ``parallelize`` composes ``apply_tp``, ``apply_cp`` and ``apply_fsdp`` (or
  ``apply_ddp``);
- the gradient collective it counts;
- for an engine that takes the optimizer too (DeepSpeed's ``initialize``), how a
  rank's model and optimizer are wrapped together (:attr:`Engine.wrap_optimizer`).

A new engine is one entry of :data:`ENGINES`: the check's rank task, its
argument checks, the verdict's wording and the search's drawing read it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.nn.parallel import DistributedDataParallel

from equiv.distributed.collectives import CollectiveCounts, CountingAllGather, CountingReduceScatter
from equiv.distributed.matching import watch_ddp
from equiv.distributed.sharding import fsdp_modules, fully_shard_layers, sum_where_premul_sum_is_missing
from equiv.distributed.tensor_parallel import parallelize, tensor_parallel_mesh
from equiv.distributed.zero_engine import WrapOptimizer, deepspeed_missing, deepspeed_wrapper

__all__ = [
    "DATA_PARALLEL_ENGINES",
    "DEFAULT_ENGINE",
    "ENGINES",
    "STEP_ENGINES",
    "Apply",
    "Engine",
    "Split",
    "Wrapping",
    "apply_ddp",
    "apply_fsdp",
    "apply_tp",
    "engine_named",
]


class Split(Protocol):
    """How a case lays its ranks out (a :class:`~equiv.checking.distributed.DistributedCase`)."""

    @property
    def data_ranks(self) -> int: ...

    @property
    def tensor_parallel(self) -> int: ...

    @property
    def context_parallel(self) -> int: ...

    @property
    def sequence_slices(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def rank_micro_batch_sizes(self) -> tuple[tuple[int, ...], ...]: ...


@dataclass
class Wrapping:
    """What the ``apply_*`` functions of one rank's engine share while they wrap its model."""

    device_type: str
    split: Split
    #: Counts the gradient collectives (DDP's all-reduces, FSDP2's reduce-scatters).
    counter: CollectiveCounts
    #: FSDP2's ``MixedPrecisionPolicy`` (None: full precision).
    mp_policy: MixedPrecisionPolicy | None = None
    #: Turns DDP's counting comm hook into the one registered (the step's low precision lifted), given the model.
    comm_hook: Callable[[Any, nn.Module], Any] = lambda hook, model: hook
    #: FSDP2 units made (``fully_shard``-ed modules with trainable parameters), set by :func:`apply_fsdp`.
    units: int = 0
    #: The (data, tensor) mesh :func:`apply_tp` laid out, which :func:`apply_fsdp` shards over after it.
    tp_mesh: DeviceMesh | None = field(default=None)


#: One step of an engine's wrapping: the model (wrapped, or changed in place) after it.
Apply = Callable[[nn.Module, Wrapping], nn.Module]


def apply_ddp(model: nn.Module, wrapping: Wrapping) -> nn.Module:
    """``DistributedDataParallel`` over every rank, its all-reduces counted by a comm hook."""
    counter = wrapping.counter
    ddp = DistributedDataParallel(
        model, device_ids=[torch.cuda.current_device()] if wrapping.device_type == "cuda" else None
    )
    # The step's own comm hook (bf16_compress_hook) is lifted with it where the check asks, to the
    # tier's dtype, which the model was cast to before it is wrapped.
    ddp.register_comm_hook(None, wrapping.comm_hook(counter.allreduce_hook, model))
    counter.chain_step_hooks(ddp)  # a step's own comm hook runs inside the counting one
    # DDP's bucket rebuild, a broadcast in C++, recorded in the collective log.
    watch_ddp(ddp, synced=lambda: counter.synced)
    return ddp


def apply_tp(model: nn.Module, wrapping: Wrapping) -> nn.Module:
    """Tensor parallel (``parallelize_module``) on the tensor-parallel dimension of a
    (data, tensor) mesh.  A position-wise model has no nn.Linear pairs to shard: it
    runs sequence-parallel instead, each TP rank a slice of every sequence, the model
    replicated and its gradients reduced over the TP group (DDP), as Megatron
    all-reduces its sequence-parallel weights' gradients over TP."""
    split = wrapping.split
    if split.sequence_slices > 1:
        return apply_ddp(model, wrapping)
    wrapping.tp_mesh = tensor_parallel_mesh(wrapping.device_type, split.data_ranks, split.tensor_parallel)
    # No gradient collective of its own to count: DTensor's are inside the forward and backward.
    return parallelize(model, wrapping.tp_mesh)


def apply_fsdp(model: nn.Module, wrapping: Wrapping) -> nn.Module:
    """FSDP2's ``fully_shard`` per layer and at the root, over the data dimension of
    :func:`apply_tp`'s mesh if it ran first, else over every rank (data x context);
    its reduce-scatters counted."""
    mesh = (
        wrapping.tp_mesh["dp"]
        if wrapping.tp_mesh is not None
        else init_device_mesh(wrapping.device_type, (wrapping.split.world_size,))
    )
    wrapping.units = fully_shard_layers(model, mesh, wrapping.mp_policy)
    # A correct step may ask for a reduce op the CPU backend lacks (PREMUL_SUM).
    sum_where_premul_sum_is_missing(model, mesh)
    for module in fsdp_modules(model):
        module.set_custom_reduce_scatter(CountingReduceScatter(wrapping.counter))
        # FSDP2's own all-gathers, told apart from the step's collectives (not reported).
        module.set_custom_all_gather(CountingAllGather(CollectiveCounts()))
    return model


@dataclass(frozen=True)
class Engine:
    """One parallel engine (see the module's docstring)."""

    name: str
    #: How a verdict's message names it, given the case's split.
    describe: Callable[[Split], str]
    #: The ``apply_*`` functions that wrap a rank's model, in order (empty: the engine does not wrap a step's model).
    apply: tuple[Apply, ...]
    #: The gradient collective counted: "all-reduce" (DDP), "reduce-scatter" (FSDP2), "engine" (every
    #: collective of the engine's own methods: DeepSpeed's ``engine.backward`` and ``engine.step``) or "none".
    collective: Literal["all-reduce", "reduce-scatter", "engine", "none"]
    #: FSDP2 shards the parameters (equal micro-batch counts on every rank, an ``mp_policy`` allowed).
    shards_parameters: bool = False
    #: What the ranks serving one data rank split: nothing ("data"), the weights over a
    #: tensor-parallel group ("tensor"), or every sequence's positions over a context-parallel one ("context").
    group: Literal["data", "tensor", "context"] = "data"
    #: Whether a position-wise model runs with each rank holding a slice of every sequence
    #: (context parallel, and tensor parallel's sequence parallelism).
    splits_sequences: bool = False
    #: Why a split of a model (its name or builder) cannot run under this engine beyond its group (None: it can).
    refuse: Callable[[Split, Any], str | None] = lambda split, model: None
    #: The search: which of its models it may draw (None: every one), and how many data ranks
    #: (at least; exactly, or None: drawn up to as many as ``max_world_size`` holds).
    search_models: tuple[str, ...] | None = None
    search_data_ranks: tuple[int, int | None] = (2, None)
    #: Ranks per tensor- or context-parallel group the search draws (1: none); the MLP's hidden
    #: width, 8, and the token model's 6 positions split evenly over 2.
    search_group_ranks: int = 1
    #: Whether :func:`equiv.check_distributed` runs a candidate step under it (the pipeline engine runs a schedule).
    runs_steps: bool = True
    #: Every rank runs the same number of micro-batches per step (FSDP2 all-gathers per forward; DeepSpeed's
    #: ``gradient_accumulation_steps`` is one number for every rank).
    equal_micro_batch_counts: bool = False
    #: Wraps a rank's model and the case's optimizer together, given the split, the rank, the case's clip
    #: norm and the counts of :attr:`collective` (None: the model alone, by :attr:`apply`): the step is
    #: handed what it returns.
    wrap_optimizer: Callable[[Split, int, float | None, CollectiveCounts], WrapOptimizer] | None = None

    @property
    def collectives_counted(self) -> str:
        """What a verdict calls the counted collectives, e.g. "gradient all-reduces"."""
        if self.collective == "engine":
            return "collectives of engine.backward and engine.step (its gradient reductions, its step's)"
        return f"gradient {self.collective}s"

    @property
    def same_micro_batch_counts(self) -> bool:
        """Whether every rank must run the same number of micro-batches per step."""
        return self.shards_parameters or self.equal_micro_batch_counts


def _tp_refuse(split: Split, model: Any) -> str | None:
    if split.data_ranks != 1:
        return (
            "engine='tp' runs one data rank (every TP rank sees the same micro-batches), got "
            f"{split.data_ranks} data ranks {[list(s) for s in split.rank_micro_batch_sizes]}; use engine='fsdp2+tp' to shard the data as well"
        )
    return None


def _fsdp2_tp_refuse(split: Split, model: Any) -> str | None:
    if split.sequence_slices > 1:
        return (
            f"engine='fsdp2+tp' shards nn.Linear pairs; model={model!r} is split by "
            "positions, which runs sequence-parallel under engine='tp' (one data rank) or under "
            "engine='fsdp2+cp' with several"
        )
    if split.data_ranks < 2:
        return (
            f"engine='fsdp2+tp' needs at least 2 data ranks for FSDP2 to shard over, got {split.data_ranks}; "
            "use engine='tp' for one"
        )
    return None


def _tp_describe(split: Split) -> str:
    if split.sequence_slices == 1:
        return f"tensor parallel ({split.tensor_parallel} ranks, parallelize_module)"
    return (
        f"sequence parallel ({split.tensor_parallel} TP ranks, each a slice of every sequence, "
        "DistributedDataParallel over them)"
    )


def _zero(stage: int, split: Split, rank: int, max_grad_norm: float | None, counts: CollectiveCounts) -> WrapOptimizer:
    """A DeepSpeed engine at ZeRO ``stage`` for ``rank``: its micro-batch count is the config's
    ``gradient_accumulation_steps``, the case's clip norm its ``gradient_clipping`` (a module-level
    function, bound with functools.partial: the check's task is pickled to its ranks)."""
    sizes = split.rank_micro_batch_sizes[rank]
    return deepspeed_wrapper(stage, len(sizes), max(sizes), max_grad_norm, counts)


def _deepspeed(name: str, stage: int) -> Engine:
    """The DeepSpeed engine ``name`` at ZeRO ``stage`` (1 or 2; see :mod:`equiv.distributed.zero_engine`)."""
    return Engine(
        name,
        lambda split: f"DeepSpeed ZeRO-{stage} (deepspeed.initialize, gradient_accumulation_steps per rank)",
        (),
        # DeepSpeed's reductions go through its own communication layer: engine.backward's and engine.step's counted.
        "engine",
        refuse=lambda split, model: deepspeed_missing(name),
        search_models=("mlp", "tokens"),
        equal_micro_batch_counts=True,
        wrap_optimizer=functools.partial(_zero, stage),
    )


def _pipeline_describe(split: Split) -> str:
    return f"pipeline parallel ({split.world_size} ranks, torch.distributed.pipelining)"


#: Every engine, by name, in the order they are listed to users.
ENGINES: Mapping[str, Engine] = {
    engine.name: engine
    for engine in (
        Engine("ddp", lambda split: "DistributedDataParallel", (apply_ddp,), "all-reduce"),
        Engine("fsdp2", lambda split: "FSDP2 (fully_shard)", (apply_fsdp,), "reduce-scatter", shards_parameters=True),
        Engine(
            "tp",
            _tp_describe,
            (apply_tp,),
            "none",
            group="tensor",
            splits_sequences=True,
            refuse=_tp_refuse,
            # the MLP (its nn.Linear pairs sharded), and "moe" as the token-level MoE run sequence-parallel
            search_models=("mlp", "moe"),
            search_data_ranks=(1, 1),
            search_group_ranks=2,
        ),
        Engine(
            "fsdp2+tp",
            lambda split: f"FSDP2 over tensor parallel ({split.data_ranks} x {split.tensor_parallel} mesh)",
            (apply_tp, apply_fsdp),
            "reduce-scatter",
            shards_parameters=True,
            group="tensor",
            refuse=_fsdp2_tp_refuse,
            # the tensor-parallel plan shards nn.Linear pairs (not the token model's embedding)
            search_models=("mlp",),
            search_data_ranks=(2, None),
            search_group_ranks=2,
        ),
        Engine(
            "cp",
            lambda split: (
                f"context parallel ({split.data_ranks} data x {split.context_parallel} sequence "
                "slices, DistributedDataParallel over all)"
            ),
            (apply_ddp,),
            "all-reduce",
            group="context",
            splits_sequences=True,
            # position-wise models: the token model, and "moe" as the token-level MoE
            search_models=("tokens", "moe"),
            search_data_ranks=(1, None),
            search_group_ranks=2,
        ),
        Engine(
            "fsdp2+cp",
            lambda split: (
                f"context parallel ({split.data_ranks} data x {split.context_parallel} sequence slices, FSDP2 over all)"
            ),
            (apply_fsdp,),
            "reduce-scatter",
            shards_parameters=True,
            group="context",
            splits_sequences=True,
            search_models=("tokens", "moe"),
            search_data_ranks=(1, None),
            search_group_ranks=2,
        ),
        # DeepSpeed's engine, which accumulates itself (engine.backward divides by gradient_accumulation_steps).
        _deepspeed("deepspeed", 2),
        _deepspeed("deepspeed-zero1", 1),
        # Stages on ranks, activations sent between them: equiv.checking.pipeline runs torch's schedules itself.
        Engine("pipeline", _pipeline_describe, (), "none", runs_steps=False),
    )
}
#: The engines :func:`equiv.check_distributed` runs a step under (and a search may draw).
STEP_ENGINES: tuple[str, ...] = tuple(name for name, engine in ENGINES.items() if engine.runs_steps)
#: The step engines whose ranks each hold whole samples and whole weights' gradients to sync (no
#: tensor- or context-parallel group): those ``equiv check-distributed``'s standard splits run under.
DATA_PARALLEL_ENGINES: tuple[str, ...] = tuple(name for name in STEP_ENGINES if ENGINES[name].group == "data")


#: The engine :func:`equiv.check_distributed` runs when given none (a Reproduce line leaves it out).
DEFAULT_ENGINE = "ddp"


def engine_named(name: str) -> Engine:
    """The step engine called ``name``; a ValueError naming the step engines for any other."""
    record = ENGINES.get(name)
    if record is None or not record.runs_steps:
        raise ValueError(f"engine must be one of {STEP_ENGINES}, got {name!r}")
    return record

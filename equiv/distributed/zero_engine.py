"""A rank's model and optimizer as a DeepSpeed engine at ZeRO stage 1 or 2 (``check_distributed(engine="deepspeed")``).

:func:`deepspeed_wrapper` returns what :func:`equiv.judging.runs.run_candidate`'s
``wrap_optimizer`` takes: given the case's model and its torch optimizer, the
``deepspeed.initialize(...)`` engine a step is handed (its ZeRO optimizer beside it)
and the optimizer a snapshot reads (:class:`ZeroStateView`).  The config is the one a
DeepSpeed user writes for the case: ``gradient_accumulation_steps`` = the rank's
micro-batch count, ``zero_optimization.stage``, ``gradient_clipping`` = the case's
clip norm (0: none; DeepSpeed's default is 1.0), no fp16/bf16, the case's optimizer
handed as ``optimizer=`` (DeepSpeed wraps a client torch optimizer in ZeRO).  A case naming DeepSpeed's own Muon
(:func:`equiv.distributed.deepspeed.deepspeed_muon`) is given to DeepSpeed as its users give it: the config's
``{"type": "Muon", "params": ...}`` with the case's hyperparameters, every parameter tagged ``use_muon``.

The float64 tier: ZeRO keeps float32 master weights, accumulates gradients in float32
and reduces them in float32 whatever the model's dtype (``DeepSpeedZeroOptimizer``'s
``_configure_master_weights``, ``gradient_accumulation_dtype`` and
``communication_data_type``).  That is DeepSpeed's precision, not its accumulation
rule, so with a float64 model the three are lifted to float64 (as the check lifts a
step's own bfloat16), and the float64 run is DeepSpeed's mathematics in float64.
The float32 tier runs DeepSpeed as it is.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from equiv.distributed.collectives import CollectiveCounts
from equiv.distributed.deepspeed import ZeroLayout, deepspeed_muon

__all__ = ["DEEPSPEED_MISSING", "ZeroStateView", "deepspeed_missing", "deepspeed_wrapper"]

#: The one line a check under a DeepSpeed engine refuses with when DeepSpeed is not installed.
DEEPSPEED_MISSING = "engine={engine!r} needs DeepSpeed: pip install 'equiv[deepspeed]'"

#: What :func:`deepspeed_wrapper` returns: (model, optimizer) -> (the engine, its optimizer, the snapshots' optimizer).
WrapOptimizer = Callable[[nn.Module, torch.optim.Optimizer], tuple[nn.Module, Any, Any]]


def deepspeed_missing(engine: str) -> str | None:
    """Why ``engine`` cannot run here (DeepSpeed is not installed), or None."""
    return DEEPSPEED_MISSING.format(engine=engine) if importlib.util.find_spec("deepspeed") is None else None


def deepspeed_wrapper(
    stage: int, micro_batches: int, micro_batch_size: int, max_grad_norm: float | None, counts: CollectiveCounts
) -> WrapOptimizer:
    """The ``wrap_optimizer`` of one rank at ZeRO ``stage`` with ``micro_batches`` micro-batches per step; every
    collective the engine's ``backward`` and ``step`` make (its gradient reductions, its step's) counted in
    ``counts``, none as the step's own."""

    def wrap(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[nn.Module, Any, Any]:
        config = {
            "train_micro_batch_size_per_gpu": micro_batch_size,
            "gradient_accumulation_steps": micro_batches,
            "zero_optimization": {"stage": stage},
            "gradient_clipping": 0.0 if max_grad_norm is None else max_grad_norm,
            # torch's optimizers are "untested" under ZeRO by DeepSpeed's list; the client optimizer is the case's.
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 2**31 - 1,
        }
        deepspeed = _imported()
        dtype = next(model.parameters()).dtype
        client: dict[str, Any] = {"optimizer": optimizer}
        if isinstance(optimizer, deepspeed_muon()):
            # DeepSpeed's Muon is built by its engine from the config, the parameters tagged use_muon by the case's.
            (group,) = optimizer.param_groups
            muon = {key: group[key] for key in ("lr", "momentum", "weight_decay", "ns_method")}
            config["optimizer"] = {"type": "Muon", "params": muon}
            client = {"model_parameters": list(model.parameters())}
        with _lifted_to(dtype):
            engine, zero, _, _ = deepspeed.initialize(model=model, config=config, **client)
        # deepspeed.comm calls torch.distributed: no comm hook to count at, so the engine's own methods are.
        engine.backward = counts.counting(engine.backward)
        engine.step = counts.counting(engine.step)
        return engine, zero, ZeroStateView(model, zero)

    return wrap


def _imported() -> Any:
    """DeepSpeed, imported on the CPU accelerator where no GPU is visible, its logging kept to warnings."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    # DeepSpeed reads LOCAL_RANK (torchrun sets it); the check's spawned ranks are one machine's.
    os.environ.setdefault("LOCAL_RANK", str(dist.get_rank()))
    import deepspeed

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    return deepspeed


@contextlib.contextmanager
def _lifted_to(dtype: torch.dtype) -> Iterator[None]:
    """ZeRO's float32 master weights, accumulation and reduction lifted to float64 while
    an engine of a float64 model is made (see the module); nothing changed otherwise."""
    if dtype != torch.float64:
        yield
        return
    from deepspeed.runtime.zero import stage_1_and_2

    cls = stage_1_and_2.DeepSpeedZeroOptimizer
    init, master = cls.__init__, cls._configure_master_weights

    def master_weights(self: Any, *args: Any, **kwargs: Any) -> torch.dtype:
        chosen = master(self, *args, **kwargs)
        return dtype if chosen == torch.float32 else chosen

    def lifted_init(self: Any, *args: Any, **kwargs: Any) -> None:
        kwargs["gradient_accumulation_dtype"] = dtype
        init(self, *args, **kwargs)
        # ZeRO-2's reduce-scatter refuses float64 at construction; its buckets are empty until the first backward.
        self.communication_data_type = dtype
        self.ipg_buckets = {dtype: stage_1_and_2.IPGBucket()}
        self._release_ipg_buffers()

    cls.__init__, cls._configure_master_weights = lifted_init, master_weights
    try:
        yield
    finally:
        cls.__init__, cls._configure_master_weights = init, master


class ZeroStateView:
    """The optimizer a snapshot reads under ZeRO-1/2: the client optimizer's state, which
    ZeRO keys by this rank's flat float32 partition of each parameter group, gathered
    from every rank and cut back into the model's parameters (a collective, not counted
    as the step's: every rank snapshots at the same points).  Its ``state`` is keyed by
    the model's parameters, as a torch optimizer's is."""

    def __init__(self, model: nn.Module, zero: Any) -> None:
        self.model, self.zero = model, zero
        #: where each parameter sits in the flat buffers (DeepSpeed's own layout, its alignment padding included)
        self.layout = ZeroLayout(zero, model)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [{"params": list(params)} for params in self.zero.round_robin_bit16_groups]

    @property
    def state(self) -> dict[Tensor, dict[str, Any]]:
        inner = self.zero.optimizer
        named = dict(self.model.named_parameters())
        out: dict[Tensor, dict[str, Any]] = {}
        group = self.zero.dp_process_group
        for index, placed in enumerate(self.layout.groups):
            partition = self.zero.single_partition_of_fp32_groups[index]
            held = inner.state.get(partition, {})
            # DeepSpeed's Muon keeps its momentum for whole matrices, not the partition (a client SGD's is flat)
            if inner.param_groups[index].get("use_muon", False) and "momentum_buffer" in held:
                for name, value in self._muon_momentum(index, held["momentum_buffer"]).items():
                    out.setdefault(named[name], {})["momentum_buffer"] = value
                continue
            for key in sorted(held):
                value = held[key]
                if not isinstance(value, Tensor) or value.numel() == 1:  # a step count: the same for every parameter
                    for name, _, _ in placed.params:
                        out.setdefault(named[name], {})[key] = value
                    continue
                flat = _gathered(value.detach().reshape(-1), group)  # the whole flat buffer, padding included
                for name, offset, shape in placed.params:
                    out.setdefault(named[name], {})[key] = flat[offset : offset + shape.numel()].view(shape)
        return out

    def _muon_momentum(self, index: int, flat: Tensor) -> dict[str, Tensor]:
        """DeepSpeed's Muon momentum of group ``index`` by parameter name: each rank holds it for the whole
        parameters its partition touches (``params_in_partition``, end to end, as ``_muon_momentum_buffer``
        lays them), gathered from every rank (a collective, not counted as the step's)."""
        names = {id(param): name for name, param in self.model.named_parameters()}
        mine: dict[str, Tensor] = {}
        offset = 0
        for param in self.zero.params_in_partition[index]:
            mine[names[id(param)]] = flat[offset : offset + param.numel()].detach().view(param.shape).clone()
            offset += param.numel()
        group = self.zero.dp_process_group
        every: list[Any] = [None] * dist.get_world_size(group)
        CollectiveCounts().run(dist.all_gather_object, every, mine, group=group)  # type: ignore[arg-type]
        return {name: value for held in every for name, value in held.items()}


def _gathered(partition: Tensor, group: Any) -> Tensor:
    """Every rank's equal-sized flat partition, in rank order (the flat buffer, padding at its end)."""
    world = dist.get_world_size(group)
    out = torch.empty(world * partition.numel(), dtype=partition.dtype, device=partition.device)
    # run(): inside a gradient-sync scope, so the step's own collectives do not count it.
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    CollectiveCounts().run(all_gather, out, partition.contiguous(), group=group)
    return out

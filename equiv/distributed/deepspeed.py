"""DeepSpeed as equiv reads it: the engine's settings, its optimizers' torch equivalents, and the flat
partitions ZeRO stages 1 and 2 step.

DeepSpeed accumulates by itself (``deepspeed/runtime/engine.py``, DeepSpeed 0.19): ``engine.backward(loss)``
divides the loss by ``gradient_accumulation_steps`` (its ``scale_wrt_gas=True``; a plain ``loss.backward()`` on
the engine's output is scaled the same way by the hooks its forward registers), the gradients are averaged over
the data-parallel ranks, clipped on their global norm by the config's ``gradient_clipping``, and stepped at the
accumulation boundary.  At ZeRO 1 and 2 every rank still holds the whole model, but its optimizer steps one flat
fp32 partition per parameter group: the group's parameters laid end to end in one buffer (with DeepSpeed's
alignment padding), cut into one contiguous slice per rank.  :class:`ZeroLayout` reads that layout from the
engine's own tensors (where each parameter's data sits in the flat buffer), so a float64 gradient of the whole
model can be cut into this rank's partition exactly as DeepSpeed cuts its own.

DeepSpeed's own Muon (its config's optimizer ``{"type": "Muon"}``, ``MuonWithAuxAdam``) is a case's optimizer by
the name :data:`DEEPSPEED_MUON` (:func:`deepspeed_muon`): under ZeRO-1/2 the engine orthogonalises each matrix's
whole reduced gradient where it fills a partition (``get_flat_partition``), and on whole weights (one process, DDP)
its own ``step`` does: the same update, so the single process's is the truth a ZeRO run is judged against.
torch.optim.Muon is not that truth: its Newton-Schulz iteration runs in bfloat16 where DeepSpeed's default
("gram") runs in float16 or float32, which alone moves the update by 2-5% (measured on a bias-free MLP, DeepSpeed 0.19.8).

Nothing here imports DeepSpeed at module level: an engine or optimizer is recognised by its class's name and
module, so equiv runs without DeepSpeed installed.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

__all__ = [
    "DEEPSPEED_MUON",
    "EngineSettings",
    "ZeroLayout",
    "deepspeed_muon",
    "engine_of",
    "engine_settings",
    "is_deepspeed_engine",
    "is_zero_optimizer",
    "kernel_hyperparameters",
    "torch_equivalent",
    "torch_state",
    "torch_state_dict",
]

#: The name a case gives DeepSpeed's own Muon (:func:`deepspeed_muon`).
DEEPSPEED_MUON = "DeepSpeedMuon"

#: DeepSpeed's ZeRO 1 and 2 optimizer (``deepspeed.runtime.zero.stage_1_and_2``); stage 3's is another class.
_ZERO_1_2 = "DeepSpeedZeroOptimizer"
_ZERO_3 = "DeepSpeedZeroOptimizer_Stage3"


def _classes(value: Any) -> list[tuple[str, str]]:
    """(module, name) of every class in ``value``'s MRO."""
    return [(cls.__module__, cls.__name__) for cls in type(value).__mro__]


def _from_deepspeed(value: Any, name: str) -> bool:
    return any(module.startswith("deepspeed.") and found == name for module, found in _classes(value))


def is_deepspeed_engine(value: Any) -> bool:
    """Whether ``value`` is a DeepSpeed engine (``deepspeed.initialize``'s first result, or a subclass)."""
    return _from_deepspeed(value, "DeepSpeedEngine")


def is_zero_optimizer(value: Any) -> int:
    """The ZeRO stage of a DeepSpeed ZeRO optimizer (1 or 2 for ``DeepSpeedZeroOptimizer``, which serves
    both; 3 for stage 3's), else 0."""
    if _from_deepspeed(value, _ZERO_3):
        return 3
    if _from_deepspeed(value, _ZERO_1_2):
        return 2 if getattr(value, "partition_gradients", False) else 1
    return 0


@dataclass(frozen=True, slots=True)
class EngineSettings:
    """What a DeepSpeed engine's config decides about accumulation, read from the engine itself."""

    zero_stage: int
    gradient_accumulation_steps: int
    #: the global gradient norm the engine clips to (0: none)
    gradient_clipping: float
    bf16: bool
    fp16: bool
    #: the data-parallel ranks the engine averages gradients over
    data_parallel: int
    optimizer: str

    def said(self) -> str:
        """One line: what was read (the audit says it once when it starts)."""
        precision = "bf16" if self.bf16 else "fp16" if self.fp16 else "fp32"
        clip = f"gradient_clipping={self.gradient_clipping:g}" if self.gradient_clipping else "no gradient_clipping"
        return (
            f"DeepSpeed engine: ZeRO stage {self.zero_stage}, gradient_accumulation_steps="
            f"{self.gradient_accumulation_steps} (engine.backward divides each micro-batch's loss by it: "
            f"scale_wrt_gas), gradients averaged over {self.data_parallel} data-parallel rank"
            f"{'s' if self.data_parallel != 1 else ''}, {clip}, {precision}, optimizer {self.optimizer}"
        )


def engine_settings(engine: Any) -> EngineSettings:
    """The settings of DeepSpeed ``engine`` (its config as the engine applies it)."""
    optimizer = getattr(engine, "optimizer", None)
    inner = getattr(optimizer, "optimizer", None) if is_zero_optimizer(optimizer) else optimizer
    return EngineSettings(
        zero_stage=int(engine.zero_optimization_stage()),
        gradient_accumulation_steps=int(engine.gradient_accumulation_steps()),
        gradient_clipping=float(engine.gradient_clipping() or 0.0),
        bf16=bool(engine.bfloat16_enabled()),
        fp16=bool(engine.fp16_enabled()),
        data_parallel=int(getattr(engine, "dp_world_size", 1) or 1),
        optimizer=type(inner).__name__ if inner is not None else "none",
    )


#: DeepSpeed's Adam family: (class name, the attribute holding its AdamW switch).
_ADAMS = {"FusedAdam": "adam_w_mode", "DeepSpeedCPUAdam": "adam_w_mode"}


def torch_equivalent(optimizer: torch.optim.Optimizer) -> tuple[type[torch.optim.Optimizer], dict[str, Any]] | None:
    """The torch optimizer that steps as DeepSpeed's ``optimizer`` does, with its hyperparameters, for a float64
    replay (DeepSpeed's own kernels take fp16, bf16 and fp32 only): ``FusedAdam`` and ``DeepSpeedCPUAdam`` are
    ``torch.optim.AdamW`` in their AdamW mode (the default) and ``torch.optim.Adam`` (L2 weight decay) outside
    it, the same update (apex's: decoupled decay ``p -= lr * wd * p``, bias-corrected moments, ``eps`` added to
    the root).  None for an optimizer that is not DeepSpeed's (replayed as itself).

    Raises:
        ValueError: a DeepSpeed optimizer with no torch equivalent (named), or one set where torch's differs
            (``bias_correction=False``: torch's Adam always corrects).
    """
    if not type(optimizer).__module__.startswith("deepspeed."):
        return None
    name = type(optimizer).__name__
    switch = _ADAMS.get(name)
    if name == "MuonWithAuxAdam":
        # Muon's update is a function of each whole matrix, which a replay of this rank's partitions cannot hold.
        raise ValueError(
            "equiv's audit replays this rank's ZeRO partitions, and DeepSpeed's Muon (MuonWithAuxAdam) updates "
            "each whole matrix: judge its accumulation with equiv.check_distributed(step, dcase, "
            f"engine='deepspeed' or 'deepspeed-zero1'), the case's optimizer={DEEPSPEED_MUON!r}"
        )
    if switch is None:
        raise ValueError(
            f"equiv replays DeepSpeed's FusedAdam and DeepSpeedCPUAdam as torch's AdamW / Adam; {name} has no torch "
            "equivalent it replays: audit the run with a torch optimizer (torch.optim.AdamW, passed to "
            "deepspeed.initialize(optimizer=...) or as the config's optimizer type with torch_adam: true)"
        )
    uncorrected = [
        index for index, group in enumerate(optimizer.param_groups) if not group.get("bias_correction", True)
    ]
    if uncorrected:
        raise ValueError(
            f"{name} with bias_correction=False (param group {uncorrected[0]}) has no torch equivalent: torch's "
            "Adam and AdamW always correct the moments' bias"
        )
    decoupled = bool(getattr(optimizer, switch, True))
    return (torch.optim.AdamW if decoupled else torch.optim.Adam), kernel_hyperparameters(optimizer.defaults)


def _float32(value: Any) -> Any:
    if isinstance(value, (tuple, list)):
        return type(value)(_float32(item) for item in value)
    return float(torch.tensor(float(value), dtype=torch.float32))


def kernel_hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    """A DeepSpeed Adam group's hyperparameters as its kernels take them: C++ ``float`` arguments
    (``deepspeed/ops/csrc/includes/cpu_adam.h``, ``fused_adam.cpp``), so ``beta2=0.999`` steps as
    ``float32(0.999)``: ``1 - beta2`` then differs from 0.001 by 1.3e-5 of itself, which the optimizer's second
    moment carries on every step.  The torch equivalent is given these same values, so the float64 replay steps
    the optimizer DeepSpeed runs, not a rounding of its hyperparameters."""
    return {key: _float32(group[key]) for key in _HYPERPARAMETERS if key in group}


def torch_state(optimizer: torch.optim.Optimizer) -> dict[Tensor, dict[str, Any]]:
    """``optimizer``'s per-parameter state as its torch equivalent keeps it: DeepSpeed's Adams count their steps
    once per group (FusedAdam advances only the last parameter's ``state["step"]`` and steps every one of the
    group with it), torch per parameter, as a float32 tensor; a torch optimizer's state as it is."""
    if torch_equivalent(optimizer) is None:
        return dict(optimizer.state)
    converted: dict[Tensor, dict[str, Any]] = {}
    for group in optimizer.param_groups:
        held = [optimizer.state[param] for param in group["params"] if optimizer.state.get(param)]
        step = max((float(state.get("step", 0)) for state in held), default=0.0)
        for param in group["params"]:
            state = optimizer.state.get(param)
            if state:
                converted[param] = {**state, "step": torch.tensor(step, dtype=torch.float32)}
    return converted


#: The hyperparameters a DeepSpeed Adam's param group shares with its torch equivalent's.
_HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay")


def torch_state_dict(saved: dict[str, Any], equivalent: torch.optim.Optimizer) -> dict[str, Any]:
    """A DeepSpeed Adam's ``state_dict()`` (``saved``) as ``equivalent``, its torch equivalent over the same
    parameters, loads it: each group's step count given to every parameter of it (:func:`torch_state`), and the
    torch optimizer's own group settings kept (loading DeepSpeed's groups as they are would drop AdamW's
    ``decoupled_weight_decay``) with DeepSpeed's hyperparameters."""
    groups = [
        {**ours, **kernel_hyperparameters(theirs)}
        for ours, theirs in zip(equivalent.state_dict()["param_groups"], saved["param_groups"], strict=True)
    ]
    state: dict[Any, dict[str, Any]] = {}
    for group in saved["param_groups"]:
        held = [saved["state"][index] for index in group["params"] if saved["state"].get(index)]
        step = max((float(entry.get("step", 0)) for entry in held), default=0.0)
        for index in group["params"]:
            if saved["state"].get(index):
                state[index] = {**saved["state"][index], "step": torch.tensor(step, dtype=torch.float32)}
    return {"state": state, "param_groups": groups}


def engine_of(module: nn.Module) -> Any:
    """The DeepSpeed engine training ``module`` (its ``.module``), found among what refers to the module (the
    engine's ``_modules`` dict); None when DeepSpeed is not imported or no engine holds it.  Users hand the audit
    ``engine.module`` and ``engine.optimizer``; the engine's config (its clipping, its accumulation steps) is read
    from the engine itself."""
    import gc
    import sys

    if "deepspeed" not in sys.modules:
        return None
    for holder in gc.get_referrers(module):
        if not isinstance(holder, dict):
            continue
        for owner in gc.get_referrers(holder):
            if is_deepspeed_engine(owner) and getattr(owner, "module", None) is module:
                return owner
    return None


@dataclass(frozen=True, slots=True)
class _Group:
    #: each parameter's name, offset in the group's flat buffer and shape, in the flat buffer's order
    params: tuple[tuple[str, int, torch.Size], ...]
    #: the flat buffer's length (the parameters, DeepSpeed's alignment padding between and after them)
    numel: int
    #: this rank's slice of the flat buffer: (start, length)
    partition: tuple[int, int]


class ZeroLayout:
    """Where ZeRO 1/2 put each parameter in its groups' flat buffers, and which slice of each is this rank's
    partition, read from the optimizer's own tensors (never recomputed from DeepSpeed's padding rules)."""

    def __init__(self, zero: Any, model: nn.Module) -> None:
        names = {id(param): name for name, param in model.named_parameters()}
        groups = []
        rank = None
        for index, flat in enumerate(zero.bit16_groups_flat):
            partitions = zero.parallel_partitioned_bit16_groups[index]
            rank = _partition_rank(zero, index)
            size = flat.element_size()
            placed = []
            for param in zero.bit16_groups[index]:
                if id(param) not in names:
                    raise ValueError(
                        f"DeepSpeed's ZeRO optimizer steps a parameter of shape {tuple(param.shape)} that is not "
                        f"the audited model's: audit engine.module (the model the engine trains)"
                    )
                offset = (param.data_ptr() - flat.data_ptr()) // size
                if not 0 <= offset <= flat.numel() - param.numel():
                    raise ValueError(
                        f"parameter {names[id(param)]!r} does not sit in ZeRO's flat buffer of group {index}: the "
                        "layout DeepSpeed keeps is not the one equiv reads (DeepSpeed 0.19's stage_1_and_2)"
                    )
                placed.append((names[id(param)], offset, param.shape))
            mine = partitions[rank]
            start = (mine.data_ptr() - flat.data_ptr()) // size
            groups.append(_Group(tuple(placed), flat.numel(), (start, mine.numel())))
        #: this rank's place among the data-parallel ranks
        self.rank = 0 if rank is None else rank
        self.groups: tuple[_Group, ...] = tuple(groups)

    def names(self) -> tuple[str, ...]:
        """A name per group's partition (how a verdict names the tensors compared)."""
        return tuple(f"zero_partition[group {index}, rank {self.rank}]" for index in range(len(self.groups)))

    def partitions(self, values: dict[str, Tensor], dtype: torch.dtype | None = None) -> list[Tensor]:
        """This rank's partition of each group's flat buffer, filled with ``values`` (per parameter name, a tensor
        of that parameter's shape, or missing: zeros) and zeros where DeepSpeed pads."""
        out = []
        for group in self.groups:
            some = next((values[name] for name, _, _ in group.params if name in values), None)
            kind = dtype or (some.dtype if some is not None else torch.float32)
            device = some.device if some is not None else torch.device("cpu")
            flat = torch.zeros(group.numel, dtype=kind, device=device)
            for name, offset, shape in group.params:
                value = values.get(name)
                if value is not None:
                    flat[offset : offset + shape.numel()] = value.detach().reshape(-1).to(kind)
            start, length = group.partition
            out.append(flat[start : start + length].clone())
        return out


def _partition_rank(zero: Any, index: int) -> int:
    import torch.distributed as dist

    group = zero.real_dp_process_group[index]
    return int(dist.get_rank(group=group)) if dist.is_initialized() else 0


@functools.cache
def deepspeed_muon() -> type[torch.optim.Optimizer]:
    """DeepSpeed's Muon as a case's optimizer (:data:`DEEPSPEED_MUON`): ``MuonWithAuxAdam`` with every parameter a
    matrix, tagged ``use_muon`` and in one Muon group, as DeepSpeed's engine builds it from a config
    ``{"type": "Muon", "params": {"lr", "momentum", "weight_decay", "ns_method"}}`` for such a model (its defaults:
    0.02, 0.95, 0, "gram").  On whole weights its ``step`` runs ``muon_update`` itself.  ImportError without
    DeepSpeed."""
    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam

    class DeepSpeedMuon(MuonWithAuxAdam):
        """DeepSpeed's ``MuonWithAuxAdam``, every parameter in its Muon group (see :func:`deepspeed_muon`)."""

        def __init__(
            self,
            params: Any,
            lr: float = 0.02,
            momentum: float = 0.95,
            weight_decay: float = 0.0,
            ns_method: str = "gram",
        ) -> None:
            params = list(params)
            if any(isinstance(param, dict) for param in params):
                raise ValueError(f"{DEEPSPEED_MUON} takes the parameters themselves (one Muon group), not groups")
            flat = [tuple(param.shape) for param in params if param.dim() < 2]
            if flat:
                raise ValueError(
                    f"{DEEPSPEED_MUON} orthogonalises matrices; got parameters of shapes {flat} "
                    "(DeepSpeed steps those with its auxiliary Adam, which a case does not configure)"
                )
            for param in params:
                param.use_muon = True  # what DeepSpeed's engine reads to put a parameter in the Muon half
            group = {"lr": lr, "momentum": momentum, "weight_decay": weight_decay, "ns_method": ns_method}
            super().__init__([{"params": params, "use_muon": True, **group}])

    return DeepSpeedMuon

"""A :class:`Case`: everything needed to reproduce one check deterministically.

One case, one report row: ``Case.to_dict()`` holds only plain values, and
``Case.from_dict`` rebuilds it.  Building the pieces a run needs (model,
batches, optimizer) lives here too, so every run of a case starts from the
same bits whatever dtype it computes in.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

import torch
from torch import Tensor, nn

from equiv.cases import packed as _packed  # noqa: F401  (registers the "packed_lm" family)
from equiv.cases import policy as _policy  # noqa: F401  (registers the "policy" family)
from equiv.cases.models import MODELS, ModelBundle, ModelFactory, build_model
from equiv.cases.validation import (
    EXTERNAL_OPTIMIZERS,
    UNSUPPORTED_OPTIMIZERS,
    InvalidCase,
    _check_frozen_layers,
    _check_import_allowed,
    _check_loss,
    _check_micro_batches,
    _check_optimizer,
    _check_optimizer_kwargs,
    _check_scheduler,
    _check_target,
    _did_you_mean,
    _optimizer_names,
    _scheduler_names,
    check_device,
)
from equiv.cases.validation import optimizer_class as optimizer_class_named
from equiv.losses import LOSSES, Loss, build_loss
from equiv.names import reference, resolve

__all__ = [
    "COMPOSITE_SCHEDULERS",
    "DATA",
    "DTYPES",
    "HEAD_LR_BODY_FACTOR",
    "PARAM_GROUPS",
    "UNSUPPORTED_OPTIMIZERS",
    "Case",
    "InvalidCase",
    "check_device",
]

DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

#: How a case's batches are drawn: "random" from the seed, or "toy_2x"
#: (x = 1..B, y = 2x, the same every step; for ``scalar_linear``).
DATA = ("random", "toy_2x")

#: A user's own data: ``(step, batch_size, generator) -> (inputs, targets)``,
#: one full batch per optimizer step, drawn from the seeded CPU ``generator``.
DataFactory = Callable[[int, int, torch.Generator], tuple[Tensor, Tensor]]

#: Optimizer parameter-group recipes a case may name (``Case.param_groups``),
#: each two groups as training recipes build them:
#:
#: - "no_decay": tensors of 2+ dims (weights, embeddings) with the case's
#:   ``weight_decay``; biases and norm weights (fewer dims) with none (nanoGPT's
#:   ``configure_optimizers``, the Hugging Face Trainer's decay split).
#: - "head_lr": the last layer (the head) at the case's ``lr``, every other layer
#:   at ``HEAD_LR_BODY_FACTOR`` times it (fine-tuning with discriminative
#:   learning rates); one weight decay.
#: - "parked": the first layer in a group at ``lr = 0`` whose parameters still
#:   require grad (a layer parked by the schedule, or warmed up later): no update,
#:   but its gradient still counts in the full-batch gradient norm that clipping uses.
PARAM_GROUPS: dict[str, str] = {
    "no_decay": "biases and norm weights without weight decay",
    "head_lr": "the head at lr, the body at a tenth of it",
    "parked": "the first layer at lr = 0, still requiring grad; the rest at lr",
}
#: The body's lr under the "head_lr" recipe, as a factor of the case's lr.
HEAD_LR_BODY_FACTOR = 0.1

#: LR schedulers made of other schedulers.  Their ``schedulers`` keyword lists
#: ``[name, kwargs]`` pairs (plain values, so a case stays JSON), each built on
#: the case's optimizer before the composite is: ``scheduler="SequentialLR",
#: scheduler_kwargs={"schedulers": [["LinearLR", {...}], ["CosineAnnealingLR",
#: {...}]], "milestones": [2]}`` (warm-up, then cosine decay).
COMPOSITE_SCHEDULERS: tuple[str, ...] = ("ChainedScheduler", "SequentialLR")


@dataclass(frozen=True, kw_only=True, slots=True)
class Case:
    """One reproducible accumulation check.

    ``micro_batch_sizes`` cuts each step's batch of ``batch_size`` samples into
    consecutive micro-batches, in order; uneven sizes are the point.
    """

    batch_size: int
    micro_batch_sizes: tuple[int, ...]
    #: A family registered with ``register_model``, or your own model without a
    #: registry entry: a factory (a callable, or its ``"module:attribute"`` import
    #: path, which replays in another process) returning an ``nn.Module`` or a
    #: ``ModelBundle``, called with ``model_kwargs`` under the case's seed.
    model: str | ModelFactory = "mlp"
    model_kwargs: Mapping[str, Any] = field(default_factory=dict)
    #: Freeze (``requires_grad=False``) layers (modules that own parameters, in
    #: order) when the model is built, as fine-tuning does: an int k >= 0, the
    #: first k (a frozen bottom); an int -k, all but the last k (a frozen base
    #: with a trainable head); or a tuple of layer indices, negative from the end
    #: (``(1,)`` a middle layer with trainable layers below it, ``(-1,)`` the head).
    #: They stay in the optimizer, with no gradient: the full batch never moves them.
    frozen_layers: int | tuple[int, ...] = 0
    optimizer: str = "SGD"
    optimizer_kwargs: Mapping[str, Any] = field(default_factory=lambda: {"lr": 0.1})
    #: A recipe of :data:`PARAM_GROUPS` splitting the parameters into optimizer
    #: groups (None: one group of every parameter).
    param_groups: str | None = None
    #: A name in ``equiv.losses.LOSSES``, or your own loss object following the
    #: sum + count protocol: ``sum(output, targets)``, ``count(targets)`` and
    #: ``__call__`` (the mean), like :class:`equiv.losses.Loss`.
    loss: str | Loss = "mse"
    #: Optimizer steps; >= 2 so that state and gradients leaking across steps show.
    steps: int = 2
    #: Clip the window's gradient to this norm once per step (None: no clipping).
    max_grad_norm: float | None = None
    #: A ``torch.optim.lr_scheduler`` class name, stepped once per optimizer step.
    scheduler: str | None = None
    scheduler_kwargs: Mapping[str, Any] = field(default_factory=dict)
    #: Dynamic loss scaling (torch.amp.GradScaler) starting at this scale; None: off.
    loss_scale: float | None = None
    #: (step, sample): that sample's inputs are +inf at that step, so the window
    #: overflows and its update must be skipped (needs ``loss_scale``).
    overflow_at: tuple[int, int] | None = None
    #: Samples (indices into every step's batch) whose targets are all padding: no
    #: real token at all (a token loss only).  A micro-batch of such samples holds
    #: zero items, on one rank only or on several (drawn by the distributed search).
    empty_samples: tuple[int, ...] = ()
    #: GradScaler's ``growth_interval``: the scale doubles after this many clean
    #: windows in a row (needs ``loss_scale``).  None: torch's default of 2000,
    #: which no case of a few steps reaches; 1 or 2 make growth happen within a
    #: case, so a step that updates the scale at the wrong time shows.
    scale_growth_interval: int | None = None
    #: Mixed precision as in PyTorch's AMP recipe: parameters stay in ``dtype``
    #: and the forward runs under ``torch.autocast`` to this dtype ("float16" or
    #: "bfloat16"; ``torch.bfloat16`` is taken too), the full-batch reference and its
    #: floors too, so the allowance is that precision's.  float64 runs are never
    #: lowered, so the truth stays exact.  None: none, unless the step enters
    #: ``torch.autocast`` itself: :func:`equiv.check` sees it where the step calls its
    #: model and judges the case as with that dtype here (a note says so); a dtype
    #: here that contradicts the step's own makes the case not applicable.
    #: ``equiv check`` / ``equiv verify --autocast`` set it on every case.
    autocast: str | None = None
    #: The working dtype of the noise-floor tier ("float64" runs the exact tier only).
    dtype: str = "float32"
    device: str = "cpu"
    seed: int = 0
    #: "random" (drawn from the seed for the model's inputs and the loss's
    #: targets), "toy_2x", or your own data: a ``DataFactory`` or its import path.
    data: str | DataFactory = "random"

    def __post_init__(self) -> None:
        # Normalise containers so equal cases compare equal and repr round-trips.
        object.__setattr__(self, "micro_batch_sizes", tuple(self.micro_batch_sizes))
        if self.overflow_at is not None:
            object.__setattr__(self, "overflow_at", tuple(self.overflow_at))
        object.__setattr__(self, "empty_samples", tuple(self.empty_samples))
        if isinstance(self.frozen_layers, list):
            object.__setattr__(self, "frozen_layers", tuple(self.frozen_layers))
        for name in ("model_kwargs", "optimizer_kwargs", "scheduler_kwargs"):
            object.__setattr__(self, name, dict(getattr(self, name)))
        self._accept_torch_spellings()
        self._normalise_scheduler_parts()
        if (
            isinstance(self.loss, str) and ":" in self.loss
        ):  # a user's loss class (a replay line), built with no arguments
            try:
                object.__setattr__(self, "loss", resolve(self.loss)())
            except (ValueError, TypeError) as exc:
                raise InvalidCase(f"loss {self.loss!r}: {exc}") from None
        self._validate()

    def _accept_torch_spellings(self) -> None:
        """torch's own objects and any capitalisation, stored as the canonical name:
        ``dtype=torch.float32``, ``optimizer=torch.optim.AdamW``, ``optimizer="adamw"``,
        ``scheduler=torch.optim.lr_scheduler.StepLR``, ``autocast=torch.bfloat16``."""
        for name in ("dtype", "autocast"):
            value = getattr(self, name)
            if isinstance(value, torch.dtype):
                object.__setattr__(self, name, str(value).removeprefix("torch."))
        namespaces: tuple[tuple[str, Any, str], ...] = (
            ("optimizer", torch.optim, "torch.optim"),
            ("scheduler", torch.optim.lr_scheduler, "torch.optim.lr_scheduler"),
        )
        for name, namespace, label in namespaces:
            given: Any = getattr(self, name)
            if inspect.isclass(given):
                class_name = given.__name__
                if getattr(namespace, class_name, None) is not given:
                    raise InvalidCase(
                        f"{name} {given.__module__}.{given.__qualname__} is not a class of {label}; "
                        "a case names one of those"
                    )
                object.__setattr__(self, name, class_name)
        choices = {
            "dtype": DTYPES,
            "autocast": ("float16", "bfloat16"),
            "optimizer": [*_optimizer_names(), *UNSUPPORTED_OPTIMIZERS, *EXTERNAL_OPTIMIZERS],
            "scheduler": _scheduler_names(),
            "loss": LOSSES,
            "model": MODELS,
            "param_groups": PARAM_GROUPS,
        }
        for name, names in choices.items():
            spelled = getattr(self, name)
            if isinstance(spelled, str) and ":" not in spelled and spelled not in names:
                matches = [known for known in names if known.lower() == spelled.lower()]
                if len(matches) == 1:
                    object.__setattr__(self, name, matches[0])

    def _normalise_scheduler_parts(self) -> None:
        """A composite scheduler's parts as ``[name, dict]`` lists (tuples, a
        torch class or other mappings accepted), so equal cases compare equal
        whether built in code or read back from JSON; malformed parts raise
        :class:`InvalidCase` naming the bad entry."""
        if self.scheduler not in COMPOSITE_SCHEDULERS:
            return
        parts = self.scheduler_kwargs.get("schedulers")
        if isinstance(parts, (str, bytes)) or not isinstance(parts, (list, tuple)) or not parts:
            raise InvalidCase(
                f"scheduler {self.scheduler} needs scheduler_kwargs['schedulers']: a non-empty list of "
                f"[name, kwargs] pairs (e.g. [['LinearLR', {{'total_iters': 2}}]]), got {parts!r}"
            )
        normalised = []
        for index, part in enumerate(parts):
            if not (isinstance(part, (list, tuple)) and len(part) == 2 and isinstance(part[1], Mapping)):
                raise InvalidCase(
                    f"scheduler {self.scheduler}: part {index} of scheduler_kwargs['schedulers'] must "
                    f"be a [name, kwargs] pair, got {part!r}"
                )
            name = part[0].__name__ if inspect.isclass(part[0]) else part[0]
            if name in COMPOSITE_SCHEDULERS or not (isinstance(name, str) and name in _scheduler_names()):
                raise InvalidCase(
                    f"scheduler {self.scheduler}: part {index} names {name!r}; expected a scheduler "
                    f"class of torch.optim.lr_scheduler other than {' or '.join(COMPOSITE_SCHEDULERS)}"
                    f"{_did_you_mean(name, _scheduler_names())}"
                )
            normalised.append([name, dict(part[1])])
        # scheduler_kwargs is this case's own dict (copied in __post_init__).
        object.__setattr__(self, "scheduler_kwargs", {**self.scheduler_kwargs, "schedulers": normalised})

    def _validate(self) -> None:
        """Each field checked in turn: the first that cannot describe a run raises :class:`InvalidCase`."""
        _check_micro_batches(self.batch_size, self.micro_batch_sizes)
        _check_frozen_layers(self.frozen_layers)
        if self.param_groups is not None and self.param_groups not in PARAM_GROUPS:
            raise InvalidCase(
                f"unknown param_groups {self.param_groups!r}; expected None or one of {sorted(PARAM_GROUPS)}"
            )
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 1:
            raise InvalidCase(f"steps must be a positive int, got {self.steps!r}")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise InvalidCase(f"max_grad_norm must be positive or None, got {self.max_grad_norm!r}")
        self._validate_loss_scale()
        self._validate_empty_samples()
        self._validate_growth_interval()
        if self.autocast is not None and self.autocast not in ("float16", "bfloat16"):
            raise InvalidCase(f"autocast must be 'float16', 'bfloat16' or None, got {self.autocast!r}")
        if self.dtype not in DTYPES:
            raise InvalidCase(
                f"unknown dtype {self.dtype!r}; expected one of {sorted(DTYPES)}{_did_you_mean(self.dtype, DTYPES)}"
            )
        _check_loss(self.loss)
        _check_target("model", self.model, MODELS)
        _check_target("data", self.data, DATA)
        if self.data == "toy_2x" and self.model != "scalar_linear":
            raise InvalidCase(f"data 'toy_2x' needs model 'scalar_linear', got {self.model!r}")
        optimizer_class = _check_optimizer(self.optimizer)
        _check_scheduler(self.scheduler)
        check_device(self.device)
        _check_optimizer_kwargs(optimizer_class, self.optimizer, self.optimizer_kwargs)

    def _validate_loss_scale(self) -> None:
        if self.loss_scale is not None and not self.loss_scale > 0:
            raise InvalidCase(f"loss_scale must be positive or None, got {self.loss_scale!r}")
        if self.overflow_at is None:
            return
        if self.loss_scale is None:
            raise InvalidCase(
                f"overflow_at={self.overflow_at} needs loss_scale: without loss scaling an "
                "overflow is a non-finite loss, not a window to skip"
            )
        step, sample = self.overflow_at
        if not (0 <= step < self.steps and 0 <= sample < self.batch_size):
            raise InvalidCase(
                f"overflow_at={self.overflow_at} is outside steps 0..{self.steps - 1} "
                f"x samples 0..{self.batch_size - 1}"
            )

    def _validate_growth_interval(self) -> None:
        interval = self.scale_growth_interval
        if interval is None:
            return
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise InvalidCase(
                f"scale_growth_interval must be a positive int (clean windows before the scale "
                f"doubles) or None, got {interval!r}"
            )
        if self.loss_scale is None:
            raise InvalidCase(
                f"scale_growth_interval={interval} needs loss_scale: without loss scaling there is no scale to grow"
            )

    def _validate_empty_samples(self) -> None:
        empty = self.empty_samples
        if not empty:
            return
        if len(set(empty)) != len(empty) or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < self.batch_size for i in empty
        ):
            raise InvalidCase(
                f"empty_samples must be distinct sample indices in 0..{self.batch_size - 1}, got {empty!r}"
            )
        if self.loss != "token_cross_entropy" or self.data != "random":
            raise InvalidCase(
                f"empty_samples={empty!r} pads every token of those samples: it needs "
                f"loss='token_cross_entropy' with data='random', got loss={self.loss!r}, "
                f"data={_reference(self.data)!r}"
            )
        if len(empty) == self.batch_size:
            raise InvalidCase(
                f"empty_samples={empty!r} leaves no real token in the batch of {self.batch_size}: "
                "the full-batch mean would divide by zero"
            )

    # ----------------------------------------------------------- serialising
    def __repr__(self) -> str:
        """Only the fields that differ from the defaults: short, and still
        exactly the case (paste it to reproduce; a user's own model, loss or
        data shows as its import path, or says it cannot be imported)."""
        defaults = {
            f.name: (f.default_factory() if f.default_factory is not MISSING else f.default) for f in fields(Case)
        }
        # A user's model, loss or data as its import path (to_dict); the other fields as they are.
        as_strings = self.to_dict()
        shown = [
            f"{f.name}={(as_strings[f.name] if f.name in ('model', 'loss', 'data') else getattr(self, f.name))!r}"
            for f in fields(self)
            if f.name in ("batch_size", "micro_batch_sizes") or getattr(self, f.name) != defaults[f.name]
        ]
        return f"Case({', '.join(shown)})"

    def to_dict(self) -> dict[str, Any]:
        """Plain values only (lists, not tuples), ready for JSON or a report row.
        A user's own model factory, loss or data becomes its import path
        (``"module:attribute"``, which :meth:`from_dict` imports), or a
        ``"<...: not importable>"`` description that :meth:`from_dict` rejects."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        for name in ("model_kwargs", "optimizer_kwargs", "scheduler_kwargs"):
            out[name] = dict(out[name])
        out["micro_batch_sizes"] = list(self.micro_batch_sizes)
        if isinstance(self.frozen_layers, tuple):
            out["frozen_layers"] = list(self.frozen_layers)
        if self.overflow_at is not None:
            out["overflow_at"] = list(self.overflow_at)
        # Kept out when empty, so the rows of cases that pad no whole sample read as before.
        if self.empty_samples:
            out["empty_samples"] = list(self.empty_samples)
        else:
            del out["empty_samples"]
        out["model"] = _reference(self.model)
        out["data"] = _reference(self.data)
        out["loss"] = self.loss if isinstance(self.loss, str) else _loss_reference(self.loss)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, allow_imports: bool | Iterable[str] = ()) -> Case:
        """Rebuild a case from :meth:`to_dict` output (or its JSON).

        A user's own model factory, loss or data is stored as an import path,
        and importing it runs that module's code.  So a case read back imports
        only from the modules named in ``allow_imports`` (each with its
        submodules), or from anywhere with ``allow_imports=True``: a case pasted
        from someone's log must not run code you did not name.  ``equiv check
        --case`` allows the step's own module and those given with
        ``--allow-import``.  Raises :class:`InvalidCase` for a path outside them.
        """
        values = dict(data)
        values["micro_batch_sizes"] = tuple(values["micro_batch_sizes"])
        if allow_imports is not True:
            allowed = [] if allow_imports is False else list(allow_imports)
            for name in ("model", "loss", "data"):
                _check_import_allowed(name, values.get(name), allowed)
        return cls(**values)

    def replace(self, **changes: Any) -> Case:
        """A copy with some fields changed (validated again)."""
        return Case(**{**{f.name: getattr(self, f.name) for f in fields(self)}, **changes})

    # -------------------------------------------------------------- building
    @property
    def working_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def build_loss(self) -> Loss:
        # A user's loss object is shared by every run of the case: the protocol asks it to be stateless.
        return build_loss(self.loss) if isinstance(self.loss, str) else self.loss

    def build_model(self) -> ModelBundle:
        """The model with its initial weights already rounded to the working
        dtype (still stored in float32), so runs in any dtype start equal, and
        its first ``frozen_layers`` layers frozen."""
        try:
            bundle = build_model(self.model, self.seed, **self.model_kwargs)
        except ValueError as exc:  # the case's model cannot be built from its arguments: the case is bad
            raise InvalidCase(str(exc)) from None
        with torch.no_grad():
            for tensor in [*bundle.module.parameters(), *bundle.module.buffers()]:
                if tensor.is_floating_point():
                    tensor.copy_(tensor.to(self.working_dtype))
        if self.frozen_layers:
            # A layer is a module owning parameters itself; recurse=False, so a
            # module with children of its own (MultiheadAttention's out_proj)
            # freezes only what it owns, and each child counts as its own layer.
            layers = [m for m in bundle.module.modules() if next(m.parameters(recurse=False), None) is not None]
            for index in self._frozen_indices(len(layers)):
                for param in layers[index].parameters(recurse=False):
                    param.requires_grad_(False)
        return bundle

    def _frozen_indices(self, count: int) -> list[int]:
        """Which of ``count`` layers ``frozen_layers`` freezes; at least one must train."""
        frozen = self.frozen_layers
        if isinstance(frozen, tuple):
            outside = [i for i in frozen if not -count <= i < count]
            if outside:
                raise InvalidCase(
                    f"frozen_layers={frozen} names layer(s) {outside} of model "
                    f"{_reference(self.model)!r}, which has {count} layers with parameters"
                )
            indices = sorted({i % count for i in frozen})
        elif frozen < 0 and -frozen >= count:
            raise InvalidCase(
                f"frozen_layers={frozen} (all but the last {-frozen}) freezes nothing in model "
                f"{_reference(self.model)!r}, which has {count} layers with parameters"
            )
        else:
            indices = list(range(frozen)) if frozen >= 0 else list(range(count + frozen))
        if len(set(indices) & set(range(count))) >= count:
            raise InvalidCase(
                f"frozen_layers={frozen} would freeze every layer of model {_reference(self.model)!r} "
                f"({count} with parameters); at least one must train"
            )
        return [i for i in indices if i < count]

    def batches(self, bundle: ModelBundle) -> list[tuple[Tensor, Tensor]]:
        """One full batch per step, float inputs and targets already rounded to
        the working dtype (stored in float32 or as integers), on the CPU."""
        if self.data == "toy_2x":
            x = torch.arange(1, self.batch_size + 1, dtype=torch.float32).view(-1, 1)
            return [(x, 2 * x) for _ in range(self.steps)]
        out = []
        for step in range(self.steps):
            generator = torch.Generator().manual_seed(self.seed * 100_003 + step)
            if self.data == "random":
                if bundle.make_inputs is None or bundle.output_shape is None:
                    raise InvalidCase(
                        f"model {_reference(self.model)!r} is a bare nn.Module, so equiv cannot draw its inputs: "
                        "pass data=your_batches, a callable (step, batch_size, generator) -> (inputs, targets), "
                        "or return a ModelBundle from the factory"
                    )
                inputs = bundle.make_inputs(self.batch_size, generator)
                targets = self._targets(bundle.output_shape, generator, inputs)
            else:
                inputs, targets = self._user_batch(step, generator)
            if self.overflow_at is not None and self.overflow_at[0] == step:
                if not inputs.is_floating_point():
                    raise InvalidCase(f"overflow_at needs float inputs; model {self.model!r} takes {inputs.dtype}")
                inputs[self.overflow_at[1]] = float("inf")
            out.append((self._round(inputs), self._round(targets)))
        return out

    def _user_batch(self, step: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        factory = resolve(self.data) if isinstance(self.data, str) else self.data
        batch = factory(step, self.batch_size, generator)
        if not (isinstance(batch, tuple) and len(batch) == 2 and all(isinstance(t, Tensor) for t in batch)):
            raise InvalidCase(
                f"data {_reference(self.data)!r} returned {type(batch).__name__} at step {step}; "
                "expected a tuple (inputs, targets) of tensors"
            )
        inputs, targets = batch
        for label, tensor in (("inputs", inputs), ("targets", targets)):
            if tensor.dim() == 0 or tensor.shape[0] != self.batch_size:
                raise InvalidCase(
                    f"data {_reference(self.data)!r} returned {label} of shape {tuple(tensor.shape)} "
                    f"at step {step}; expected batch_size={self.batch_size} samples along dim 0"
                )
        return inputs.detach().cpu(), targets.detach().cpu()

    def _targets(self, output_shape: tuple[int, ...], generator: torch.Generator, inputs: Tensor) -> Tensor:
        batch = self.batch_size
        if not isinstance(self.loss, str):
            raise InvalidCase(
                f"random targets are drawn for a built-in loss ({sorted(LOSSES)}); with your own "
                f"loss {self.loss!r} pass data=your_batches as well"
            )
        drawn_by_loss = getattr(LOSSES[self.loss], "draw_targets", None)
        if drawn_by_loss is not None:  # packed and policy losses: targets that follow the inputs' layout
            try:
                targets: Tensor = drawn_by_loss(self.build_loss(), inputs, output_shape, generator)
            except ValueError as exc:
                raise InvalidCase(f"loss {self.loss!r} with model {_reference(self.model)!r}: {exc}") from None
            return targets
        if self.loss == "mse":
            return torch.randn(batch, *output_shape, generator=generator)
        if self.loss == "mse_aux":  # the model's last output column is its aux loss, with no target
            if len(output_shape) != 1 or output_shape[0] < 2:
                raise InvalidCase(f"loss 'mse_aux' needs a (features + 1,) output, model gives {output_shape}")
            return torch.randn(batch, output_shape[0] - 1, generator=generator)
        if self.loss == "cross_entropy":
            if len(output_shape) != 1:
                raise InvalidCase(f"loss 'cross_entropy' needs a (classes,) output, model gives {output_shape}")
            return torch.randint(0, output_shape[0], (batch,), generator=generator)
        # token_cross_entropy: variable-length sequences padded with ignore_index.
        if len(output_shape) != 2:
            raise InvalidCase(f"loss 'token_cross_entropy' needs a (seq, vocab) output, model gives {output_shape}")
        seq_len, vocab = output_shape
        tokens = torch.randint(0, vocab, (batch, seq_len), generator=generator)
        lengths = torch.randint(1, seq_len + 1, (batch, 1), generator=generator)
        padding = torch.arange(seq_len).expand(batch, seq_len) >= lengths
        if self.empty_samples:
            padding[list(self.empty_samples)] = True
        ignore_index: int = self.build_loss().ignore_index  # type: ignore[attr-defined]
        return tokens.masked_fill(padding, ignore_index)

    def _round(self, tensor: Tensor) -> Tensor:
        return tensor.to(self.working_dtype).float() if tensor.is_floating_point() else tensor

    def build_optimizer(self, module: nn.Module) -> torch.optim.Optimizer:
        """The case's optimizer over every parameter of ``module``, frozen ones
        included (as ``optimizer(model.parameters())`` in fine-tuning code: the
        optimizer skips a parameter whose ``.grad`` is None), in the groups
        of ``param_groups``."""
        optimizer_class = optimizer_class_named(self.optimizer)
        params = self._param_groups(module, optimizer_class)
        try:
            optimizer: torch.optim.Optimizer = optimizer_class(params, **self.optimizer_kwargs)
        except (TypeError, ValueError) as exc:
            raise InvalidCase(
                f"optimizer {self.optimizer}(**{dict(self.optimizer_kwargs)!r}) rejected: {exc}"
            ) from None
        return optimizer

    def _param_groups(self, module: nn.Module, optimizer_class: type) -> list[nn.Parameter] | list[dict[str, Any]]:
        named = list(module.named_parameters())
        if self.param_groups is None:
            return [param for _, param in named]
        accepts = inspect.signature(optimizer_class).parameters
        groups: list[dict[str, Any]]
        if self.param_groups == "no_decay":
            # Biases and norm weights are the tensors of fewer than 2 dims (nanoGPT's rule).
            no_decay: dict[str, Any] = {"params": [p for _, p in named if p.dim() < 2]}
            if "weight_decay" in accepts:  # an optimizer without decay (Rprop) gets two plain groups
                no_decay["weight_decay"] = 0.0
            groups = [{"params": [p for _, p in named if p.dim() >= 2]}, no_decay]
        else:  # "head_lr", "parked": groups by learning rate
            if "lr" not in accepts:
                raise InvalidCase(
                    f"param_groups {self.param_groups!r} needs an optimizer with an lr; {self.optimizer} has none"
                )
            lr = self.optimizer_kwargs.get("lr", accepts["lr"].default)
            if not isinstance(lr, (int, float)) or isinstance(lr, bool):
                raise InvalidCase(
                    f"param_groups {self.param_groups!r} needs a numeric lr for {self.optimizer}, got {lr!r}"
                )
            # A layer is the module owning a parameter (its name minus the last part):
            # the head owns the last parameter, the first layer the first.
            owner_at = -1 if self.param_groups == "head_lr" else 0
            owner = named[owner_at][0].rpartition(".")[0] if named else ""
            own = [p for name, p in named if name.rpartition(".")[0] == owner]
            rest = [p for name, p in named if name.rpartition(".")[0] != owner]
            if self.param_groups == "head_lr":
                groups = [{"params": rest, "lr": HEAD_LR_BODY_FACTOR * lr}, {"params": own}]
            else:
                groups = [{"params": own, "lr": 0.0}, {"params": rest}]
        empty = [index for index, group in enumerate(groups) if not group["params"]]
        if empty:
            raise InvalidCase(
                f"param_groups {self.param_groups!r} ({PARAM_GROUPS[self.param_groups]}) leaves group {empty[0]} "
                f"empty for model {self.model!r} with parameters {[name for name, _ in named]}; "
                "expected a model with parameters on both sides of the split"
            )
        return groups

    def build_grad_scaler(self) -> torch.amp.GradScaler | None:
        if self.loss_scale is None:
            return None
        # None: torch's own default interval.
        growth: dict[str, Any] = (
            {} if self.scale_growth_interval is None else {"growth_interval": self.scale_growth_interval}
        )
        return torch.amp.GradScaler(torch.device(self.device).type, init_scale=self.loss_scale, **growth)

    def build_scheduler(self, optimizer: torch.optim.Optimizer) -> Any | None:
        if self.scheduler is None:
            return None
        kwargs = dict(self.scheduler_kwargs)
        if self.scheduler in COMPOSITE_SCHEDULERS:
            # The parts first, each on the optimizer, in order (as a training script builds them).
            kwargs["schedulers"] = [_build_scheduler(name, part, optimizer) for name, part in kwargs["schedulers"]]
        return _build_scheduler(self.scheduler, kwargs, optimizer)


def _build_scheduler(name: str, kwargs: Mapping[str, Any], optimizer: torch.optim.Optimizer) -> Any:
    # By keyword: every scheduler names it "optimizer", and ChainedScheduler takes its parts first.
    try:
        return getattr(torch.optim.lr_scheduler, name)(optimizer=optimizer, **kwargs)
    except (TypeError, ValueError) as exc:
        raise InvalidCase(f"scheduler {name}(**{dict(kwargs)!r}) rejected: {exc}") from None


def _reference(value: Any) -> str:
    """A model or data field as a string: itself, a callable's import path, or
    a description saying it cannot be imported (so no replay pretends to work)."""
    if isinstance(value, str):
        return value
    path = reference(value)
    if path is not None:
        return path
    name = getattr(value, "__qualname__", type(value).__name__)
    return f"<{name}: not importable, define it at module level to replay>"


def _loss_reference(loss: Any) -> str:
    """A loss object as a string: a built-in loss's name, or its class's import
    path when the class rebuilds it with no arguments (same repr)."""
    cls = type(loss)
    try:
        fresh = cls()
    except TypeError:
        rebuilt = False
    else:  # the same settings: the same attributes (or, without any, the same repr)
        rebuilt = (vars(fresh) == vars(loss)) if hasattr(loss, "__dict__") else repr(fresh) == repr(loss)
    if rebuilt and isinstance(getattr(cls, "name", None), str) and LOSSES.get(cls.name) is cls:
        return cls.name
    path = reference(cls)
    if rebuilt and path is not None:
        return path
    shown = repr(loss) if type(loss).__repr__ is not object.__repr__ else f"a {cls.__qualname__}"
    return f"<{shown}: not importable, a module-level loss class built with no arguments replays>"

"""Loss functions in the form the candidate contract hands them to a step.

A candidate's ``loss_fn(output, target)`` returns the MEAN loss over the
micro-batch's items.  Every loss here also offers what a correct accumulation
needs: ``loss_fn.sum(output, target)`` (the SUM over items) and
``loss_fn.count(target)`` (how many items that sum is over).  For sample losses
an item is a sample; for :class:`TokenCrossEntropy` it is a token that is not
padding, so the correct window loss is ``Σ sums / Σ counts`` and a step that
weights micro-batches by samples (or averages their means) is found out.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "LOSSES",
    "MSE",
    "CrossEntropy",
    "Loss",
    "LossOptions",
    "MSEWithAux",
    "NextTokenCrossEntropy",
    "TokenCrossEntropy",
    "TokenMSEWithAux",
    "build_loss",
    "disagreement",
    "item_count",
    "loss_of",
    "loss_sum_and_count",
    "options_of_call",
    "options_of_criterion",
]


class Loss:
    """Base: a mean-reducing loss that also exposes its sum and its item count."""

    name: ClassVar[str]
    #: True when items are not samples (the count depends on the targets' content).
    item_weighted: ClassVar[bool] = False

    def __call__(self, output: Tensor, target: Tensor) -> Tensor:
        return self.sum(output, target) / self.count(target)

    def sum(self, output: Tensor, target: Tensor) -> Tensor:
        raise NotImplementedError

    def count(self, target: Tensor) -> int | Tensor:
        """Items in ``target``: an int for sample losses, a 0-d tensor (on the
        targets' device, no host read) for item-weighted ones."""
        return int(target.shape[0])

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class MSE(Loss):
    """Mean squared error exactly as ``nn.MSELoss()`` computes it: the mean over
    every element.  An item is an element; every sample has the same number of
    elements, so this is still a sample mean."""

    name = "mse"

    def __call__(self, output: Tensor, target: Tensor) -> Tensor:
        return F.mse_loss(output, target)

    def sum(self, output: Tensor, target: Tensor) -> Tensor:
        return F.mse_loss(output, target, reduction="sum")

    def count(self, target: Tensor) -> int:
        return target.numel()


def _weights_of(weight: Tensor | None, like: Tensor) -> Tensor | None:
    """Class weights on the output's device and in its dtype (the replay runs float64)."""
    return None if weight is None else weight.detach().to(device=like.device, dtype=like.dtype)


def _weighted_count(target: Tensor, weight: Tensor | None, ignore_index: int) -> Tensor:
    """What torch's weighted mean divides by: the sum of each counted target's class weight (every
    target not ``ignore_index`` counts 1 without weights); a 0-d tensor, no host read."""
    counted = target != ignore_index
    if weight is None:
        return counted.sum()
    classes = torch.where(counted, target, torch.zeros_like(target))
    return (weight.detach().to(target.device)[classes] * counted).sum()


def _options_repr(name: str, **options: Any) -> str:
    shown = ", ".join(
        f"{key}={'<tensor>' if isinstance(value, Tensor) else repr(value)}" for key, value in options.items()
    )
    return f"{name}({shown})"


class CrossEntropy(Loss):
    """Cross-entropy over classes, one target class per sample (class dim 1, as torch takes it).

    ``weight`` (class weights), ``ignore_index`` and ``label_smoothing`` are
    ``nn.CrossEntropyLoss``'s: the mean is torch's, so with class weights the item
    count is the sum of the targets' weights (torch's weighted mean divides by it)
    and ignored targets are not counted.  Logits of shape (batch, seq, classes)
    with targets the loop flattened to (batch * seq,) (``logits.view(-1, V)``)
    are taken flattened."""

    name = "cross_entropy"

    def __init__(
        self, *, weight: Tensor | None = None, ignore_index: int | None = None, label_smoothing: float = 0.0
    ) -> None:
        self.weight, self.ignore_index, self.label_smoothing = weight, ignore_index, float(label_smoothing)

    @property
    def _counted(self) -> bool:
        """Items are counted from the targets (weights, ignored targets), not taken as the samples."""
        return self.weight is not None or self.ignore_index is not None

    def _torch(self, output: Tensor, target: Tensor, reduction: str) -> Tensor:
        output, target = _classes_first(output, target)
        return F.cross_entropy(
            output,
            target,
            weight=_weights_of(self.weight, output),
            ignore_index=-100 if self.ignore_index is None else self.ignore_index,
            label_smoothing=self.label_smoothing,
            reduction=reduction,
        )

    def __call__(self, output: Tensor, target: Tensor) -> Tensor:
        return self._torch(output, target, "mean")

    def sum(self, output: Tensor, target: Tensor) -> Tensor:
        return self._torch(output, target, "sum")

    def count(self, target: Tensor) -> int | Tensor:
        if not self._counted or target.is_floating_point():  # class probabilities: torch's mean is over samples
            return int(target.shape[0])
        return _weighted_count(target, self.weight, -100 if self.ignore_index is None else self.ignore_index)

    def __repr__(self) -> str:
        options = {
            key: value
            for key, value in (
                ("weight", self.weight),
                ("ignore_index", self.ignore_index),
                ("label_smoothing", self.label_smoothing),
            )
            if value is not None and (isinstance(value, Tensor) or value != 0.0)
        }
        return _options_repr(type(self).__name__, **options)


def _classes_first(output: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
    """(batch, seq, classes) logits as the loop flattened them for its loss: its targets are
    (batch * seq,) or (batch, seq) where torch's class-dim-1 reading cannot fit them."""
    if output.dim() < 3 or target.is_floating_point():
        return output, target
    rows = output.numel() // output.shape[-1]
    torch_reads = target.shape == output.shape[:1] + output.shape[2:]
    if not torch_reads and target.numel() == rows and (target.dim() == 1 or target.shape == output.shape[:-1]):
        return output.reshape(rows, output.shape[-1]), target.reshape(rows)
    return output, target


class TokenCrossEntropy(Loss):
    """Token-level cross-entropy with padding: the mean is over the tokens whose
    target is not ``ignore_index``.  ``output`` is (batch, seq, vocab),
    ``target`` (batch, seq) (or flattened, as a loop hands its loss).  ``weight``
    and ``label_smoothing`` are ``nn.CrossEntropyLoss``'s: with class weights a
    token counts its target's weight (torch's weighted mean)."""

    name = "token_cross_entropy"
    item_weighted = True

    def __init__(self, ignore_index: int = -100, *, weight: Tensor | None = None, label_smoothing: float = 0.0) -> None:
        self.ignore_index, self.weight, self.label_smoothing = ignore_index, weight, float(label_smoothing)

    def _torch(self, output: Tensor, target: Tensor, reduction: str) -> Tensor:
        return F.cross_entropy(
            output.flatten(0, 1),
            target.flatten(),
            weight=_weights_of(self.weight, output),
            ignore_index=self.ignore_index,
            label_smoothing=self.label_smoothing,
            reduction=reduction,
        )

    def __call__(self, output: Tensor, target: Tensor) -> Tensor:
        # Mean over this micro-batch's real tokens (what HF models return).
        return self._torch(output, target, "mean")

    def sum(self, output: Tensor, target: Tensor) -> Tensor:
        return self._torch(output, target, "sum")

    def count(self, target: Tensor) -> Tensor:
        return _weighted_count(target, self.weight, self.ignore_index)

    def __repr__(self) -> str:
        options: dict[str, Any] = {"ignore_index": self.ignore_index}
        if self.weight is not None:
            options["weight"] = self.weight
        if self.label_smoothing:
            options["label_smoothing"] = self.label_smoothing
        return _options_repr(type(self).__name__, **options)


class NextTokenCrossEntropy(TokenCrossEntropy):
    """A causal LM's next-token loss as transformers computes it from ``labels``:
    the logits at position t predict the label at t + 1 (shifted here), labels
    ``ignore_index`` (-100) are padding; items are the real next-token targets."""

    def __call__(self, output: Tensor, target: Tensor) -> Tensor:
        return super().__call__(output[:, :-1], _next(target))

    def sum(self, output: Tensor, target: Tensor) -> Tensor:
        return super().sum(output[:, :-1], _next(target))

    def count(self, target: Tensor) -> Tensor:
        return super().count(_next(target))


def _next(target: Tensor) -> Tensor:
    """The next-token targets of (batch, seq) labels; flat labels are the loop's own, already shifted
    (``F.cross_entropy(logits[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1))``)."""
    return target if target.dim() == 1 else target[:, 1:]


class MSEWithAux(Loss):
    """A task loss plus an auxiliary loss the model computed, as MoE training
    adds its load-balancing loss: ``output`` is (batch, features + 1), the last
    column each sample's weighted aux loss, ``target`` (batch, features).  An
    item is a sample: the mean is the task MSE plus the mean aux loss, and
    :meth:`task_sum` / :meth:`aux_mean` give the two parts apart (a step that
    weights them differently is what NeMo Automodel PR #3359 fixed)."""

    name = "mse_aux"

    def task_sum(self, output: Tensor, target: Tensor) -> Tensor:
        """The task loss summed over samples (each sample's MSE over its features)."""
        features = output.shape[-1] - 1
        if target.shape[-1] != features:
            raise ValueError(
                f"loss 'mse_aux' needs targets with one column fewer than the output "
                f"(the aux loss); got output {tuple(output.shape)}, target {tuple(target.shape)}"
            )
        return F.mse_loss(output[..., :-1], target, reduction="sum") / features

    def aux_mean(self, output: Tensor) -> Tensor:
        """The micro-batch's aux loss as the model reports it: a mean over its samples."""
        return output[..., -1].mean()

    def sum(self, output: Tensor, target: Tensor) -> Tensor:
        return self.task_sum(output, target) + output[..., -1].sum()


class TokenMSEWithAux(Loss):
    """A per-token task loss plus each token's share of its sequence's router
    losses (model ``"token_moe"``): ``output`` is (batch, seq, features + 2), the
    last two columns each token's weighted load-balancing and z-loss shares,
    ``target`` (batch, seq, features).  An item is a token (every one real), so
    the mean is the token mean of the task MSE plus each sequence's router losses
    averaged over the window's sequences; :meth:`task_sum`, :meth:`aux_sum` and
    :meth:`z_sum` give the parts apart, for a step that attaches the router
    losses on their own as Megatron does."""

    name = "token_mse_aux"

    def task_sum(self, output: Tensor, target: Tensor) -> Tensor:
        """The task loss summed over tokens (each token's MSE over its features)."""
        features = output.shape[-1] - 2
        if target.shape[-1] != features or target.shape[:-1] != output.shape[:-1]:
            raise ValueError(
                f"loss 'token_mse_aux' needs targets shaped like the output less its two router "
                f"columns; got output {tuple(output.shape)}, target {tuple(target.shape)}"
            )
        return F.mse_loss(output[..., :-2], target, reduction="sum") / features

    def aux_sum(self, output: Tensor) -> Tensor:
        """The weighted load-balancing loss summed over tokens (a sequence's sum is its loss x its length)."""
        return output[..., -2].sum()

    def z_sum(self, output: Tensor) -> Tensor:
        """The weighted router z-loss summed over tokens."""
        return output[..., -1].sum()

    def sum(self, output: Tensor, target: Tensor) -> Tensor:
        return self.task_sum(output, target) + self.aux_sum(output) + self.z_sum(output)

    def count(self, target: Tensor) -> int:
        return int(target.shape[0] * target.shape[1])

    def draw_targets(self, inputs: Tensor, output_shape: tuple[int, ...], generator: torch.Generator) -> Tensor:
        """Random targets for every position, two columns fewer than the output (the router losses)."""
        if len(output_shape) != 2 or output_shape[1] < 3:
            raise ValueError(f"it needs a (seq, features + 2) output, the model gives {output_shape}")
        return torch.randn(inputs.shape[0], output_shape[0], output_shape[1] - 2, generator=generator)


LOSSES: dict[str, type[Loss]] = {
    cls.name: cls for cls in (MSE, CrossEntropy, TokenCrossEntropy, MSEWithAux, TokenMSEWithAux)
}


def build_loss(name: str) -> Loss:
    """The loss registered under ``name`` (one of :data:`LOSSES`).

    Args:
        name: a key of :data:`LOSSES` (``"mse"``, ``"cross_entropy"``, ``"packed_dpo"``...).

    Returns:
        A new instance of that loss, with its default options.

    Raises:
        ValueError: ``name`` is not registered (the message lists the names that are).
    """
    try:
        return LOSSES[name]()
    except KeyError:
        raise ValueError(f"unknown loss {name!r}; expected one of {sorted(LOSSES)}") from None


def loss_sum_and_count(loss_fn: Callable[..., Tensor], output: Tensor, target: Tensor) -> tuple[Tensor, int | Tensor]:
    """The micro-batch's SUMMED loss and how many items it sums over.

    Uses ``loss_fn.sum`` / ``loss_fn.count`` when the loss offers them (every
    :mod:`equiv.losses` loss does); a plain mean loss is taken as a mean over
    samples: ``mean * samples``.

    Args:
        loss_fn: the loss, as a candidate is handed it.
        output, target: the micro-batch's model output and targets.

    Returns:
        ``(sum, count)``: the loss summed over the micro-batch's items, and how many items that is
        (an int, or a 0-d tensor on the targets' device for an item-weighted loss).
    """
    if hasattr(loss_fn, "sum") and hasattr(loss_fn, "count"):
        return loss_fn.sum(output, target), loss_fn.count(target)
    samples = int(target.shape[0])
    return loss_fn(output, target) * samples, samples


def item_count(loss_fn: Callable[..., Tensor], target: Tensor) -> int | Tensor:
    """How many items ``loss_fn`` averages over in ``target`` (samples for a plain mean loss).

    Args:
        loss_fn: the loss, as a candidate is handed it.
        target: the micro-batch's targets.

    Returns:
        The item count: an int, or a 0-d tensor on the targets' device for an item-weighted loss.
    """
    return loss_fn.count(target) if hasattr(loss_fn, "count") else int(target.shape[0])


# -- the options a torch loss carries, read from an nn.Module criterion or a functional call ----------------


@dataclasses.dataclass(frozen=True)
class LossOptions:
    """What a torch loss the run calls says about its objective: which shipped loss it maps onto
    (``family``: ``"cross_entropy"``, ``"mse"``) and the options that change its sum or its count.
    ``reduction`` is not among them: ``"sum"``, ``"mean"`` and ``"none"`` are how the loop
    reduces, not which items the full-batch mean is over (a loop dividing its sums by the
    window's count means the mean)."""

    #: which shipped loss it maps onto: "cross_entropy", "mse", or "unmapped" (another of torch's losses)
    family: str
    #: how the run wrote it, for messages: ``CrossEntropyLoss(label_smoothing=0.1)``
    written: str
    weight: Tensor | None = None
    ignore_index: int = -100
    label_smoothing: float = 0.0

    @property
    def kind(self) -> str:
        """The same as :attr:`family`; kept for code written before it."""
        return self.family


#: torch's criteria that map onto a shipped loss, by class
#: (NLLLoss on log-probabilities is cross-entropy: log_softmax leaves log-probabilities as they are)
_CRITERIA: dict[type[nn.Module], str] = {
    nn.CrossEntropyLoss: "cross_entropy",
    nn.NLLLoss: "cross_entropy",
    nn.MSELoss: "mse",
}
#: torch's functional losses that map onto a shipped loss
FUNCTIONAL: dict[Callable[..., Tensor], str] = {
    F.cross_entropy: "cross_entropy",
    F.nll_loss: "cross_entropy",
    F.mse_loss: "mse",
}
#: what :data:`_CRITERIA` maps, in words, for a refusal
_MAPPED = "CrossEntropyLoss, NLLLoss (on log-probabilities) and MSELoss"


def _written(name: str, options: dict[str, Any], defaults: dict[str, Any]) -> str:
    shown = {
        key: value
        for key, value in options.items()
        if key in defaults
        and not (value is None and defaults[key] is None)
        and (isinstance(value, Tensor) or value != defaults[key])
    }
    return _options_repr(name, **shown)


def _options(family: str, name: str, found: dict[str, Any], defaults: dict[str, Any]) -> LossOptions:
    """The options of a cross-entropy or MSE call; one an equiv loss cannot express refused by name."""
    if family == "mse":
        return LossOptions("mse", _written(name, found, defaults))
    probabilities = found.get("target")
    if isinstance(probabilities, Tensor) and probabilities.is_floating_point() and found.get("weight") is not None:
        raise ValueError(
            f"{name} with weight= and class-probability targets: torch's mean of that is over "
            "samples, not weights; equiv ships no loss for it (pass loss= and targets as class indices)"
        )
    weight = found.get("weight")
    return LossOptions(
        "cross_entropy",
        _written(name, found, defaults),
        weight=None if weight is None else weight.detach().clone(),
        ignore_index=int(found.get("ignore_index", -100)),
        label_smoothing=float(found.get("label_smoothing", 0.0)),
    )


def options_of_criterion(criterion: nn.Module) -> LossOptions | None:
    """The options of an ``nn.Module`` criterion that maps onto a shipped loss; family ``"unmapped"``
    for another of torch's losses (``L1Loss``, ``BCEWithLogitsLoss``: equiv ships nothing that
    computes them); None for the user's own module.

    Args:
        criterion: the ``nn.Module`` the run computes its loss with.

    Returns:
        Its :class:`LossOptions` (family, weight, ignore_index, label_smoothing, and how it was
        written), family ``"unmapped"`` for another of torch's losses, or None for the user's own.

    Raises:
        ValueError: a cross-entropy with class weights over class-probability targets, which no
            equiv loss computes.
    """
    mapped = next(((cls, family) for cls, family in _CRITERIA.items() if isinstance(criterion, cls)), None)
    if mapped is None:
        is_torchs = isinstance(criterion, nn.modules.loss._Loss)
        return LossOptions("unmapped", f"{type(criterion).__name__}()") if is_torchs else None
    cls, family = mapped  # a subclass (one that logs, say) read by the options of the torch loss it is
    defaults = {
        key: param.default
        for key, param in inspect.signature(cls).parameters.items()
        if param.default is not inspect.Parameter.empty
    }
    found = {
        key: getattr(criterion, key)
        for key in ("weight", "ignore_index", "label_smoothing", "reduction")
        if hasattr(criterion, key)
    }
    return _options(family, type(criterion).__name__, found, defaults)


def options_of_call(function: Callable[..., Tensor], args: tuple[Any, ...], kwargs: dict[str, Any]) -> LossOptions:
    """The options of a call of a functional loss of :data:`FUNCTIONAL` (``F.cross_entropy(x, y,
    label_smoothing=0.1)``), positional or by keyword.

    Args:
        function: the functional loss called (a key of :data:`FUNCTIONAL`).
        args, kwargs: the call's positional and keyword arguments.

    Returns:
        The call's :class:`LossOptions`.

    Raises:
        ValueError: a cross-entropy with class weights over class-probability targets, which no
            equiv loss computes.
    """
    signature = inspect.signature(function)
    bound = signature.bind(*args, **kwargs)
    defaults = {
        key: param.default
        for key, param in signature.parameters.items()
        if param.default is not inspect.Parameter.empty
    }
    return _options(FUNCTIONAL[function], f"F.{function.__name__}", dict(bound.arguments), defaults)


def loss_of(options: LossOptions) -> Loss:
    """The shipped loss that computes what ``options`` say (its sum, and its count: items weighted
    by their class weight, ignored targets not counted); one it cannot say refused by name.

    Args:
        options: what the run's torch loss says (:func:`options_of_criterion`, :func:`options_of_call`).

    Returns:
        An :class:`MSE` or a :class:`CrossEntropy` with those options.

    Raises:
        ValueError: ``options`` are of a torch loss equiv ships nothing for (family ``"unmapped"``).
    """
    if options.family == "unmapped":
        raise ValueError(
            f"criterion={options.written}: equiv ships no loss that computes it (the audit derives one "
            f"from {_MAPPED}); pass loss=<an equiv.Loss offering sum(output, targets) and count(targets)>"
        )
    if options.family == "mse":
        return MSE()
    return CrossEntropy(
        weight=options.weight, ignore_index=options.ignore_index, label_smoothing=options.label_smoothing
    )


def disagreement(loss: Any, options: LossOptions) -> str | None:
    """How ``loss`` (the one the audit was named) differs from what the run's torch loss computes,
    in words, or None when they agree (or ``loss`` is not a shipped loss whose options can be read).

    Args:
        loss: the loss the audit was named (``loss=``).
        options: what the run's torch loss says.

    Returns:
        The differences in words (``"label_smoothing 0 against 0.1"``), or None.
    """
    families = {
        MSE: "mse",
        CrossEntropy: "cross_entropy",
        TokenCrossEntropy: "cross_entropy",
        NextTokenCrossEntropy: "cross_entropy",
    }
    family = families.get(type(loss))
    if family is None:
        return None
    if options.family == "unmapped":
        return f"{options.written} is not a loss {loss!r} computes"
    if family != options.family:
        return f"the one is {family.replace('_', '-')}, the other {options.family.replace('_', '-')}"
    if family == "mse":
        return None
    differ = []
    if float(loss.label_smoothing) != options.label_smoothing:
        differ.append(f"label_smoothing {loss.label_smoothing:g} against {options.label_smoothing:g}")
    ignore = -100 if loss.ignore_index is None else loss.ignore_index
    if ignore != options.ignore_index:
        differ.append(f"ignore_index {ignore} against {options.ignore_index}")
    mine, theirs = loss.weight, options.weight
    if (mine is None) != (theirs is None) or (
        mine is not None
        and theirs is not None
        and (
            mine.shape != theirs.shape or not torch.equal(mine.detach().cpu().double(), theirs.detach().cpu().double())
        )
    ):
        differ.append(
            f"class weights {'none' if mine is None else 'given'} against "
            f"{'none' if theirs is None else 'others' if mine is not None else 'given'}"
        )
    return "; ".join(differ) or None

"""What a search draws from: :class:`SearchSpace`, the one type for a search's settings.

``equiv verify``'s flags, :func:`equiv.verify`'s ``space``, the ``search``
entry of a result's JSON and the "this search" replay line are all this one
value, so a setting cannot be renamed or dropped on the way from the shell to
the strategy and back.  :func:`cases_for` turns it (or any
:func:`equiv.strategies.cases` keywords) into cases that apply to one step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
from hypothesis.errors import InvalidArgument
from hypothesis.strategies import SearchStrategy

from equiv.cases import strategies as eqst
from equiv.cases.case import Case
from equiv.judging.contract import BoundCandidate, Candidate, bind

__all__ = ["AUTOCAST_DTYPES", "SearchSpace", "cases_for"]

#: The dtypes ``torch.autocast`` lowers a case's forward to (:attr:`equiv.Case.autocast`).
AUTOCAST_DTYPES = ("float16", "bfloat16")


@dataclass(frozen=True)
class SearchSpace:
    """The filters of a search (each an ``equiv verify`` flag of the same name).

    Empty name lists mean "all"; the strategy (:func:`equiv.strategies.cases`)
    validates the names when the search starts."""

    #: Model families (:data:`equiv.strategies.MODEL_FAMILIES`); empty: all.
    families: tuple[str, ...] = ()
    #: Optimizers (:data:`equiv.strategies.OPTIMIZERS`); empty: all.
    optimizers: tuple[str, ...] = ()
    #: Losses by name; empty: the sample-mean losses (and the token loss with ``item_weighted``).
    losses: tuple[str, ...] = ()
    #: Also draw the token-level (item-weighted) loss.
    item_weighted: bool = False
    #: Also draw BatchNorm and dropout models (their cases are counted and skipped, not failed).
    allow_inherent: bool = False
    #: Bounds on the batch and the micro-batch count (None: the strategy's defaults).
    max_batch_size: int | None = None
    max_micro_batches: int | None = None
    #: Where the runs happen.
    device: str = "cpu"
    #: Every drawn case's forward under ``torch.autocast`` to this dtype ("float16" or
    #: "bfloat16"; :attr:`equiv.Case.autocast`).  None: none, unless the step enters one itself,
    #: which :func:`equiv.check` sees and judges each case in.
    autocast: str | None = None

    def __post_init__(self) -> None:
        for name in ("families", "optimizers", "losses"):
            value = getattr(self, name)
            if isinstance(value, str):
                raise InvalidArgument(f"{name} must be a sequence of names, got the string {value!r}")
            object.__setattr__(self, name, tuple(value or ()))
        if isinstance(self.autocast, torch.dtype):  # torch.bfloat16 as Case takes it
            object.__setattr__(self, "autocast", str(self.autocast).removeprefix("torch."))
        if self.autocast not in (None, *AUTOCAST_DTYPES):
            raise InvalidArgument(f"autocast must be one of {AUTOCAST_DTYPES} or None, got {self.autocast!r}")

    def strategy(self, candidate: Candidate | BoundCandidate) -> SearchStrategy[Case]:
        """The cases this space holds that apply to ``candidate`` (:func:`cases_for`)."""
        drawn = cases_for(
            candidate,
            families=self.families or None,
            optimizer_names=self.optimizers or None,
            loss_names=self.losses or None,
            # Naming a token-level loss is asking for item-weighted cases.
            item_weighted=self.item_weighted or any(loss in eqst.ITEM_WEIGHTED_LOSSES for loss in self.losses),
            allow_batchnorm=self.allow_inherent,
            allow_dropout=self.allow_inherent,
            max_batch_size=self.max_batch_size,
            max_micro_batches=self.max_micro_batches,
            devices=(self.device,),
        )
        if self.autocast is None:
            return drawn
        autocast = self.autocast
        return drawn.map(lambda case: dataclasses.replace(case, autocast=autocast))

    def flags(self) -> list[str]:
        """The ``equiv verify`` flags that ask for this space (defaults left out)."""
        out = []
        for item in fields(self):
            value, default = getattr(self, item.name), item.default
            flag = "--" + item.name.replace("_", "-")
            if value == default:
                continue
            if isinstance(value, bool):
                out.append(flag)
            elif isinstance(value, tuple):
                out.append(f"{flag} {','.join(value)}")
            else:
                out.append(f"{flag} {value}")
        return out

    def to_dict(self) -> dict[str, Any]:
        return {key: list(value) if isinstance(value, tuple) else value for key, value in asdict(self).items()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SearchSpace:
        known = {item.name for item in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise InvalidArgument(f"unknown search settings {unknown}; expected some of {sorted(known)}")
        return cls(**data)


def cases_for(candidate: Candidate | BoundCandidate, **kwargs: Any) -> SearchStrategy[Case]:
    """Return a strategy for cases that apply to ``candidate``: :func:`equiv.strategies.cases`
    with ``kwargs``, drawing a clip norm only if the step takes ``max_grad_norm``, an
    LR scheduler only if it takes ``scheduler`` and a loss scale only if it takes ``grad_scaler``.

    The route for your own ``@given`` tests: a case the step cannot be told about
    (a clip norm for a step that cannot clip) says nothing about it, so it is never
    drawn, and a search never shrinks to one::

        @given(equiv.strategies.cases_for(my_step))
        def test_my_step(case):
            equiv.check(my_step, case).assert_ok()

    Defaults: ``clipping`` every mode of :data:`~equiv.strategies.CLIPPING` if the
    step takes ``max_grad_norm`` (else "none" only), ``schedulers`` all of
    :data:`~equiv.strategies.SCHEDULERS` (None among them) if it takes ``scheduler`` (else
    none only), ``loss_scaling`` every regime of :data:`~equiv.strategies.LOSS_SCALING` if it
    takes ``grad_scaler`` (else "none" only).  Asking for a clip mode, a scheduler or a
    loss scale the step cannot take raises ``InvalidArgument``.  Shrinks as
    :func:`equiv.strategies.cases` does.
    """
    bound = bind(candidate)
    _default_or_refuse(bound, kwargs, "clipping", "max_grad_norm", tuple(eqst.CLIPPING), ("none",))
    _default_or_refuse(bound, kwargs, "schedulers", "scheduler", tuple(eqst.SCHEDULERS), (None,))
    _default_or_refuse(bound, kwargs, "loss_scaling", "grad_scaler", eqst.LOSS_SCALING, ("none",))
    return eqst.cases(**kwargs)


def _default_or_refuse(
    bound: BoundCandidate, kwargs: dict[str, Any], option: str, keyword: str, every: Sequence[Any], only_off: tuple[Any]
) -> None:
    """``kwargs[option]`` defaults to ``every`` choice for a step that takes ``keyword``
    (all but "off" for a step that requires it: a case without it cannot call the step);
    for one that does not, only the "off" choice is drawn and anything else is refused."""
    if keyword in bound.required:
        kwargs.setdefault(option, tuple(choice for choice in every if choice not in only_off))
    elif bound.takes(keyword):
        kwargs.setdefault(option, every)
    elif set(kwargs.setdefault(option, only_off)) != set(only_off):
        raise InvalidArgument(
            f"{option} must be {only_off!r} for {bound.name}, which takes no {keyword}, "
            f"but was {tuple(kwargs[option])!r}"
        )

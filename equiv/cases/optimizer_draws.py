"""The hyperparameters each ``torch.optim`` optimizer is drawn with (:func:`equiv.strategies.optimizers`).

One strategy per optimizer of :data:`equiv.strategies.OPTIMIZERS`, ranging widely on purpose (learning rates over
decades, eps up to 1, betas without momentum) and shrinking toward plain settings.
"""

from __future__ import annotations

import math
from typing import Any

from hypothesis import strategies as st

__all__ = ["optimizer_kwargs"]


def _log_uniform(low: float, high: float) -> st.SearchStrategy[float]:
    """Floats spread evenly in log space, rounded to 2 significant digits (readable)."""
    return st.floats(math.log10(low), math.log10(high)).map(lambda e: float(f"{10**e:.2g}"))


# eps from the default up to 1: a large eps breaks Adam's invariance to the
# gradient's scale, so an unscaled gradient shows in the update.
_EPS = st.sampled_from([1e-8, 1e-3, 0.1, 1.0])
_WEIGHT_DECAY = st.sampled_from([0.0, 1e-2, 0.1])
_BETAS = st.sampled_from([(0.9, 0.999), (0.5, 0.9), (0.0, 0.99)])


def _sgd() -> st.SearchStrategy[dict[str, Any]]:
    @st.composite
    def draw(draw: st.DrawFn) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"lr": draw(_log_uniform(1e-3, 0.3))}
        momentum = draw(st.sampled_from([0.0, 0.9, 0.5]))
        if momentum:
            kwargs["momentum"] = momentum
            if draw(st.booleans()):
                kwargs["nesterov"] = True  # needs dampening 0
            else:
                kwargs["dampening"] = draw(st.sampled_from([0.0, 0.3]))
        kwargs["weight_decay"] = draw(_WEIGHT_DECAY)
        return kwargs

    return draw()


_LR_ADAPTIVE = _log_uniform(1e-4, 1e-1)
_ADAM: dict[str, st.SearchStrategy[Any]] = {
    "lr": _LR_ADAPTIVE,
    "betas": _BETAS,
    "eps": _EPS,
    "weight_decay": _WEIGHT_DECAY,
    "amsgrad": st.booleans(),
}
#: Each optimizer's hyperparameters but SGD's, drawn independently in this order (fixed_dictionaries draws its
#: keys in order: reordering them would change what a seed draws).
_FIELDS: dict[str, dict[str, st.SearchStrategy[Any]]] = {
    "Adam": _ADAM,
    "AdamW": _ADAM,
    "Adamax": {"lr": _LR_ADAPTIVE, "betas": _BETAS, "eps": _EPS, "weight_decay": _WEIGHT_DECAY},
    "NAdam": {
        "lr": _LR_ADAPTIVE,
        "eps": _EPS,
        "weight_decay": _WEIGHT_DECAY,
        "momentum_decay": st.sampled_from([4e-3, 0.1]),
        "decoupled_weight_decay": st.booleans(),
    },
    "RAdam": {"lr": _LR_ADAPTIVE, "eps": _EPS, "weight_decay": _WEIGHT_DECAY, "decoupled_weight_decay": st.booleans()},
    "RMSprop": {
        "lr": _LR_ADAPTIVE,
        "alpha": st.sampled_from([0.99, 0.5]),
        "eps": _EPS,
        "momentum": st.sampled_from([0.0, 0.9]),
        "centered": st.booleans(),
        "weight_decay": _WEIGHT_DECAY,
    },
    "Adagrad": {
        "lr": _log_uniform(1e-3, 0.3),
        "lr_decay": st.sampled_from([0.0, 0.1]),
        "eps": _EPS,
        "initial_accumulator_value": st.sampled_from([0.0, 0.1]),
        "weight_decay": _WEIGHT_DECAY,
    },
    "Adadelta": {
        "lr": _log_uniform(0.1, 1.0),
        "rho": st.sampled_from([0.9, 0.5]),
        "eps": st.sampled_from([1e-6, 1e-3, 0.1]),
        "weight_decay": _WEIGHT_DECAY,
    },
    # t0=1: the running average "ax" starts at the first step, so it is
    # compared too (the default t0 of 1e6 never starts it).
    "ASGD": {
        "lr": _log_uniform(1e-3, 0.3),
        "lambd": st.sampled_from([1e-4, 1e-2]),
        "alpha": st.sampled_from([0.75, 0.5]),
        "t0": st.sampled_from([1e6, 1.0]),
        "weight_decay": _WEIGHT_DECAY,
    },
    # Factored second moments for tensors of 2+ dims; eps1 None: the dtype's eps.
    "Adafactor": {
        "lr": _log_uniform(1e-3, 1e-1),
        "beta2_decay": st.sampled_from([-0.8, -0.5]),
        "eps": st.sampled_from([(None, 1e-3), (1e-3, 1e-3)]),
        "d": st.sampled_from([1.0, 2.0]),
        "weight_decay": _WEIGHT_DECAY,
    },
    "Rprop": {
        "lr": _log_uniform(1e-4, 1e-1),
        "etas": st.sampled_from([(0.5, 1.2), (0.3, 1.5)]),
        "step_sizes": st.sampled_from([(1e-6, 50.0), (1e-4, 1.0)]),
    },
    # Nesterov or not, the RMS-matching lr adjustment or the default, decoupled decay.
    "Muon": {
        "lr": _log_uniform(1e-3, 1e-1),
        "momentum": st.sampled_from([0.95, 0.0]),
        "nesterov": st.booleans(),
        "weight_decay": st.sampled_from([0.0, 0.1]),
        "adjust_lr_fn": st.sampled_from([None, "match_rms_adamw"]),
    },
}


def optimizer_kwargs(name: str) -> st.SearchStrategy[dict[str, Any]]:
    """The hyperparameters optimizer ``name`` is drawn with: SGD's depend on one another (Nesterov needs
    momentum and no dampening); every other optimizer's are drawn one after another from :data:`_FIELDS`."""
    return _sgd() if name == "SGD" else st.fixed_dictionaries(_FIELDS[name])

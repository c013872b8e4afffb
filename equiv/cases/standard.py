"""A fixed set of named cases: the quick, deterministic check before a search.

Each one targets a way accumulation goes wrong (uneven splits, item-weighted
losses, clipping, adaptive optimizers, leaks across steps, an LR scheduler and a
composite schedule, coupled weight decay, parameter groups with active clipping
(no decay on biases, a head at its own lr, a layer parked at lr = 0), frozen
layers (the bottom, a middle one), more than 8 and more than 32 micro-batches,
Muon, dynamic loss scaling with growth and with an overflowing window);
``equiv check`` runs them and the equivalence report tabulates them.
"""

from __future__ import annotations

from equiv.cases.case import Case

__all__ = ["STANDARD_CASES", "TOY_CASE"]

#: The Accelerate guide's toy case: x = 1..8, y = 2x, w = 0, MSE, SGD lr 0.02,
#: 4 micro-batches of 2.  Full batch and accumulation both end at w = 2.04.
TOY_CASE = Case(
    batch_size=8,
    micro_batch_sizes=(2, 2, 2, 2),
    model="scalar_linear",
    data="toy_2x",
    optimizer="SGD",
    optimizer_kwargs={"lr": 0.02},
    steps=1,
)

_MLP = {"hidden": (8, 8), "activation": "tanh"}

STANDARD_CASES: dict[str, Case] = {
    "toy 2.04, 4 x 2": TOY_CASE,
    "toy 2.04, uneven 1+3+4": TOY_CASE.replace(micro_batch_sizes=[1, 3, 4]),
    "SGD momentum, even 4 x 4": Case(
        batch_size=16,
        micro_batch_sizes=(4, 4, 4, 4),
        model_kwargs=_MLP,
        optimizer="SGD",
        optimizer_kwargs={"lr": 0.1, "momentum": 0.9},
        steps=3,
    ),
    "SGD momentum, uneven 1+5+10": Case(
        batch_size=16,
        micro_batch_sizes=(1, 5, 10),
        model_kwargs=_MLP,
        optimizer="SGD",
        optimizer_kwargs={"lr": 0.1, "momentum": 0.9},
        steps=3,
    ),
    "Adam, uneven 1+2": Case(
        batch_size=3,
        micro_batch_sizes=(1, 2),
        model_kwargs=_MLP,
        optimizer="Adam",
        optimizer_kwargs={"lr": 1e-2},
        steps=3,
    ),
    "AdamW, short tail 7+7+2": Case(
        batch_size=16,
        micro_batch_sizes=(7, 7, 2),
        model_kwargs=_MLP,
        loss="cross_entropy",
        optimizer="AdamW",
        optimizer_kwargs={"lr": 1e-3, "weight_decay": 0.1},
        steps=3,
    ),
    "SGD, active clipping 3+5": Case(
        batch_size=8,
        micro_batch_sizes=(3, 5),
        model_kwargs=_MLP,
        optimizer="SGD",
        optimizer_kwargs={"lr": 0.1},
        max_grad_norm=0.05,
        steps=3,
    ),
    "SGD, 16 micro-batches of 1": Case(
        batch_size=16,
        micro_batch_sizes=(1,) * 16,
        model_kwargs=_MLP,
        optimizer="SGD",
        optimizer_kwargs={"lr": 0.1},
        steps=2,
    ),
    "Adam, token loss with padding 2+3": Case(
        batch_size=5,
        micro_batch_sizes=(2, 3),
        model="token_mlp",
        loss="token_cross_entropy",
        optimizer="Adam",
        optimizer_kwargs={"lr": 1e-2},
        steps=3,
    ),
    # The settings people run at scale, each in a small case of its own.
    "SGD momentum, StepLR scheduler 2+3": Case(
        batch_size=5,
        micro_batch_sizes=(2, 3),
        model_kwargs=_MLP,
        optimizer="SGD",
        optimizer_kwargs={"lr": 0.1, "momentum": 0.9},
        scheduler="StepLR",
        scheduler_kwargs={"step_size": 1, "gamma": 0.5},
        steps=3,
    ),
    "Adam, coupled weight decay 2+2+3": Case(
        batch_size=7,
        micro_batch_sizes=(2, 2, 3),
        model_kwargs=_MLP,
        optimizer="Adam",
        optimizer_kwargs={"lr": 1e-2, "weight_decay": 0.1},
        steps=3,
    ),
    # LayerNorm: norm weights for the no-decay group; a clip norm the gradient exceeds.
    "SGD, two param groups (no decay on biases and norms), clipped 3+5": Case(
        batch_size=8,
        micro_batch_sizes=(3, 5),
        model_kwargs={**_MLP, "norm": "layer"},
        optimizer="SGD",
        optimizer_kwargs={"lr": 0.1, "momentum": 0.9, "weight_decay": 0.1},
        param_groups="no_decay",
        max_grad_norm=0.05,
        steps=3,
    ),
    "AdamW, first layer frozen 2+4": Case(
        batch_size=6,
        micro_batch_sizes=(2, 4),
        model_kwargs=_MLP,
        frozen_layers=1,
        optimizer="AdamW",
        optimizer_kwargs={"lr": 1e-3, "weight_decay": 0.1},
        steps=3,
    ),
    "SGD momentum, 16 micro-batches 15 x 2 + 3": Case(
        batch_size=33,
        micro_batch_sizes=(2,) * 15 + (3,),
        model_kwargs={"hidden": (8,)},
        optimizer="SGD",
        optimizer_kwargs={"lr": 0.1, "momentum": 0.9},
        steps=2,
    ),
    # More micro-batches than any fixed buffer of 16 or 32 holds: a ring that drops
    # the earliest pieces from the 17th or 33rd on shows only here.
    "SGD momentum, 33 micro-batches 32 x 1 + 2": Case(
        batch_size=34,
        micro_batch_sizes=(1,) * 32 + (2,),
        model_kwargs={"hidden": (8,)},
        optimizer="SGD",
        optimizer_kwargs={"lr": 0.1, "momentum": 0.9},
        steps=2,
    ),
    # Groups as people run them: the head at its own lr under an adaptive optimizer with an
    # active clip, and a first layer parked at lr = 0 whose gradient still counts in the norm.
    "AdamW, head at its own lr, clipped 1+4": Case(
        batch_size=5,
        micro_batch_sizes=(1, 4),
        model_kwargs=_MLP,
        optimizer="AdamW",
        optimizer_kwargs={"lr": 1e-2, "weight_decay": 0.1},
        param_groups="head_lr",
        max_grad_norm=0.05,
        steps=3,
    ),
    "SGD momentum, first layer parked at lr 0, clipped 2+3": Case(
        batch_size=5,
        micro_batch_sizes=(2, 3),
        model_kwargs=_MLP,
        optimizer="SGD",
        optimizer_kwargs={"lr": 0.1, "momentum": 0.9},
        param_groups="parked",
        max_grad_norm=0.05,
        steps=3,
    ),
    # A frozen middle layer with a trainable one below it (not a frozen bottom).
    "Adam, frozen middle layer 2+3": Case(
        batch_size=5,
        micro_batch_sizes=(2, 3),
        model_kwargs=_MLP,
        frozen_layers=(1,),
        optimizer="Adam",
        optimizer_kwargs={"lr": 1e-2},
        steps=3,
    ),
    # Muon: 2-D weights only (a bias-free MLP); its Newton-Schulz iteration rounds in bfloat16.
    "Muon, bias-free MLP 1+3": Case(
        batch_size=4,
        micro_batch_sizes=(1, 3),
        model_kwargs={**_MLP, "bias": False},
        optimizer="Muon",
        optimizer_kwargs={"lr": 0.02},
        steps=3,
    ),
    # The LLM recipe's schedule: linear warm-up, then cosine decay (a composite).
    "AdamW, warm-up then cosine (SequentialLR) 1+4": Case(
        batch_size=5,
        micro_batch_sizes=(1, 4),
        model_kwargs=_MLP,
        optimizer="AdamW",
        optimizer_kwargs={"lr": 1e-2, "weight_decay": 0.1},
        scheduler="SequentialLR",
        steps=3,
        scheduler_kwargs={
            "schedulers": [["LinearLR", {"start_factor": 0.25, "total_iters": 1}], ["CosineAnnealingLR", {"T_max": 2}]],
            "milestones": [1],
        },
    ),
    # Dynamic loss scaling (for steps that take a grad_scaler; not applicable to
    # the others).  Clean windows, the scale doubling after each, and a clip
    # norm the unscaled gradient exceeds: unscaling (once) must come first.
    "SGD momentum, loss scale 2**10 growing, clipped 2+3": Case(
        batch_size=5,
        micro_batch_sizes=(2, 3),
        model_kwargs=_MLP,
        optimizer="SGD",
        optimizer_kwargs={"lr": 0.1, "momentum": 0.9},
        max_grad_norm=0.05,
        loss_scale=2.0**10,
        scale_growth_interval=1,
        steps=3,
    ),
    # Window 1 of 3 overflows in its middle micro-batch: skipped whole, the
    # scale backed off once, the scheduler not stepped for it.
    "Adam, loss scale 2**8, window 1 of 3 overflows, cosine 1+2+3": Case(
        batch_size=6,
        micro_batch_sizes=(1, 2, 3),
        model_kwargs=_MLP,
        optimizer="Adam",
        optimizer_kwargs={"lr": 1e-2},
        scheduler="CosineAnnealingLR",
        scheduler_kwargs={"T_max": 3},
        loss_scale=2.0**8,
        overflow_at=(1, 2),
        steps=3,
    ),
}

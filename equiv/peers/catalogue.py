"""The peers: who is measured, in which situations, and what is known upstream.

- :func:`peers`: accumulation people use (nanoGPT's loop, the MindSpore tutorials'
  patterns, Accelerate, Lightning), each built through its adapter
  (:mod:`equiv.adapters`); :func:`own`: equiv's own loops, reference points;
- :data:`CONFIGURATIONS`: one window per call (the candidate contract, a fixed case each);
- :data:`EPOCH_RUNS`: one run of the library over whole epochs;
- :data:`TRAINER_RUNS`: one ``Trainer.train()`` over padded token sequences;
- :data:`KNOWN`: the upstream reports of non-equivalence, and how this package knows each.

The optional frameworks are imported only when installed (:func:`not_measured`
says which are missing, naming the package).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from equiv.accumulator import accumulator_step
from equiv.adapters import (
    MindSporeAccumulator,
    MindSporeAccuStepsWithLossScale,
    MindSporeGradAccumulation,
    MindSporeGradientAccumulation,
    textbook_step,
    torchtitan_step,
)
from equiv.cases.case import Case
from equiv.peers.runs import EpochRun, TokenRun

__all__ = [
    "CONFIGURATIONS",
    "EPOCH_RUNS",
    "KNOWN",
    "SHORT",
    "TRAINER_RUNS",
    "Peer",
    "not_measured",
    "own",
    "peers",
    "versions",
]

_MLP = {"hidden": (8,), "activation": "tanh"}
_EVEN = Case(
    batch_size=12,
    micro_batch_sizes=(4, 4, 4),
    model_kwargs=_MLP,
    optimizer="SGD",
    optimizer_kwargs={"lr": 0.1},
    steps=2,
)

#: column -> the fixed case that configuration runs, one window per call.
CONFIGURATIONS: dict[str, Case] = {
    "equal splits, SGD": _EVEN,
    "equal splits, Adam": _EVEN.replace(optimizer="Adam", optimizer_kwargs={"lr": 1e-2}),
    "uneven splits 1+4+7": _EVEN.replace(micro_batch_sizes=[1, 4, 7]),
    "token loss, causal LM, equal splits": Case(
        batch_size=6,
        micro_batch_sizes=(2, 2, 2),
        model="causal_lm",
        loss="token_cross_entropy",
        optimizer="AdamW",
        optimizer_kwargs={"lr": 1e-3},
        steps=2,
    ),
    "clipping (active), equal splits": _EVEN.replace(max_grad_norm=0.01),
    # Dynamic loss scaling, the first micro-batch of step 1 overflowing: the whole window must be
    # skipped and the scale backed off once (step 2 runs at the halved scale).  Only a peer that
    # takes a grad_scaler can be asked; for the others the column is n/a.
    "loss scale, overflow in micro-batch 1 of 3": _EVEN.replace(loss_scale=2.0**10, overflow_at=(1, 0), steps=3),
}


def _epoch(micro_batches: int, n: int, epochs: int = 1) -> EpochRun:
    # Equal micro-batches of 2 samples: every failure left is about windows, not weighting.
    case = _EVEN.replace(batch_size=2 * micro_batches, micro_batch_sizes=(2,) * micro_batches, steps=1)
    return EpochRun(case, n, epochs)


_UNEVEN_TOKENS = ((8, 2), (3, 3), (8, 8), (5, 2), (8, 4), (2, 2), (6, 7))
_EQUAL_TOKENS = ((5, 5),) * 7

#: column -> one ``Trainer.train()`` over padded token sequences (transformers rows).
TRAINER_RUNS: dict[str, TokenRun] = {
    "uneven token counts, one window: 3 micro-batches, N=3": TokenRun(_UNEVEN_TOKENS[:3], 3),
    "uneven token counts, tail of a long epoch: 7 micro-batches, N=3": TokenRun(_UNEVEN_TOKENS, 3),
    "equal token counts, tail of a long epoch: 7 micro-batches, N=3": TokenRun(_EQUAL_TOKENS, 3),
    "equal token counts, epoch shorter than N: 2 micro-batches, N=3, 2 epochs": TokenRun(_EQUAL_TOKENS[:2], 3, 2),
}

#: column -> one run of the library over whole epochs (one DataLoader / one fit).
EPOCH_RUNS: dict[str, EpochRun] = {
    "mid-epoch windows: 9 micro-batches, N=3": _epoch(9, 3),
    "tail of a long epoch: 7 micro-batches, N=3 (Lightning #19987)": _epoch(7, 3),
    "epoch shorter than N: 2 micro-batches, N=3, 2 epochs (Lightning #21808)": _epoch(2, 3, 2),
    "epoch boundary: 7 micro-batches, N=3, 2 epochs": _epoch(7, 3, 2),
}

#: situation -> its name in the table read at a glance
SHORT: dict[str, str] = {
    "equal splits, SGD": "equal, SGD",
    "equal splits, Adam": "equal, Adam",
    "uneven splits 1+4+7": "uneven 1+4+7",
    "token loss, causal LM, equal splits": "token loss",
    "clipping (active), equal splits": "clipping",
    "loss scale, overflow in micro-batch 1 of 3": "loss scale, overflow",
    "mid-epoch windows: 9 micro-batches, N=3": "run: mid-epoch",
    "tail of a long epoch: 7 micro-batches, N=3 (Lightning #19987)": "run: epoch tail",
    "epoch shorter than N: 2 micro-batches, N=3, 2 epochs (Lightning #21808)": "run: epoch < N",
    "epoch boundary: 7 micro-batches, N=3, 2 epochs": "run: 2 epochs",
    "uneven token counts, one window: 3 micro-batches, N=3": "train(): uneven tokens",
    "uneven token counts, tail of a long epoch: 7 micro-batches, N=3": "train(): uneven tokens, tail",
    "equal token counts, tail of a long epoch: 7 micro-batches, N=3": "train(): equal tokens, tail",
    "equal token counts, epoch shorter than N: 2 micro-batches, N=3, 2 epochs": "train(): epoch < N",
}


@dataclass(frozen=True)
class Peer:
    name: str
    #: builds the candidate; ``configured_n`` is the accumulation steps the user
    #: configured (None: the window's own count, under the contract).
    build: Callable[[int | None], Callable[..., Any]]
    drives: str
    #: the library's own driver over whole epochs (None: it has no epoch loop to drive)
    epochs: Callable[[int], Any] | None = None
    documented: str = ""
    family: str = ""
    #: kind of failure -> the upstream report it matches, named in the cell
    issues: dict[str, str] = field(default_factory=dict)


def peers() -> list[Peer]:
    """The peers to report; optional frameworks only when installed."""
    return [*_tutorial_loops(), *_accelerate(), *_lightning()]


def _tutorial_loops() -> list[Peer]:
    """nanoGPT's loop and the MindSpore tutorials' accumulators, ported (always reported)."""
    return [
        Peer(
            "nanoGPT's loop: loss / N",
            lambda n: textbook_step,
            "nanoGPT train.py's loop",
            family="nanoGPT",
            documented="exact only for equal micro-batches of a sample mean (train.py: loss / gradient_accumulation_steps)",
        ),
        Peer(
            "MindSpore r1.3 GradientAccumulation (port)",
            lambda n: MindSporeGradientAccumulation(n),
            "MindSpore r1.0/r1.3 tutorial: grad_sum, TrainOptim, TrainClear, mini_steps",
            issues={"window boundary": "k restarts each epoch, grad_sum is kept"},
            epochs=lambda n: MindSporeGradientAccumulation(n),
            family="MindSpore tutorial ports",
            documented="the tutorial adds gradients of mean losses with no division by mini_steps",
        ),
        Peer(
            "MindSpore r1.3 parallel-mode loss-scale cell (port)",
            lambda n: MindSporeAccuStepsWithLossScale(n),
            "MindSpore r1.3 tutorial, parallel mode: TrainAccuStepsWithLossScaleCell, accu_overflow ORed, Model_ACCU",
            family="MindSpore tutorial ports",
            documented="accu_grads summed with sens = the loss scale, no division by grad_accumulation_step",
        ),
        Peer(
            "MindSpore 2.0 Accumulator (port)",
            lambda n: MindSporeAccumulator(n),
            "MindSpore 2.0 notebook: inner_grads, counter, loss / accumulate_step",
            epochs=lambda n: MindSporeAccumulator(n),
            family="MindSpore tutorial ports",
        ),
        Peer(
            "MindSpore r2.6 GradAccumulation (port)",
            lambda n: MindSporeGradAccumulation(n),
            "MindSpore v2.6.0: GradAccumulation(net, micro_size), Model.train (_TrainGradAccuStepCell; "
            "_TrainGradAccuWithLossScaleCell with a loss scale)",
            family="MindSpore tutorial ports",
            documented="re-slices the batch into micro_size equal slices; sens 1 / micro_size, but none under "
            "loss scaling",
        ),
    ]


def _accelerate() -> list[Peer]:
    """Accelerate's accumulate() with and without dataloader sync, and its guide's
    variable-size recipe (none when Accelerate is not installed)."""
    try:
        from equiv.adapters.accelerate import AccelerateStep, AccelerateVariableSizeStep

        version = importlib.metadata.version("accelerate")
        return [
            Peer(
                f"Accelerate {version}: accumulate()",
                lambda n: AccelerateStep(n),
                "Accelerator(gradient_accumulation_steps=N), accumulate(), backward()",
                epochs=lambda n: AccelerateStep(n),
                family="Accelerate",
                issues={"tail divided by N": "accelerate #1847"},
                documented="backward() divides by N; the end of the DataLoader closes a window (accelerate #1847)",
            ),
            Peer(
                f"Accelerate {version}: accumulate(), sync_with_dataloader=False",
                lambda n: AccelerateStep(n, sync_with_dataloader=False),
                "GradientAccumulationPlugin(num_steps=N, sync_with_dataloader=False)",
                epochs=lambda n: AccelerateStep(n, sync_with_dataloader=False),
                family="Accelerate",
            ),
            Peer(
                f"Accelerate {version}: variable-size recipe",
                lambda n: AccelerateVariableSizeStep(n),
                "the guide's recipe: num_items_in_batch per window, loss * N, backward(), step",
                epochs=lambda n: AccelerateVariableSizeStep(n),
                family="Accelerate",
                documented="the guide's answer to mean-of-means for samples of variable size (accelerate #3193)",
            ),
        ]
    except ImportError:
        return []


def _lightning() -> list[Peer]:
    """Lightning's Trainer(accumulate_grad_batches=N) (none when it is not installed)."""
    try:
        from equiv.adapters.lightning import LightningStep

        version = importlib.metadata.version("pytorch-lightning")
        return [
            Peer(
                f"Lightning {version}",
                lambda n: LightningStep(n),
                "Trainer(accumulate_grad_batches=N)",
                epochs=lambda n: LightningStep(n),
                family="Lightning",
                issues={"tail divided by N": "Lightning #19987, #21808", "mean of means": "Lightning #20350"},
                documented="mean of per-batch means (Lightning #20350); tail divided by N (#19987)",
            )
        ]
    except ImportError:
        return []


def own() -> list[Peer]:
    """equiv's own loops: reference points, not peers (they call equiv's helpers)."""
    return [
        Peer("equiv.Accumulator", lambda n: accumulator_step, "equiv (this repository)"),
        Peer(
            "equiv's loop in torchtitan's style",
            lambda n: torchtitan_step,
            "equiv.losses helpers, normalised by the window's item count as torchtitan does; not torchtitan's code",
        ),
    ]


#: (repository, issue or PR, one line, how this report knows it)
KNOWN: tuple[tuple[str, str, str, str], ...] = (
    (
        "huggingface/accelerate",
        "#1847",
        "the GradientState follows the DataLoader by default: its end closes a "
        "window of fewer than N batches, still divided by N",
        "measured: tail column, Accelerate accumulate()",
    ),
    (
        "huggingface/accelerate",
        "#1970, #3877, #3780",
        "under DeepSpeed, backward() leaves the division by N to DeepSpeed's engine",
        "quoted (needs DeepSpeed; not run here)",
    ),
    (
        "huggingface/transformers",
        "PR #34191",
        "the 2024 fix: the Trainer counts the window's tokens and passes "
        "num_items_in_batch to the model's loss; before it, a mean of per-micro-batch token means",
        "measured: the transformers 4.45.2 rows (mean of means) against the 5.x forward(**kwargs) row (equivalent)",
    ),
    (
        "huggingface/transformers",
        "#37766",
        "a model whose loss does not accept num_items_in_batch falls back to the mean of per-micro-batch means",
        "measured: the 5.x row 'model forward without **kwargs'",
    ),
    (
        "huggingface/transformers",
        "PR #46204",
        "num_items_in_batch counted unshifted labels, one token per sequence too many",
        "measured indirectly: 5.x counts shifted labels, so its forward(**kwargs) row is exact",
    ),
    (
        "Lightning-AI/pytorch-lightning",
        "#20350",
        "token losses averaged as a mean of per-batch means",
        "measured: token-loss column, Lightning",
    ),
    (
        "Lightning-AI/pytorch-lightning",
        "#19987",
        "the tail of an epoch is divided by accumulate_grad_batches, not by its own length",
        "measured: tail-of-a-long-epoch column, Lightning",
    ),
    (
        "Lightning-AI/pytorch-lightning",
        "#21808",
        "an epoch shorter than accumulate_grad_batches steps at every epoch end",
        "measured: epoch-shorter-than-N column, Lightning",
    ),
    (
        "huggingface/trl",
        "#2175",
        "FSDP accumulating gradients in 16-bit",
        "quoted (needs FSDP with mixed precision; not run here)",
    ),
)


#: The optional peers and the packages each needs, in the order it imports them
#: (the transformers Trainer refuses to train without accelerate).
_OPTIONAL_PEERS: dict[str, tuple[str, ...]] = {
    "Accelerate": ("accelerate",),
    "Lightning": ("pytorch_lightning",),
    "the transformers Trainer": ("transformers", "accelerate"),
}


def not_measured() -> dict[str, str]:
    """Optional peer -> why this environment cannot run it, naming the package
    that is missing (the report says so rather than leaving its rows out silently)."""
    reasons = {}
    for peer, packages in _OPTIONAL_PEERS.items():
        missing = [package for package in packages if importlib.util.find_spec(package) is None]
        if missing:
            needs = "" if missing[0] == packages[0] else f", which {peer} needs"
            reasons[peer] = f"{missing[0]} is not installed{needs} (pip install equiv[peers])"
    return reasons


def versions() -> dict[str, str]:
    versions = {name: importlib.metadata.version(name) for name in ("torch", "hypothesis")}
    for optional in ("accelerate", "pytorch-lightning", "transformers"):
        try:
            versions[optional] = importlib.metadata.version(optional)
        except importlib.metadata.PackageNotFoundError:
            versions[optional] = "not installed (install the extras: pip install equiv[peers])"
    return versions

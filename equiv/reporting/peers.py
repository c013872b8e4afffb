"""reports/peers.md: what equiv finds in accumulation that people actually use.

One row per implementation, one column per configuration (a fixed case each),
and the smallest counterexample a Hypothesis search finds over sample-mean
cases.  Facts only: where a peer documents the limitation, the row cites it.
Written by ``equiv report peers`` (``tox -e peers``).
"""

from __future__ import annotations

import importlib.metadata
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pandas as pd
from hypothesis import HealthCheck, Phase, find, settings
from hypothesis.errors import NoSuchExample

from equiv.accumulator import accumulator_step
from equiv.cases import strategies
from equiv.cases.case import Case
from equiv.checking.check import check
from equiv.checking.contract import takes_keyword
from equiv.reporting.markdown import markdown_table
from equiv.zoo.adapters import MindSporeAccumulator, MindSporeGradientAccumulation, textbook_step, torchtitan_step

__all__ = ["CONFIGURATIONS", "Peer", "peers", "peers_report", "smallest_counterexample"]

log = logging.getLogger(__name__)

_MLP = {"hidden": (8,), "activation": "tanh"}
_EVEN = Case(batch_size=12, micro_batch_sizes=(4, 4, 4), model_kwargs=_MLP, optimizer="SGD",
             optimizer_kwargs={"lr": 0.1}, steps=2)

#: column -> the fixed case that configuration runs.
CONFIGURATIONS: dict[str, Case] = {
    "equal splits, SGD": _EVEN,
    "equal splits, Adam": _EVEN.replace(optimizer="Adam", optimizer_kwargs={"lr": 1e-2}),
    "uneven splits 1+4+7": _EVEN.replace(micro_batch_sizes=[1, 4, 7]),
    "short tail window: 3 micro-batches, N=4": _EVEN,
    "token loss, causal LM, equal splits": Case(
        batch_size=6, micro_batch_sizes=(2, 2, 2), model="causal_lm", loss="token_cross_entropy",
        optimizer="AdamW", optimizer_kwargs={"lr": 1e-3}, steps=2),
    "clipping (active), equal splits": _EVEN.replace(max_grad_norm=0.01),
}
_TAIL = "short tail window: 3 micro-batches, N=4"


@dataclass(frozen=True)
class Peer:
    name: str
    #: builds the candidate; ``configured_n`` is the accumulation steps the
    #: user configured (None: the window's own count), for the tail column.
    build: Callable[[int | None], Callable[..., Any]]
    drives: str
    #: False when the implementation has no configured N (the tail column is n/a).
    has_configured_n: bool = True
    documented: str = ""


def peers() -> list[Peer]:
    """The implementations to report; optional frameworks only when installed."""
    out = [
        Peer("equiv.Accumulator", lambda n: accumulator_step, "equiv (this repository)", has_configured_n=False),
        Peer("textbook loss / N (nanoGPT)", lambda n: textbook_step, "nanoGPT train.py's loop",
             has_configured_n=False, documented="exact only for equal micro-batches of a sample mean (nanoGPT train.py: loss / gradient_accumulation_steps)"),
        Peer("torchtitan-style item-normalised", lambda n: torchtitan_step, "torchtitan's loss / global_valid_tokens",
             has_configured_n=False),
        Peer("MindSpore r1.3 GradientAccumulation (port)", lambda n: MindSporeGradientAccumulation(n),
             "MindSpore r1.0/r1.3 tutorial: grad_sum, TrainOptim, TrainClear, mini_steps",
             documented="the tutorial adds gradients of mean losses, no division by mini_steps (MindSpore r1.0 apply_gradient_accumulation)"),
        Peer("MindSpore 2.0 Accumulator (port)", lambda n: MindSporeAccumulator(n),
             "MindSpore 2.0 notebook: inner_grads, counter, loss / accumulate_step"),
    ]
    try:
        from equiv.zoo.adapters.accelerate import AccelerateStep

        version = importlib.metadata.version("accelerate")
        out += [
            Peer(f"Accelerate {version}", lambda n: AccelerateStep(n),
                 "Accelerator(gradient_accumulation_steps=N), accumulate(), backward()",
                 documented="Accelerator.backward() divides the loss by gradient_accumulation_steps, also in a short tail window"),
            Peer(f"Accelerate {version}, sync_with_dataloader=False",
                 lambda n: AccelerateStep(n, sync_with_dataloader=False),
                 "GradientAccumulationPlugin(num_steps=N, sync_with_dataloader=False)"),
        ]
    except ImportError:
        pass
    try:
        from equiv.zoo.adapters.lightning import LightningStep

        version = importlib.metadata.version("pytorch-lightning")
        out.append(Peer(f"Lightning {version}", lambda n: LightningStep(n), "Trainer(accumulate_grad_batches=N)",
                        documented="short tail divided by N: Lightning #19987"))
    except ImportError:
        pass
    return out


def smallest_counterexample(candidate: Callable[..., Any], *, max_examples: int = 40) -> tuple[Case | None, int]:
    """(the shrunk failing case or None, cases tried) over sample-mean MLP cases."""
    tried = 0

    def fails(case: Case) -> bool:
        nonlocal tried
        tried += 1
        return not check(candidate, case)

    # Only cases the candidate can take: no clipping case for a step that cannot clip.
    clipping = strategies.CLIPPING if takes_keyword(candidate, "max_grad_norm") else ("none",)
    space = strategies.cases(max_batch_size=8, families=["mlp"], optimizer_names=["SGD", "Adam"],
                             loss_names=["mse"], dtypes=["float32"], max_steps=2, clipping=clipping)
    try:
        found = find(space, fails, settings=settings(
            max_examples=max_examples, derandomize=True, database=None, deadline=None,
            phases=[Phase.generate, Phase.shrink], suppress_health_check=list(HealthCheck)))
    except NoSuchExample:
        return None, tried
    return found, tried


def _cell(peer: Peer, column: str, case: Case) -> str:
    if column == _TAIL and not peer.has_configured_n:
        return "n/a (N is the window's own count)"
    candidate = peer.build(4 if column == _TAIL else None)
    verdict = check(candidate, case)
    if verdict:
        return "equivalent"
    if verdict.status == "not_applicable":
        return f"n/a: {'; '.join(verdict.not_applicable)}"
    first = verdict.first_mismatch
    assert first is not None
    return f"NOT equivalent: step {first.step}, {first.label}, {first.max_rel_diff:.2g} relative"


def peers_report() -> str:
    """The markdown of reports/peers.md."""
    rows, searches = [], []
    for peer in peers():
        row: dict[str, str] = {"implementation": peer.name}
        for column, case in CONFIGURATIONS.items():
            row[column] = _cell(peer, column, case)
        rows.append(row)
        found, tried = smallest_counterexample(peer.build(None))
        searches.append({
            "implementation": peer.name,
            "drives": peer.drives,
            "documented limitation": peer.documented or "-",
            "smallest counterexample (Hypothesis, shrunk)": f"`{found!r}`" if found else f"none in {tried} cases",
        })
        log.info("%s: %d search cases", peer.name, tried)
    versions = {name: importlib.metadata.version(name) for name in ("torch", "hypothesis")}
    for optional in ("accelerate", "pytorch-lightning"):
        try:
            versions[optional] = importlib.metadata.version(optional)
        except importlib.metadata.PackageNotFoundError:
            versions[optional] = "not installed (install the extras: pip install equiv[peers])"

    return "\n\n".join([
        "# Peers report",
        "Generated by `tox -e peers` (`equiv report peers`); do not edit by hand. Each implementation runs "
        "under the candidate contract through an adapter in `equiv/adapters/` and is checked against the "
        "full-batch step in both tiers (float64 exact, float32 noise floor).",
        "Versions: " + ", ".join(f"{name} {version}" for name, version in versions.items()) + ".",
        "## Verdicts per configuration",
        "The short-tail column configures N=4 accumulation steps while the window holds 3 micro-batches "
        "(the end of an epoch); relative differences are of the first mismatching tensor.",
        markdown_table(pd.DataFrame(rows)),
        "Cases: " + "; ".join(f"{name}: `{case!r}`" for name, case in CONFIGURATIONS.items()),
        "## Smallest counterexamples",
        "A derandomized Hypothesis search over MLP cases (MSE, SGD or Adam, batches up to 8, any split, "
        "clipping none/inactive/active for implementations that clip), shrunk to the smallest failing case.",
        markdown_table(pd.DataFrame(searches)),
    ]) + "\n"

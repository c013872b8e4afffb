"""How long the searches of issue 37 take, beside the searches they extend, in one run.

``equiv.verify_distributed`` on the reference accumulator (a correct step: every
drawn case runs, none ends the search early) under the context-parallel engines
(``cp``, ``fsdp2+cp``: 1-2 data ranks of 2 slices, the token model) beside DDP
and FSDP2 on the same token model, and on the MoE model (router aux and z-losses)
under DDP; ``equiv.verify`` on the packed-sequence and RL policy losses beside the
default space.  Every search is timed alternately in the same rounds, so they share
the machine's load.  Reported, not asserted (speed targets are not unit tests);
the searches must find nothing (asserted: a search that finds something stops early
and measures something else).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import pytest

import equiv
from equiv.checking.distributed_search import verify_distributed
from equiv.checking.search_space import SearchSpace
from equiv.findings.distributed_findings import CP_MAX_WORLD_SIZE
from equiv.judging.judge import clear_reference_cache

SEED = 0

#: label -> (what it extends, the search's keywords): distributed searches of the accumulator.
DISTRIBUTED: dict[str, tuple[str, dict[str, Any]]] = {
    "DDP, tokens": ("", {"engines": ("ddp",), "models": ("tokens",)}),
    "CP, tokens": ("DDP, tokens", {"engines": ("cp",), "models": ("tokens",), "max_world_size": CP_MAX_WORLD_SIZE}),
    "FSDP2, tokens": ("", {"engines": ("fsdp2",), "models": ("tokens",)}),
    "FSDP2+CP, tokens": (
        "FSDP2, tokens",
        {"engines": ("fsdp2+cp",), "models": ("tokens",), "max_world_size": CP_MAX_WORLD_SIZE},
    ),
    "DDP, MoE (aux + z-loss)": ("DDP, tokens", {"engines": ("ddp",), "models": ("moe",)}),
}
#: label -> (what it extends, the losses searched): single-process searches of the accumulator.
SINGLE: dict[str, tuple[str, tuple[str, ...]]] = {
    "default space": ("", ()),
    "packed_sequence_ce": ("default space", ("packed_sequence_ce",)),
    "packed_dpo": ("default space", ("packed_dpo",)),
    "policy_dapo": ("default space", ("policy_dapo",)),
    "policy_grpo": ("default space", ("policy_grpo",)),
}


def _searches(distributed_examples: int, single_examples: int) -> dict[str, Callable[[], Any]]:
    searches: dict[str, Callable[[], Any]] = {}
    for label, (_, kwargs) in DISTRIBUTED.items():
        searches[f"verify_distributed: {label}"] = lambda kwargs=kwargs: verify_distributed(
            equiv.accumulator_step, max_examples=distributed_examples, seed=SEED, **kwargs
        )
    for label, (_, losses) in SINGLE.items():
        searches[f"verify: {label}"] = lambda losses=losses: equiv.verify(
            equiv.accumulator_step,
            SearchSpace(losses=losses),
            max_examples=single_examples,
            seed=SEED,
            replay_in_fresh_process=False,
        )
    return searches


def _baseline(name: str) -> str:
    kind, label = name.split(": ", 1)
    extends = (DISTRIBUTED if kind == "verify_distributed" else SINGLE)[label][0]  # type: ignore[index]
    return f"{kind}: {extends}" if extends else ""


def test_search_times(benchmark: Any, bench_settings: Any) -> None:
    if bench_settings.device.type != "cpu":
        pytest.skip("the searches run CPU cases (gloo ranks)")
    distributed_examples, single_examples = (5, 20) if bench_settings.quick else (10, 60)
    rounds = 1 if bench_settings.quick else 2
    searches = _searches(distributed_examples, single_examples)
    # The fork server and gloo start once per process: paid here, not by the first search timed.
    verify_distributed(equiv.accumulator_step, engines=("ddp",), models=("mlp",), max_examples=1, seed=SEED)
    seconds: dict[str, list[float]] = {name: [] for name in searches}
    examples: dict[str, int] = {}

    def every_search() -> None:
        for name, search in searches.items():  # alternately in every round: side by side, same load
            clear_reference_cache()
            start = time.perf_counter()
            result = search()
            seconds[name].append(time.perf_counter() - start)
            assert not result.found, result.message()
            examples[name] = result.examples

    benchmark.pedantic(every_search, rounds=rounds, iterations=1, warmup_rounds=0)
    median = {name: statistics.median(values) for name, values in seconds.items()}
    per_case = {name: median[name] / max(examples[name], 1) for name in searches}
    benchmark.extra_info.update(
        bench_settings.extra_info(),
        search_times=True,
        seed=SEED,
        rows=[
            {
                "search": name,
                "cases": examples[name],
                "seconds": median[name],
                "per_case_s": per_case[name],
                "baseline": _baseline(name),
                "ratio": per_case[name] / per_case[_baseline(name)] if _baseline(name) else None,
            }
            for name in searches
        ],
    )

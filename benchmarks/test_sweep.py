"""What ``equiv sweep transformers`` costs per class (issue 45): the CI sample's classes (both verdicts and a
reason row, heads of five families), each built tiny, trained by the Trainer for 3 optimizer steps, 2 of them
audited.  Reported, never asserted as a time; each class's verdict is asserted the same in every round."""

from __future__ import annotations

import statistics
import time
from importlib.metadata import version

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from equiv.cli.sweeps import TRANSFORMERS_SAMPLE
from equiv.peers.transformers_sweep import run_subject, subjects


def test_sweep_cost_per_class(benchmark, bench_settings) -> None:  # type: ignore[no-untyped-def]
    seconds: dict[str, list[float]] = {name: [] for name in TRANSFORMERS_SAMPLE}
    outcomes: dict[str, set[str]] = {name: set() for name in TRANSFORMERS_SAMPLE}
    words: dict[str, str] = {}
    family_of = dict(subjects({"only": TRANSFORMERS_SAMPLE}))

    def one_round() -> None:
        for name in TRANSFORMERS_SAMPLE:
            start = time.perf_counter()
            row = run_subject(name, {"family": family_of[name]})
            seconds[name].append(time.perf_counter() - start)
            outcomes[name].add(row.outcome)
            words[name] = row.verdict  # as a report writes it

    run_subject("LlamaForCausalLM", {"family": family_of["LlamaForCausalLM"]})  # first-use costs paid
    rounds = 2 if bench_settings.quick else 5
    benchmark.pedantic(one_round, rounds=rounds, iterations=1, warmup_rounds=0)
    assert all(len(seen) == 1 for seen in outcomes.values()), outcomes  # a verdict that moved is not a timing
    outcome_of = {name: next(iter(seen)) for name, seen in outcomes.items()}
    assert {"equivalent", "not_equivalent"} <= set(outcome_of.values()), outcome_of
    benchmark.extra_info.update(
        bench_settings.extra_info(),
        sweep_transformers=True,
        rounds=rounds,
        transformers_version=version("transformers"),
        # The whole sweep's size in the installed release: the report projects its time from the medians.
        subjects_installed=len(subjects({})),
        classes={
            name: {"outcome": outcome_of[name], "verdict": words[name], "median_s": statistics.median(times)}
            for name, times in seconds.items()
        },
    )
    print("\nsweep: " + ", ".join(f"{name} {statistics.median(times):.2f} s" for name, times in seconds.items()))

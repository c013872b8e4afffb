"""What ``equiv sweep transformers`` costs per class (issue 45): a 2-class sweep (a head that fails, a causal LM
that passes), each class built tiny, trained by the Trainer for 3 optimizer steps, 2 of them audited.  Reported,
never asserted as a time; the verdicts are asserted (the timed sweep is the one the report shows)."""

from __future__ import annotations

import statistics
import time

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from equiv.peers.transformers_sweep import run_subject

CLASSES = {"GPT2ForTokenClassification": "not_equivalent", "LlamaForCausalLM": "equivalent"}


def test_sweep_cost_per_class(benchmark, bench_settings) -> None:  # type: ignore[no-untyped-def]
    seconds: dict[str, list[float]] = {name: [] for name in CLASSES}
    outcomes: dict[str, set[str]] = {name: set() for name in CLASSES}

    def one_round() -> None:
        for name in CLASSES:
            start = time.perf_counter()
            row = run_subject(name, {})
            seconds[name].append(time.perf_counter() - start)
            outcomes[name].add(row.outcome)

    run_subject("LlamaForCausalLM", {})  # transformers' modules imported, the Trainer's first-use costs paid
    rounds = 2 if bench_settings.quick else 5
    benchmark.pedantic(one_round, rounds=rounds, iterations=1, warmup_rounds=0)
    assert outcomes == {name: {outcome} for name, outcome in CLASSES.items()}
    benchmark.extra_info.update(
        bench_settings.extra_info(),
        sweep_transformers=True,
        rounds=rounds,
        **{f"{name}_median_s": statistics.median(times) for name, times in seconds.items()},
    )
    print("\nsweep: " + ", ".join(f"{name} {statistics.median(times):.2f} s" for name, times in seconds.items()))

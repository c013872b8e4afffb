"""The benchmarks report's sections on what equiv's own checks cost: ``equiv.check`` as the model grows
(benchmarks/test_check_scaling.py, with committed full runs beside this one), ``equiv verify``'s cases per
second and its threads on a busy machine, the searches' times, and how long the README's pytest example takes
to report.  Rendered into ``reports/benchmarks.md`` by :func:`equiv.reporting.benchmarks.render_report`; nothing
here measures.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pandas as pd

from equiv.reporting.markdown import markdown_table

__all__ = [
    "THREAD_MODES",
    "VERIFY_MODES",
    "readme_example_section",
    "scaling_section",
    "search_times_section",
    "verify_speed_section",
    "verify_threads_section",
]


#: Targets for the checker's own cost (time in units of the candidate's own float32 steps;
#: memory in model states beyond one bare float64 run).
#: check / own float32 steps, passing and failing, at CHECK_TIME_TARGET_FROM parameters and more (CPU).
CHECK_TIME_TARGETS = {"passing": 8.0, "failing": 15.0}
CHECK_TIME_TARGET_FROM = 1e6
#: Peak bytes per parameter of a check, at every size.
CHECK_MEMORY_TARGET = 100.0


def _scaling_rows(raw: dict[str, Any]) -> list[dict[str, Any]]:
    rows = [bench["extra_info"] for bench in raw.get("benchmarks", []) if bench.get("extra_info", {}).get("scaling")]
    return sorted(rows, key=lambda info: (info["parameters"], info.get("verdict", "passing") != "passing"))


def scaling_section(
    raw: dict[str, Any],
    scaling_full: dict[str, Any] | Sequence[tuple[str, dict[str, Any]]] | None = None,
) -> list[str]:
    """The cost of equiv.check itself as the model grows (benchmarks/test_check_scaling.py)."""
    if isinstance(scaling_full, dict):
        scaling_full = [("reports/check_scaling_full.json", scaling_full)]
    rows = _scaling_rows(raw)
    fulls = [(name, run, _scaling_rows(run)) for name, run in scaling_full or []]
    fulls = [(name, run, full_rows) for name, run, full_rows in fulls if full_rows]
    if not rows and not fulls:
        return []
    full_notes: list[str] = []
    for name, run, full_rows in fulls:
        loads = sorted(float(info["load_average_1min"]) for info in full_rows if "load_average_1min" in info)
        device = _scaling_device(full_rows)
        command = "EQUIV_BENCH_QUICK=0 pytest benchmarks/test_check_scaling.py --benchmark-only"
        full_notes += [
            f"Full run on the {'GPU' if device.startswith('cuda') else 'CPU'} "
            f"(`{'EQUIV_BENCH_DEVICE=cuda ' if device.startswith('cuda') else ''}{command}`), committed as {name}: "
            f"run of {str(run.get('datetime', 'unknown time'))[:19]} on "
            f"{run.get('machine_info', {}).get('cpu', {}).get('brand_raw', 'an unknown CPU')}, device `{device}`, "
            f"torch {full_rows[0].get('torch_version', '?')}, {full_rows[0].get('threads', '?')} thread(s), "
            f"1-minute load {loads[0] if loads else '?'}-{loads[-1] if loads else '?'}"
            f"{_allocator_note(full_rows)}.",
            "",
            markdown_table(_scaling_table(full_rows)),
            "",
        ]
    quick = (
        [
            f"This run ({'quick' if rows and rows[0].get('quick') else 'full'}):",
            "",
            markdown_table(_scaling_table(rows)),
            "",
        ]
        if rows
        else []
    )
    on_cpu = [full_rows for _, _, full_rows in fulls if not _scaling_device(full_rows).startswith("cuda")]
    on_gpu = [full_rows for _, _, full_rows in fulls if _scaling_device(full_rows).startswith("cuda")]
    return [
        *_scaling_intro(),
        *quick,
        *full_notes,
        *_scaling_why(on_cpu[0] if on_cpu else rows),
        *_scaling_gpu_why(on_gpu[0] if on_gpu else []),
    ]


def _allocator_note(rows: list[dict[str, Any]]) -> str:
    """How the host allocator was set, where the run says (EQUIV_BENCH_KEEP_FREED_MEMORY)."""
    allocator = str(rows[0].get("host_allocator", ""))
    if allocator.startswith("glibc malloc keeps freed memory"):
        return (
            ", host memory as the `equiv` command sets it (`EQUIV_BENCH_KEEP_FREED_MEMORY=1`: glibc keeps "
            "freed buffers for reuse, `equiv.host_memory`)"
        )
    return ", glibc's malloc as it comes" if allocator else ""


def _scaling_device(rows: list[dict[str, Any]]) -> str:
    return str(rows[0].get("device", "cpu")) if rows else "cpu"


def _scaling_gpu_why(rows: list[dict[str, Any]]) -> list[str]:
    """What a check's time is made of on a GPU, where the targets (CPU ones) do not apply."""
    if not rows or "model_build_ratio" not in rows[0]:
        return []
    build = [float(info["model_build_ratio"]) for info in rows]
    runs = [float(info["bare_runs_ratio"]) - float(info["model_build_ratio"]) for info in rows]
    compared = [float(info["time_ratio"]) - float(info["bare_runs_ratio"]) for info in rows]
    return [
        "On the GPU (no target: the targets are the CPU's): the candidate's own float32 steps take milliseconds, "
        f"and of a check's time in those units, building the case's model takes {_span(build)} (on the host, "
        "drawn from the CPU's generator with the case's seed, so a case has the same weights on every device; "
        f"then copied to the GPU), its runs {_span(runs)}, and comparing {_span(compared)} (kernel launches and "
        "one host read per step: a model this size leaves the GPU mostly waiting). A check of a model the user "
        "builds (`Case(model=...)`) pays for the user's own initialisation instead.",
        "",
    ]


def _span(values: list[float]) -> str:
    return f"{min(values):.1f}-{max(values):.1f}x" if values else "-"


def _scaling_why(rows: list[dict[str, Any]]) -> list[str]:
    """Why a target is missed, from the rows' own figures: the runs alone against
    the target, and what comparing adds on top."""
    lines: list[str] = []
    for verdict, target in CHECK_TIME_TARGETS.items():
        judged = [
            info
            for info in rows
            if info.get("verdict", "passing") == verdict
            and info["parameters"] >= CHECK_TIME_TARGET_FROM
            and "bare_runs_ratio" in info
        ]
        missed = [info for info in judged if info["time_ratio"] > target]
        if not missed:
            continue
        runs = _runs_made(missed[0])
        alone = [float(info["bare_runs_ratio"]) for info in missed]
        adds = [float(info["check_over_bare_runs"]) for info in missed]
        over_alone = sum(ratio > target for ratio in alone)
        lines.append(
            f"- **{verdict.capitalize()} check, {target:g}x target missed at {len(missed)} of {len(judged)} sizes**: "
            f"building the case's model and its runs ({runs}) alone take {_span(alone)} the candidate's own "
            f"float32 steps (past the target at {over_alone} of {len(missed)} sizes before anything is compared: "
            "each float64 run is a copy of the model, a cast and float64 training, whose optimizer step alone is "
            "2-3x float32's on this CPU, and its first step allocates gradients and optimizer state afresh), and "
            f"comparing multiplies that by {_span(adds)} (the truth's every step but the last copied, then per "
            "tensor and run one subtraction and one min/max pass, each a pass over memory as long as the step's "
            "own)"
            + (
                ". A failing check runs every floor sample, and its working-dtype candidate once more to show "
                "where each tensor differs (the float64 one runs once, after the exact tier's floors); detailing a "
                "failing row (where, how far relatively, how many past the allowance) is several more passes over "
                "the tensor"
                if verdict == "failing"
                else ""
            )
            + "."
        )
    heavy = [info for info in rows if info["check_bytes_per_parameter"] > CHECK_MEMORY_TARGET]
    if heavy:
        kinds = sorted({str(info.get("verdict", "passing")) for info in heavy})
        lines.append(
            f"- **Memory, {CHECK_MEMORY_TARGET:g} B/param target missed by {len(heavy)} row(s) ({', '.join(kinds)}; "
            f"{max(info['check_bytes_per_parameter'] for info in heavy):.0f} B/param at most)**: the truth's "
            "trajectory (its start in float32, every step's parameters and optimizer state in float64) and one "
            "float64 run are held together; a failing check's peak is where it details its failing rows "
            "(the absolute difference, divided in place into the relative one, and a mask of the largest "
            "tensor, on top of the comparison's own two buffers)."
        )
    return ["Why a target is missed:", "", *lines, ""] if lines else []


def _time_target(info: dict[str, Any]) -> str:
    target = CHECK_TIME_TARGETS.get(str(info.get("verdict", "passing")))
    if target is None or info["parameters"] < CHECK_TIME_TARGET_FROM or str(info.get("device", "cpu")) != "cpu":
        return "-"
    ratio = info["time_ratio"]
    return f"met (<= {target:g}x)" if ratio <= target else f"NOT met (<= {target:g}x: {ratio / target:.2f}x over)"


def _runs_made(info: dict[str, Any]) -> str:
    """The runs a check made, counted by kind ("truth + 1 floor + 2 candidate")."""
    runs = [str(run) for run in info.get("runs", [])]
    if not runs:
        return "-"
    floors = sum(run.startswith("full batch") for run in runs) - 1  # the first full-batch run is the truth
    candidates = sum(run.startswith("candidate") for run in runs)
    return f"truth + {floors} floor + {candidates} candidate"


def _scaling_table(rows: list[dict[str, Any]]) -> pd.DataFrame:
    return pd.DataFrame(
        [
            {
                "model": info["size"] if "GPT" in str(info.get("size")) else "MLP",
                "parameters": f"{info['parameters'] / 1e6:.2f}M",
                "candidate": f"{info.get('verdict', 'passing')}",
                "runs made": _runs_made(info),
                "check s (median)": f"{info['check_median_s']:.3f}",
                "own 2 float32 steps s": f"{info['own_steps_median_s']:.4f}",
                "model build / own steps": _times(info["model_build_ratio"]) if "model_build_ratio" in info else "-",
                "bare runs / own steps": f"{info['bare_runs_ratio']:.1f}x" if "bare_runs_ratio" in info else "-",
                "check / bare runs": f"{info['check_over_bare_runs']:.2f}x" if "check_over_bare_runs" in info else "-",
                "check / own steps": f"{info['time_ratio']:.1f}x",
                "time target (>= 1M)": _time_target(info),
                "check peak B/param": f"{info['check_bytes_per_parameter']:.0f}",
                f"memory target <= {CHECK_MEMORY_TARGET:g} B/param": (
                    "met" if info["check_bytes_per_parameter"] <= CHECK_MEMORY_TARGET else "NOT met"
                ),
            }
            for info in rows
        ]
    )


def _times(ratio: float) -> str:
    """A ratio with two significant figures below 1 (0.03x, not 0.0x), one decimal above."""
    return f"{ratio:.2f}x" if ratio < 1 else f"{ratio:.1f}x"


def _scaling_intro() -> list[str]:
    return [
        "## What a check costs as the model grows",
        "",
        "`equiv.check(step, case)`, from scratch (no truth kept from an earlier check), on a three-layer MLP "
        "(and, in a full run, a GPT-2-small-shaped causal LM brought in with `Case(model=..., data=..., "
        "loss=...)`), AdamW, batch 8 split 3 + 5, 2 steps; for a passing candidate (`equiv.accumulator_step`) "
        "and a failing one (the mean of per-micro-batch means).  Against the candidate's own two float32 "
        "steps, and against the bare runs that check made (recorded from one check: the float64 truth, the "
        "floor samples it ran, the candidate's runs; replayed with nothing compared, after building the case's "
        "model as a check does), all timed in the same rounds; and its peak of live tensor storages per "
        "parameter. *bare runs / own steps* is the part no comparison can remove (float64 costs 2-3x float32 "
        "on a CPU; *model build / own steps* is the part of it spent building the case's model); *check / bare "
        "runs* is what comparing adds. The time targets are the CPU's, from 1M parameters on.",
        "",
        "Runs only where the verdict needs them: the noise tier first (its run in the working dtype is the "
        "cheaper), compared with no floor (the roundoff term alone); floor samples then run one at a time "
        "while a tensor is past (or above half of) its allowance, re-judging the candidate's kept differences; a passing tier "
        "stops at the first sample that settles it (more samples only raise the allowance), and a sample "
        "measures each tier it feeds in one pass. A failing tier runs every sample, and its candidate once "
        "more to show where each tensor differs; when the noise tier fails, the exact tier's floors run "
        "before its float64 candidate, which then runs once. Either way the verdict every floor would give "
        "(tests/test_lazy_floors.py, tests/data/pinned_verdicts.json).",
        "",
    ]


#: verify's cases per second on a correct step, as shipped over a check as it ran before lazy floors.
VERIFY_SPEEDUP_TARGET = 2.0
#: The two ways benchmarks/test_verify_speed.py runs a search: as shipped, and as a check ran before.
VERIFY_MODES = ("as shipped", "every floor, details, nothing kept")


#: The thread counts benchmarks/test_verify_threads.py times a search with, side by side.
THREAD_MODES = ("torch's default threads", "equiv's choice", "one thread")
#: equiv's choice of threads must keep a verify's per-case time within this factor of one thread's.
THREADS_RATIO_TARGET = 1.5


def verify_threads_section(raw: dict[str, Any]) -> list[str]:
    """equiv verify's per-case time on a busy machine by thread count (benchmarks/test_verify_threads.py)."""
    infos = [b["extra_info"] for b in raw.get("benchmarks", []) if b.get("extra_info", {}).get("verify_threads")]
    if not infos:
        return []
    default, chosen, one = THREAD_MODES
    info = infos[0]
    ratio = float(info["ratio_chosen"])
    verdict = "met" if ratio <= THREADS_RATIO_TARGET else "NOT met"
    table = pd.DataFrame(
        [
            {
                "cases": info["examples"],
                f"ms per case, {default} ({info['default_threads']})": f"{info['per_case_ms'][default]:.0f}",
                f"ms per case, {chosen}": f"{info['per_case_ms'][chosen]:.0f}",
                f"ms per case, {one}": f"{info['per_case_ms'][one]:.0f}",
                f"{chosen} / {one}": f"{ratio:.2f}x",
                f"{default} / {one}": f"{float(info['ratio_default']):.2f}x",
                f"target (<= {THREADS_RATIO_TARGET:g}x)": verdict,
            }
        ]
    )
    return [
        "## equiv verify on a busy machine: threads",
        "",
        f"`equiv.verify(equiv.accumulator_step, seed={info['seed']}, max_examples={info['max_examples']})` "
        "with another process holding one core (a busy loop), no `OMP_NUM_THREADS`, timed alternately in the same "
        f"rounds with {THREAD_MODES[0]} (one per core), {chosen} (`threads=None`: one on small cases, see "
        "`equiv.checking.threads`) and one thread. The target is equiv's choice within "
        f"{THREADS_RATIO_TARGET:g}x of one thread.",
        "",
        markdown_table(table),
        "",
    ]


def search_times_section(raw: dict[str, Any]) -> list[str]:
    """The searches of the context-parallel engines, the MoE model and the packed / policy losses, each beside the
    search it extends (benchmarks/test_search_times.py)."""
    infos = [b["extra_info"] for b in raw.get("benchmarks", []) if b.get("extra_info", {}).get("search_times")]
    if not infos:
        return []
    info = infos[0]
    table = pd.DataFrame(
        [
            {
                "search (equiv.accumulator_step)": row["search"],
                "cases": row["cases"],
                "seconds": f"{row['seconds']:.1f}",
                "s per case": f"{row['per_case_s']:.3f}",
                "beside": row["baseline"] or "-",
                "per case / beside": "-" if row["ratio"] is None else f"{row['ratio']:.2f}x",
            }
            for row in info["rows"]
        ]
    )
    return [
        "## Search times: context parallelism, router losses, packed and RL losses",
        "",
        f"`equiv.verify_distributed(equiv.accumulator_step, engines=..., models=..., seed={info['seed']})` and "
        f"`equiv.verify(equiv.accumulator_step, SearchSpace(losses=...), seed={info['seed']})` on a correct step, "
        "so every drawn case runs; each search timed alternately in the same rounds as the one it extends "
        "(medians; the fork server and gloo started before). CP draws 1-2 data ranks of 2 slices (up to 4 "
        "gloo ranks); the others 2-3 ranks. "
        f"Threads: {info['threads']} (ranks always run one). Load average at the end: {info['load_average_1min']}.",
        "",
        markdown_table(table),
        "",
    ]


def verify_speed_section(raw: dict[str, Any]) -> list[str]:
    """equiv verify's cases per second, two modes side by side (benchmarks/test_verify_speed.py)."""
    infos = [b["extra_info"] for b in raw.get("benchmarks", []) if b.get("extra_info", {}).get("verify_speed")]
    if not infos:
        return []
    shipped, eager = VERIFY_MODES

    def target(info: dict[str, Any]) -> str:
        if info["verdict"] != "passing":
            return "-"
        speedup = float(info["speedup"])
        return (
            f"met (>= {VERIFY_SPEEDUP_TARGET:g}x)"
            if speedup >= VERIFY_SPEEDUP_TARGET
            else f"NOT met (>= {VERIFY_SPEEDUP_TARGET:g}x: {speedup:.2f}x)"
        )

    table = pd.DataFrame(
        [
            {
                "candidate": f"{info['candidate']} ({info['verdict']})",
                "seed": info["seed"],
                "cases checked": info["examples"],
                "found": "yes" if info["found"] else "no",
                f"cases/s, {eager}": f"{info['cases_per_second'][eager]:.1f}",
                f"cases/s, {shipped}": f"{info['cases_per_second'][shipped]:.1f}",
                "speed-up": f"{info['speedup']:.2f}x",
                f"target (correct step, >= {VERIFY_SPEEDUP_TARGET:g}x)": target(info),
            }
            for info in sorted(infos, key=lambda info: info["verdict"] != "passing")
        ]
    )
    return [
        "## equiv verify: cases per second",
        "",
        f"`equiv.verify(step, seed=0, max_examples={infos[0]['max_examples']})` on a correct step "
        "(`equiv.accumulator_step`) and a buggy one (the mean of per-micro-batch means), in two modes timed "
        f"alternately in the same rounds: *{shipped}* (floor samples only while a verdict depends on them, "
        f"truths and floors kept per case for the next check, failing rows detailed only for the case a search "
        f"found) and *{eager}* (every floor sample run for every check, every failing row detailed, nothing "
        "kept: a check as it ran before its floors were made lazy, with today's comparison code). Both modes "
        "search the same cases and reach the same verdict (asserted by the benchmark). The target is 2x the "
        "cases per second on a correct step.",
        "",
        markdown_table(table),
        "",
    ]


def readme_example_section(raw: dict[str, Any]) -> list[str]:
    """How long the README's failing pytest example takes to report (benchmarks/test_readme_pytest_example.py)."""
    infos = [
        b["extra_info"]
        for b in raw.get("benchmarks", [])
        if b.get("extra_info", {}).get("kind") == "readme_pytest_example"
    ]
    if not infos:
        return []
    info = infos[0]
    seconds, target = float(info["seconds"]), float(info["target_seconds"])
    explain = info.get("seconds_with_explain")
    beside = (
        ""
        if explain is None
        else f" With Hypothesis's explain phase back (equiv's ci profile otherwise unchanged), in the same run: "
        f"{float(explain):.1f} s ({float(explain) / seconds:.1f}x)."
    )
    return [
        "## The README's pytest example: time to report the failing step",
        "",
        f"`{info['command']}` in a fresh folder holding the README's `train.py` and `test_train.py` (the textbook "
        f"loop under `@given(equiv.strategies.cases_for(my_step))`): **{seconds:.1f} s** to report the shrunk "
        f"failure (target under {target:g} s on 2 cores: {'met' if seconds < target else 'NOT met'}).{beside} "
        f"Threads: {info['threads']}. Load average at the end: {info['load_average_1min']}."
        + ("" if explain is not None else " (Quick mode: the explain-phase run, minutes long, is left out.)"),
        "",
    ]

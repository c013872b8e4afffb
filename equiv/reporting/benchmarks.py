"""Turn ``pytest --benchmark-json`` output into ``reports/benchmarks.md``.

    equiv report benchmarks --json reports/benchmarks.json --out reports/benchmarks.md

Per workload: a table of N, micro-batch size, implementation, peak memory
(forward/backward and optimizer step), samples/s and the time ratio against
the native loop; the fitted cost model with leave-one-out prediction errors;
and a Mermaid chart of memory against throughput as N grows.  Rows are
sorted and floats formatted at fixed precision, so the markdown of two runs
differs only where a measurement did (memory figures, deterministic on CPU,
do not move at all).  The sections on what equiv itself costs follow, one module per family:
:mod:`equiv.reporting.benchmarks_checks` (check, verify, searches, the README's example),
:mod:`equiv.reporting.benchmarks_audit` (the audit's overhead and its false alarms) and
:mod:`equiv.reporting.benchmarks_sweeps` (a sweep's cost per class, the Ray fan-out's tasks per second).

Nothing here measures: the benchmark run did (``pytest benchmarks``), and
this module reads what it recorded.  The cost model is fitted here all the
same: :func:`equiv.cost.costmodel.fit_memory`, :func:`~equiv.cost.costmodel.fit_time`
and :func:`~equiv.cost.costmodel.leave_one_out` are least squares on the
recorded numbers (pure numpy, importing nothing of equiv), arithmetic of the
same kind as the medians and ratios this module computes, and the same JSON
gives the same fit on every machine.  tests/test_layout.py allows
``equiv.cost.costmodel`` and nothing else of ``equiv.cost``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pandas as pd

from equiv.cost.costmodel import (
    HeldOut,
    MemoryModel,
    MemoryPoint,
    TimeModel,
    TimePoint,
    fit_memory,
    fit_time,
    leave_one_out,
)
from equiv.reporting.benchmarks_audit import audit_section, false_alarms_section
from equiv.reporting.benchmarks_checks import (
    THREAD_MODES,
    VERIFY_MODES,
    readme_example_section,
    scaling_section,
    search_times_section,
    verify_speed_section,
    verify_threads_section,
)
from equiv.reporting.benchmarks_sweeps import fanout_section, sweep_cost_section
from equiv.reporting.markdown import markdown_table

#: THREAD_MODES and VERIFY_MODES live with their sections (equiv.reporting.benchmarks_checks); the benchmarks
#: that record them import them from here.
__all__ = ["THREAD_MODES", "VERIFY_MODES", "load_benchmarks", "render_report"]

MIB = 2**20
#: The N at which the Accumulator's overhead target is stated (at most 3% over the native loop on the MLP).
OVERHEAD_TARGET_N = 8
IMPLEMENTATION_ORDER = {"native": 0, "accumulator": 1, "checkpoint": 2}
GENERATE_COMMANDS = (
    "python -m pytest benchmarks --benchmark-only --benchmark-json=reports/benchmarks.json\n"
    "equiv report benchmarks --json reports/benchmarks.json --scaling-full reports/check_scaling_full.json "
    "--scaling-full reports/check_scaling_gpu.json --out reports/benchmarks.md"
)
#: A GPU run (CI has no GPU: its report is committed from a machine with one).
GENERATE_COMMANDS_CUDA = (
    "EQUIV_BENCH_DEVICE=cuda EQUIV_BENCH_QUICK=0 python -m pytest benchmarks --benchmark-only "
    "--benchmark-json=reports/benchmarks_cuda.json\n"
    "equiv report benchmarks --json reports/benchmarks_cuda.json --out reports/benchmarks_cuda.md"
)


def load_benchmarks(raw: dict[str, Any]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The step benchmarks (one row per workload, N, implementation) and the
    paired overhead benchmarks (one row per workload and N), from parsed JSON."""
    steps, paired = [], []
    for bench in raw.get("benchmarks", []):
        info, stats = bench.get("extra_info", {}), bench["stats"]
        if "workload" not in info or info.get("peers"):
            continue  # somebody else's benchmark in the same run, or the peers' (their own section)
        if info.get("implementation") == "paired":
            paired.append(info)
            continue
        batch = info["global_batch_size"]
        steps.append(
            {
                **info,
                "median_s": stats["median"],
                "rounds": stats["rounds"],
                "samples_per_s": batch / stats["median"],
                # Quartiles of time map to quartiles of rate, reversed.
                "samples_per_s_q1": batch / stats["q3"],
                "samples_per_s_q3": batch / stats["q1"],
            }
        )
    step_frame = pd.DataFrame(steps)
    if not step_frame.empty:
        step_frame["implementation_order"] = step_frame["implementation"].map(IMPLEMENTATION_ORDER).fillna(9)
        step_frame = step_frame.sort_values(["workload", "n_micro_batches", "implementation_order"], kind="stable")
        step_frame = step_frame.reset_index(drop=True)
    paired_frame = pd.DataFrame(paired)
    if not paired_frame.empty:
        paired_frame = paired_frame.sort_values(["workload", "n_micro_batches"], kind="stable").reset_index(drop=True)
    return step_frame, paired_frame


def _load_note(steps: pd.DataFrame) -> str:
    """The 1-minute load average seen by the benchmarks: above the thread
    count, other processes were competing for the cores and timings suffer."""
    if "load_average_1min" not in steps:
        return ""
    low, high = float(steps["load_average_1min"].min()), float(steps["load_average_1min"].max())
    return f"; 1-min load average {low:.2f}-{high:.2f} during the run"


def _mib(value: float) -> str:
    return f"{value / MIB:.3f}"


def _micro_batches(sizes: Sequence[int] | float, largest: int) -> str:
    if not isinstance(sizes, Sequence) or len(set(sizes)) <= 1:
        return str(largest)
    return "+".join(str(s) for s in sizes)  # uneven split: show every piece


def _time_ratios(frame: pd.DataFrame) -> list[str]:
    """Median step time over the native loop's at the same N (checkpoint: over native N=1)."""
    native = frame[frame["implementation"] == "native"].set_index("n_micro_batches")["median_s"]
    ratios = []
    for row in frame.itertuples():
        base = native.get(row.n_micro_batches)
        ratios.append(f"{row.median_s / base:.3f}" if base else "-")
    return ratios


def _paired_ratios(frame: pd.DataFrame, paired: pd.DataFrame) -> list[str]:
    """The paired overhead (Accumulator over native, alternated) on Accumulator rows."""
    by_n = {} if paired.empty else dict(zip(paired["n_micro_batches"], paired["overhead_ratio"], strict=True))
    return [
        f"{by_n[n]:.3f}" if impl == "accumulator" and n in by_n else "-"
        for n, impl in zip(frame["n_micro_batches"], frame["implementation"], strict=True)
    ]


def _workload_table(frame: pd.DataFrame, paired: pd.DataFrame) -> str:
    table = pd.DataFrame(
        {
            "N": frame["n_micro_batches"],
            "micro-batch": [
                _micro_batches(s, m) for s, m in zip(frame["micro_batch_sizes"], frame["micro_batch_size"], strict=True)
            ],
            "implementation": frame["implementation"],
            "fwd/bwd peak MiB": frame["forward_backward_peak_bytes"].map(_mib),
            "step peak MiB": frame["optimizer_step_peak_bytes"].map(_mib),
            "peak MiB": frame["peak_bytes"].map(_mib),
            "samples/s (median)": frame["samples_per_s"].map(lambda v: f"{v:.0f}"),
            "samples/s (IQR)": [
                f"{lo:.0f}-{hi:.0f}"
                for lo, hi in zip(frame["samples_per_s_q1"], frame["samples_per_s_q3"], strict=True)
            ],
            "time / native": _time_ratios(frame),
            "overhead, paired": _paired_ratios(frame, paired),
        }
    )
    return markdown_table(table)


def _fits(frame: pd.DataFrame) -> list[str]:
    """Fit the Accumulator rows; memory on N >= 2 (see the note it returns)."""
    acc = frame[frame["implementation"] == "accumulator"].sort_values("n_micro_batches")
    # Memory is fitted on N >= 2 only: the note in _model_lines says why.
    fitted = acc[acc["n_micro_batches"] >= 2]
    memory_points = [
        MemoryPoint(
            micro_batch_size=int(r.micro_batch_size),
            forward_backward_peak_bytes=float(r.forward_backward_peak_bytes),
            optimizer_step_peak_bytes=float(r.optimizer_step_peak_bytes),
        )
        for r in fitted.itertuples()
    ]
    time_points = [
        TimePoint(
            n_micro_batches=int(r.n_micro_batches), global_batch_size=int(r.global_batch_size), step_seconds=r.median_s
        )
        for r in acc.itertuples()
    ]
    try:
        memory_model = fit_memory(memory_points)
        time_model = fit_time(time_points)
    except ValueError as exc:
        return [f"Not enough Accumulator measurements to fit the cost model: {exc}"]
    memory_ns = [int(n) for n in fitted["n_micro_batches"]]
    memory_held = {
        memory_ns[h.index]: h
        for h in leave_one_out(
            memory_points,
            fit_memory,
            lambda m, p: m.forward_backward_bytes(p.micro_batch_size),
            lambda p: p.forward_backward_peak_bytes,
        )
    }
    time_held = {
        time_points[h.index].n_micro_batches: h
        for h in leave_one_out(
            time_points,
            fit_time,
            lambda m, p: m.step_seconds(p.n_micro_batches, p.global_batch_size),
            lambda p: p.step_seconds,
        )
    }
    return [
        *_model_lines(memory_model, time_model, int(acc["global_batch_size"].iloc[0])),
        "Prediction error on each N left out of the fit (leave-one-out; Accumulator rows):",
        "",
        markdown_table(pd.DataFrame(_held_out_rows(acc, memory_model, memory_held, time_held))),
    ]


def _model_lines(memory_model: MemoryModel, time_model: TimeModel, batch: int) -> list[str]:
    """The fitted memory and time models in words, at global batch ``batch``."""
    return [
        f"- memory: forward/backward peak = **{memory_model.static_bytes / MIB:.3f} MiB + "
        f"{memory_model.activation_bytes_per_sample / MIB * 1024:.2f} KiB x micro-batch** "
        f"(= {memory_model.static_bytes / MIB:.3f} + {memory_model.activation_bytes_per_sample * batch / MIB:.3f}"
        f" / N MiB at B={batch}); optimizer-step peak **{memory_model.optimizer_step_peak_bytes / MIB:.3f} MiB**; "
        "whole step = the larger of the two.",
        f"- time: step = **N x {time_model.seconds_per_micro_step * 1e3:.2f} ms + B x "
        f"{time_model.seconds_per_sample * 1e6:.1f} us** (B={batch}).",
        "- Memory is fitted on N >= 2: with one micro-batch backward's gradients become `.grad` directly, from "
        "N = 2 on each micro-batch's gradient is a temporary added into `.grad`, a step the line does not describe; "
        "the N = 1 row below is predicted from the N >= 2 fit.",
        "",
    ]


def _held_out_rows(
    acc: pd.DataFrame, memory_model: MemoryModel, memory_held: dict[int, HeldOut], time_held: dict[int, HeldOut]
) -> list[dict[str, str]]:
    """Per Accumulator row, the fit's prediction with that N left out, beside the measurement (N = 1's
    memory, never fitted, predicted by the whole N >= 2 fit)."""
    rows = []
    for r in acc.itertuples():
        n = int(r.n_micro_batches)
        if n == 1:
            mem_measured = float(r.forward_backward_peak_bytes)
            mem_predicted = memory_model.forward_backward_bytes(int(r.micro_batch_size))
        elif n in memory_held:
            mem_measured, mem_predicted = memory_held[n].measured, memory_held[n].predicted
        else:
            mem_measured = mem_predicted = float("nan")
        held = time_held.get(n)
        rows.append(
            {
                "N left out": str(n),
                "fwd/bwd MiB measured": _mib(mem_measured),
                "fwd/bwd MiB predicted": _mib(mem_predicted),
                "fwd/bwd error": f"{(mem_predicted - mem_measured) / mem_measured:+.1%}",
                "step ms measured": f"{held.measured * 1e3:.2f}" if held else "-",
                "step ms predicted": f"{held.predicted * 1e3:.2f}" if held else "-",
                "step error": f"{held.relative_error:+.1%}" if held else "-",
            }
        )
    return rows


def _chart(workload: str, frame: pd.DataFrame) -> list[str]:
    """Mermaid xychart: whole-step peak (bars) and samples/s (line), both as % of N=1."""
    acc = frame[frame["implementation"] == "accumulator"].sort_values("n_micro_batches")
    base = acc[acc["n_micro_batches"] == 1]
    if base.empty:
        return []
    peak_1, rate_1 = float(base["peak_bytes"].iloc[0]), float(base["samples_per_s"].iloc[0])
    peaks = [100 * p / peak_1 for p in acc["peak_bytes"]]
    rates = [100 * r / rate_1 for r in acc["samples_per_s"]]
    top = max(110, int(max(peaks + rates) // 10 * 10 + 10))
    labels = ", ".join(f'"N={int(n)}"' for n in acc["n_micro_batches"])
    return [
        "```mermaid",
        "xychart-beta",
        f'    title "{workload}, Accumulator: peak memory (bars) and samples/s (line), % of N=1"',
        f"    x-axis [{labels}]",
        f'    y-axis "% of N=1" 0 --> {top}',
        f"    bar [{', '.join(f'{v:.1f}' for v in peaks)}]",
        f"    line [{', '.join(f'{v:.1f}' for v in rates)}]",
        "```",
    ]


def render_report(
    raw: dict[str, Any],
    *,
    source: str = "reports/benchmarks.json",
    scaling_full: dict[str, Any] | Sequence[tuple[str, dict[str, Any]]] | None = None,
) -> str:
    """The whole markdown report from parsed ``--benchmark-json`` output.

    ``scaling_full``: committed full runs of the check-scaling benchmark (too
    long for CI: up to a 124M-parameter model; and on a GPU, which CI has not),
    as (file name, parsed JSON) pairs or one parsed run, each shown beside this
    run's quick sizes with its own device, date and load."""
    steps, paired = load_benchmarks(raw)
    if steps.empty:
        raise ValueError(f"{source} holds no equiv step benchmarks (none with extra_info['workload'])")
    lines = [*_header(raw, steps), "## Summary", "", _summary(steps, paired), ""]
    for workload in sorted(steps["workload"].unique()):
        pair = paired[paired["workload"] == workload] if not paired.empty else paired
        lines += _workload_section(workload, steps[steps["workload"] == workload], pair)
    lines += _peers_section(raw)
    lines += _regret_section(raw)
    lines += scaling_section(raw, scaling_full)
    lines += verify_speed_section(raw)
    lines += verify_threads_section(raw)
    lines += search_times_section(raw)
    lines += audit_section(raw)
    lines += false_alarms_section(raw, scaling_full)
    lines += readme_example_section(raw)
    lines += sweep_cost_section(raw)
    lines += fanout_section(raw)
    return "\n".join(lines).rstrip() + "\n"


def _header(raw: dict[str, Any], steps: pd.DataFrame) -> list[str]:
    """The title, the commands that regenerate the report, the run's machine and settings, and how to read
    the step tables."""
    first = steps.iloc[0]
    cpu = raw.get("machine_info", {}).get("cpu", {})
    rounds = sorted({int(r) for r in steps["rounds"]})
    return [
        "# Benchmarks: what gradient accumulation buys in memory and costs in throughput",
        "",
        "Generated; do not edit. Regenerate with:",
        "",
        "```",
        GENERATE_COMMANDS_CUDA if str(first["device"]).startswith("cuda") else GENERATE_COMMANDS,
        "```",
        "",
        f"Run of {raw.get('datetime', 'unknown time')[:19]} on {cpu.get('brand_raw', 'unknown CPU')} "
        f"({cpu.get('count', '?')} cores), device `{first['device']}`, {first['threads']} threads, "
        f"dtype {first['dtype']}, torch {first['torch_version']}, AdamW, "
        f"{'/'.join(map(str, rounds))} timed rounds per row"
        f"{' (quick mode: CI)' if bool(first.get('quick', False)) else ''}"
        f"{_load_note(steps)}.",
        "",
        "- **Memory** is the peak of one steady-state optimizer step (AdamW state already created), split into the "
        "forward/backward phase and the optimizer-step phase; *peak* is the larger. "
        + (
            "On CPU it is counted from live tensor storages (`equiv.cost.memory.StorageCounter`): byte-identical on "
            "every run."
            if first["memory_method"] == "storage-counter"
            else "On CUDA it is the caching allocator's `max_memory_allocated`, synchronised."
        ),
        "- **Samples/s** is the global batch over the median step time (IQR in brackets). Each round times the "
        "second step of freshly built weights. Absolute CPU times move by tens of percent between runs: compare "
        "rows of one run, and read overheads from the paired figure.",
        "- **time / native**: median step time over the native loop's at the same N (checkpoint: native at N=1). "
        "The native loop is `(loss_sum / total_items).backward()` per micro-batch, then `optimizer.step()`.",
        "- **overhead, paired**: Accumulator and native steps timed alternately (ABBA) in one benchmark at each N; "
        "the median of per-pair ratios, which machine load drifting between benchmarks does not bias. Read the "
        "Accumulator's overhead here; *time / native* compares two separate benchmarks.",
        "",
    ]


def _workload_section(workload: str, frame: pd.DataFrame, pair: pd.DataFrame) -> list[str]:
    """One workload: its step table, the paired overhead at OVERHEAD_TARGET_N, the fitted cost model, the chart."""
    row = frame.iloc[0]
    lines = [
        f"## {workload}",
        "",
        f"{row.get('description', '')}; {int(row['parameters']):,} parameters; global batch "
        f"B = {int(row['global_batch_size'])}.",
        "",
        _workload_table(frame, pair),
        "",
    ]
    at_8 = pair[pair["n_micro_batches"] == OVERHEAD_TARGET_N] if not pair.empty else pair
    if not at_8.empty:
        p = at_8.iloc[0]
        lines += [
            f"Paired overhead of `equiv.Accumulator` at N={OVERHEAD_TARGET_N}: "
            f"**{p['overhead_ratio']:.3f}x** the native loop's step time "
            f"(IQR {p['overhead_ratio_q1']:.3f}-{p['overhead_ratio_q3']:.3f}, {int(p['pairs'])} pairs).",
            "",
        ]
    return [*lines, "### Fitted cost model", "", *_fits(frame), "", *_chart(workload, frame), ""]


#: The planner's goal: its pick at most this much slower than the fastest N that fits.
REGRET_TARGET = 0.05


def _regret_section(raw: dict[str, Any]) -> list[str]:
    """The planner's pick against every N measured (benchmarks/test_planner_regret.py)."""
    infos = [b["extra_info"] for b in raw.get("benchmarks", []) if b.get("extra_info", {}).get("planner_regret")]
    if not infos:
        return []
    records = []
    for info in sorted(infos, key=lambda i: i["workload_name"]):
        exhaustive = info["exhaustive"]
        for row in info["rows"]:
            regret = row["regret"]
            records.append(
                {
                    "workload": info["workload_name"],
                    "budget MiB": _mib(row["budget_bytes"]),
                    "N fitting (measured)": ", ".join(
                        n for n in exhaustive if exhaustive[n]["peak_bytes"] <= row["budget_bytes"]
                    )
                    or "-",
                    "planner's N": row["picked_n"] if row["picked_n"] is not None else "none",
                    "fastest fitting N": row["best_n"] if row["best_n"] is not None else "none",
                    "regret": "does not fit" if not row["picked_fits"] else f"{100 * regret:.1f}%",
                    f"goal <= {100 * REGRET_TARGET:g}%": (
                        "met" if row["picked_fits"] and regret is not None and regret <= REGRET_TARGET else "NOT met"
                    ),
                    "probes (over budget)": f"{row['probes']} ({row['probes_over_budget']})",
                    # Older runs (before the walk over whole steps) did not count them.
                    "whole steps (over budget)": (
                        f"{row['whole_steps']} ({row['whole_steps_over_budget']})" if "whole_steps" in row else "-"
                    ),
                }
            )
    return [
        "## Planner regret",
        "",
        "Every candidate N measured in the same run (whole step: peak memory, median step time), then "
        "`equiv plan`'s search at budgets between the smallest and the largest peak and above all of them; regret "
        "is the pick's measured step time over the fastest fitting N's, from the exhaustive measurements. "
        "The search probes two-micro-batch windows, predicts the fastest N that fits, then measures whole steps "
        "of it and its neighbours and walks to a faster one while there is one (*whole steps*). "
        "Step times on a shared CPU move by several percent between runs, so a regret of a few percent between "
        "two N of near-equal time is within noise; a probe over budget would be an out-of-memory error on a GPU.",
        "",
        markdown_table(pd.DataFrame(records)),
        "",
    ]


def _peers_section(raw: dict[str, Any]) -> list[str]:
    """Peers' steps against the native loop, timed in rotation (benchmarks/test_peer_steps.py)."""
    rows = [bench["extra_info"] for bench in raw.get("benchmarks", []) if bench.get("extra_info", {}).get("peers")]
    if not rows:
        return []
    rows.sort(key=lambda info: (info["workload"], info["n_micro_batches"]))

    def ratio(info: dict[str, Any], name: str) -> str:
        return f"{info[f'{name}_ratio']:.3f} ({info[f'{name}_ratio_q1']:.3f}-{info[f'{name}_ratio_q3']:.3f})"

    table = pd.DataFrame(
        [
            {
                "workload": info["workload"],
                "N": info["n_micro_batches"],
                "native step s (median)": f"{info['native_median_s']:.4f}",
                "equiv.Accumulator / native": ratio(info, "accumulator"),
                f"Accelerate {info['accelerate_version']} accumulate() / native": ratio(info, "accelerate"),
                **(
                    {f"Lightning Fabric {info['fabric_version']} no_backward_sync / native": ratio(info, "fabric")}
                    if info.get("fabric_version")
                    else {}
                ),
                "rotations": info["rotations"],
            }
            for info in rows
        ]
    )
    return [
        "## Peers' steps, timed side by side",
        "",
        "The native loop, `equiv.Accumulator`, Accelerate's `accumulate()` loop and (when installed) Lightning "
        "Fabric's `no_backward_sync` loop, each as its gradient-accumulation guide writes it, stepped in rotation "
        "on models from the same seed over the same global batch; each cell is the median of per-rotation ratios "
        "to the native step (interquartile range in brackets). On one process Fabric's `no_backward_sync` has no "
        "communication to skip: its row is the cost of Fabric's wrappers. Cost only: reports/peers.md says which "
        "of them is equivalent."
        + (
            ""
            if any(info.get("fabric_version") for info in rows)
            else " Lightning Fabric was not installed in this run (pip install equiv[lightning]): not timed."
        ),
        "",
        markdown_table(table),
        "",
    ]


def _pick(frame: pd.DataFrame, n: int, implementation: str, column: str) -> float | None:
    hit = frame[(frame["n_micro_batches"] == n) & (frame["implementation"] == implementation)]
    return float(hit[column].iloc[0]) if not hit.empty else None


def _summary(steps: pd.DataFrame, paired: pd.DataFrame) -> str:
    rows = []
    for workload in sorted(steps["workload"].unique()):
        frame = steps[steps["workload"] == workload]

        peak_1, peak_8 = _pick(frame, 1, "accumulator", "peak_bytes"), _pick(frame, 8, "accumulator", "peak_bytes")
        rate_1, rate_8 = (
            _pick(frame, 1, "accumulator", "samples_per_s"),
            _pick(frame, 8, "accumulator", "samples_per_s"),
        )
        ckpt_peak, ckpt_rate = (
            _pick(frame, 1, "checkpoint", "peak_bytes"),
            _pick(frame, 1, "checkpoint", "samples_per_s"),
        )
        pair = paired[paired["workload"] == workload] if not paired.empty else paired
        pair = pair[pair["n_micro_batches"] == OVERHEAD_TARGET_N] if not pair.empty else pair
        rows.append(
            {
                "workload": workload,
                "B": str(int(frame["global_batch_size"].iloc[0])),
                "peak MiB, N=1": _mib(peak_1) if peak_1 else "-",
                "peak MiB, N=8": _mib(peak_8) if peak_8 else "-",
                "peak N=8 / N=1": f"{peak_8 / peak_1:.3f}" if peak_1 and peak_8 else "-",
                "samples/s N=8 / N=1": f"{rate_8 / rate_1:.3f}" if rate_1 and rate_8 else "-",
                "checkpoint N=1: peak / N=1": f"{ckpt_peak / peak_1:.3f}" if ckpt_peak and peak_1 else "-",
                "checkpoint N=1: samples/s / N=1": f"{ckpt_rate / rate_1:.3f}" if ckpt_rate and rate_1 else "-",
                "Accumulator overhead N=8 (paired)": f"{pair['overhead_ratio'].iloc[0]:.3f}" if not pair.empty else "-",
            }
        )
    return markdown_table(pd.DataFrame(rows))

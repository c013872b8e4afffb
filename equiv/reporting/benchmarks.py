"""Turn ``pytest --benchmark-json`` output into ``reports/benchmarks.md``.

    equiv report benchmarks --json reports/benchmarks.json --out reports/benchmarks.md

Per workload: a table of N, micro-batch size, implementation, peak memory
(forward/backward and optimizer step), samples/s and the time ratio against
the native loop; the fitted cost model with leave-one-out prediction errors;
and a Mermaid chart of memory against throughput as N grows.  Rows are
sorted and floats formatted at fixed precision, so the markdown of two runs
differs only where a measurement did (memory figures, deterministic on CPU,
do not move at all).

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
    MemoryModel,
    MemoryPoint,
    TimeModel,
    TimePoint,
    fit_memory,
    fit_time,
    leave_one_out,
)
from equiv.reporting.markdown import markdown_table

__all__ = ["load_benchmarks", "render_report"]

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


def _fits(frame: pd.DataFrame) -> tuple[list[str], MemoryModel | None, TimeModel | None]:
    """Fit the Accumulator rows; memory on N >= 2 (see the note it returns)."""
    acc = frame[frame["implementation"] == "accumulator"].sort_values("n_micro_batches")
    lines: list[str] = []
    memory_points = [
        MemoryPoint(
            micro_batch_size=int(r.micro_batch_size),
            forward_backward_peak_bytes=float(r.forward_backward_peak_bytes),
            optimizer_step_peak_bytes=float(r.optimizer_step_peak_bytes),
        )
        for r in acc.itertuples()
        if r.n_micro_batches >= 2
    ]
    memory_ns = [int(n) for n in acc["n_micro_batches"] if n >= 2]
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
        return [f"Not enough Accumulator measurements to fit the cost model: {exc}"], None, None

    mem_held = {
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
    batch = int(acc["global_batch_size"].iloc[0])
    lines += [
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
    n1 = acc[acc["n_micro_batches"] == 1]
    held_rows = []
    for r in acc.itertuples():
        n = int(r.n_micro_batches)
        if n == 1 and not n1.empty:
            predicted = memory_model.forward_backward_bytes(int(r.micro_batch_size))
            mem_measured, mem_predicted = float(r.forward_backward_peak_bytes), predicted
        elif n in mem_held:
            mem_measured, mem_predicted = mem_held[n].measured, mem_held[n].predicted
        else:
            mem_measured = mem_predicted = float("nan")
        held = time_held.get(n)
        held_rows.append(
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
    lines.append("Prediction error on each N left out of the fit (leave-one-out; Accumulator rows):")
    lines.append("")
    lines.append(markdown_table(pd.DataFrame(held_rows)))
    return lines, memory_model, time_model


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
    first = steps.iloc[0]
    cpu = raw.get("machine_info", {}).get("cpu", {})
    rounds = sorted({int(r) for r in steps["rounds"]})
    lines = [
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
        "## Summary",
        "",
        _summary(steps, paired),
        "",
    ]
    for workload in sorted(steps["workload"].unique()):
        frame = steps[steps["workload"] == workload]
        pair = paired[paired["workload"] == workload] if not paired.empty else paired
        row = frame.iloc[0]
        lines += [
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
        fit_lines, _, _ = _fits(frame)
        lines += ["### Fitted cost model", "", *fit_lines, "", *_chart(workload, frame), ""]
    lines += _peers_section(raw)
    lines += _regret_section(raw)
    lines += _scaling_section(raw, scaling_full)
    lines += _verify_speed_section(raw)
    lines += _verify_threads_section(raw)
    lines += _search_times_section(raw)
    lines += _audit_section(raw)
    lines += _false_alarms_section(raw, scaling_full)
    lines += _readme_example_section(raw)
    return "\n".join(lines).rstrip() + "\n"


def _readme_example_section(raw: dict[str, Any]) -> list[str]:
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


def _audit_section(raw: dict[str, Any]) -> list[str]:
    """What equiv.audit costs a run (benchmarks/test_audit_overhead.py)."""
    infos = [b["extra_info"] for b in raw.get("benchmarks", []) if b.get("extra_info", {}).get("audit_overhead")]
    if not infos:
        return []
    table = pd.DataFrame(
        [
            {
                "parameters": f"{info['parameters'] / 1e6:.2f}M",
                "micro-batches per step": info["micro_batches"],
                "plain step s (median)": f"{info['plain_step_median_s']:.4f}",
                "unaudited step / plain": f"{info['unaudited_ratio']:.2f}x",
                # Absent from runs made before it was timed apart (it was then inside the unaudited ratio).
                "step before an audited one / plain": (
                    f"{info['before_audited_ratio']:.2f}x" if "before_audited_ratio" in info else "-"
                ),
                "audited step / plain": f"{info['audited_ratio']:.1f}x",
                "new storage, plain step (B/param)": f"{info['plain_peak_bytes_per_parameter']:.0f}",
                "new storage, audited step (B/param)": f"{info['audited_peak_bytes_per_parameter']:.0f}",
            }
            for info in infos
        ]
    )
    return [
        "## equiv.audit: what watching a real run costs",
        "",
        "A user's loop (an MLP classifier called as `model(x, y)`, AdamW, N micro-batches of 16 samples per "
        "optimizer step) timed plain, inside `equiv.audit` on a step it does not audit (the hooks only), on the "
        "step before an audited window (its optimizer step's post-hook copies the weights and optimizer state "
        "the audited window starts from: a cost of the audit, paid one step early), and on "
        "a step it audits (the window's inputs and start state copied, the full batch replayed in float64, then "
        "in float32 only while the verdict depends on a floor sample (up to three times), the update compared), alternately in the same rounds (medians of per-round "
        "ratios). `every=k` audits one step in k, so a run pays (k - 2 + the step before + the audited step) / k "
        "plain steps per step on average, the other k - 2 at the unaudited ratio. "
        "Memory: the peak of tensor storages made during one step (the model's weights and AdamW's state, "
        "which exist before, not counted), plain and audited.",
        "",
        markdown_table(table),
        "",
        *_audit_run_lines(raw),
        *_audit_ddp_lines(raw),
    ]


def _audit_ddp_lines(raw: dict[str, Any]) -> list[str]:
    """The audit of a DDP run under torchrun (benchmarks/test_audit_overhead.py::test_audit_ddp_overhead)."""
    infos = [b["extra_info"] for b in raw.get("benchmarks", []) if b.get("extra_info", {}).get("audit_ddp_overhead")]
    if not infos:
        return []
    info = infos[0]
    table = pd.DataFrame(
        [
            {
                "ranks": info["world_size"],
                "parameters": info["parameters"],
                "micro-batches per step (each rank)": info["micro_batches"],
                "plain DDP step s (median)": f"{info['plain_step_median_s']:.4f}",
                "audited step / plain": f"{info['audited_ratio']:.1f}x",
                "bytes sent per audited step (each rank)": f"{info['bytes_per_audited_step']:,.0f}",
                "bytes per parameter": f"{info['bytes_per_audited_step'] / info['parameters']:.1f}",
            }
        ]
    )
    return [
        "",
        f"The same loop under torchrun, wrapped in DDP on {info['world_size']} gloo ranks (each rank its own "
        "micro-batches, `no_sync` but on the last), a plain step and a step audited with `every=1` alternately in "
        f"each of {info['rounds']} rounds, each rank timing its own (rank 0's medians of per-round ratios). The "
        "audited step's truth is the global full-batch step, computed across the ranks: each rank replays its own "
        "micro-batches, and the audit's own all-reduces sum the item count and the gradients of the float64 truth "
        "and of each float32 floor sample the verdict needs (run together on every rank while any rank's rows are "
        "past their allowance): 8 bytes a parameter for the truth and 4 for each floor sample, whatever the world "
        "size.",
        "",
        markdown_table(table),
    ]


#: The whole-run target at every=100 (issue 34): an invariant checker for training publishes a median of 1.07x.
AUDIT_RUN_TARGET = 1.10


def _audit_run_lines(raw: dict[str, Any]) -> list[str]:
    """Whole runs, plain and audited at every=k (benchmarks/test_audit_overhead.py::test_audit_whole_run_overhead)."""
    infos = [b["extra_info"] for b in raw.get("benchmarks", []) if b.get("extra_info", {}).get("audit_run_overhead")]
    if not infos:
        return []
    runs = infos[0]["runs"]
    table = pd.DataFrame(
        [
            {
                "every": run["every"],
                "optimizer steps per run": run["steps"],
                "steps audited": run["audited_steps"],
                "run / plain run (median)": f"{run['run_ratio_median']:.2f}x",
                "range over rounds": f"{run['run_ratio_min']:.2f}-{run['run_ratio_max']:.2f}x",
            }
            for run in runs
        ]
    )
    at_100 = next((run for run in runs if run["every"] == 100), None)
    verdict = (
        ""
        if at_100 is None
        else (
            f" Target: at every=100 the whole run within {AUDIT_RUN_TARGET:.2f}x a plain one: "
            + (
                "**met**"
                if at_100["run_ratio_median"] <= AUDIT_RUN_TARGET
                else f"**not met** ({at_100['run_ratio_median']:.2f}x)"
            )
            + "."
        )
    )
    return [
        f"Whole runs of the same loop, plain and inside `equiv.audit(every=k)`, side by side on the same data: two "
        "copies of the model and optimizer, one step of the plain run then the same step of the audited one (so a "
        "change in the machine's load falls on both), entering and leaving the audit counted; the ratio of the two "
        f"runs' summed times, in each of {infos[0]['rounds']} rounds.{verdict}",
        "",
        markdown_table(table),
        "",
    ]


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


def _scaling_section(
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


#: verify's cases per second on a correct step, as shipped over a check as it ran before lazy floors.
VERIFY_SPEEDUP_TARGET = 2.0
#: The two ways benchmarks/test_verify_speed.py runs a search: as shipped, and as a check ran before.
VERIFY_MODES = ("as shipped", "every floor, details, nothing kept")


#: The thread counts benchmarks/test_verify_threads.py times a search with, side by side.
THREAD_MODES = ("torch's default threads", "equiv's choice", "one thread")
#: equiv's choice of threads must keep a verify's per-case time within this factor of one thread's.
THREADS_RATIO_TARGET = 1.5


def _verify_threads_section(raw: dict[str, Any]) -> list[str]:
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


def _search_times_section(raw: dict[str, Any]) -> list[str]:
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


def _verify_speed_section(raw: dict[str, Any]) -> list[str]:
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


#: The runs of benchmarks/test_audit_false_alarms.py, in the order shown, with what each is.
FALSE_ALARM_RUNS = {
    "trainer": "transformers Trainer, one-layer Llama (float32), N = 2-4, clipping (1.0) on every other segment",
    "adamw_clipped": "plain loop, MLP classifier, AdamW, `clip_grad_norm_(0.5)`, N = 2-5",
    "ddp": "tiny next-token LM under DDP, 2 gloo ranks, each its own sequences, global token count, N = 2-4",
}
#: A correct run's windows should stay clear of their allowance: the tail (p99, max) this far below it.
FALSE_ALARM_TAIL = 0.9


def _false_alarm_runs(raw: dict[str, Any]) -> dict[str, Any] | None:
    infos = [b["extra_info"] for b in raw.get("benchmarks", []) if b.get("extra_info", {}).get("audit_false_alarms")]
    return infos[0] if infos else None


def _false_alarms_table(info: dict[str, Any]) -> str:
    runs = info["runs"]
    known = [name for name in FALSE_ALARM_RUNS if name in runs] + sorted(set(runs) - set(FALSE_ALARM_RUNS))
    rows = [
        {
            "run": f"`{name}`: {FALSE_ALARM_RUNS.get(name, name)}"
            + (
                f" ({runs[name]['clipped_steps']:,} of {runs[name]['windows']:,} steps clipped)"
                if "clipped_steps" in runs[name]
                else ""
            ),
            "windows (segments x steps)": f"{runs[name]['windows']:,} ({runs[name]['segments']} x "
            f"{runs[name]['windows_per_segment']})",
            "p50": f"{runs[name]['p50']:.2f}",
            "p90": f"{runs[name]['p90']:.2f}",
            "p99": f"{runs[name]['p99']:.2f}",
            "max": f"{runs[name]['max']:.2f}",
            f">= {FALSE_ALARM_TAIL:g}": str(runs[name]["at_least_0_9"]),
            "flagged (target 0)": str(runs[name]["flagged"]),
            "seconds": f"{runs[name]['seconds']:.0f}",
        }
        for name in known
    ]
    total = sum(run["windows"] for run in runs.values())
    rows.append(
        {
            "run": "**all**",
            "windows (segments x steps)": f"{total:,}",
            "p50": "",
            "p90": "",
            "p99": "",
            "max": f"{max(run['max'] for run in runs.values()):.2f}",
            f">= {FALSE_ALARM_TAIL:g}": str(sum(run["at_least_0_9"] for run in runs.values())),
            "flagged (target 0)": str(sum(run["flagged"] for run in runs.values())),
            "seconds": f"{sum(run['seconds'] for run in runs.values()):.0f}",
        }
    )
    return markdown_table(pd.DataFrame(rows))


def _false_alarms_verdict(info: dict[str, Any]) -> list[str]:
    """Whether the targets are met: no flag, and the tail below FALSE_ALARM_TAIL; the closest window named."""
    runs = info["runs"].values()
    flagged = sum(run["flagged"] for run in runs)
    tail = max(max(run["p99"], run["max"]) for run in runs)
    closest = max(runs, key=lambda run: run["max"])
    lines = [
        f"False alarms: **{flagged}** (target 0, {'met' if flagged == 0 else 'NOT met'}); the tail (p99 and max) "
        f"{'below' if tail < FALSE_ALARM_TAIL else 'reaches'} {FALSE_ALARM_TAIL:g} of the allowance "
        f"({'met' if tail < FALSE_ALARM_TAIL else 'NOT met'}). Closest window: {closest['closest_lines'][0]}.",
    ]
    for run in runs:
        lines += [f"Flagged: {line}." for line in run.get("flagged_lines", [])]
    return lines


def _false_alarms_section(
    raw: dict[str, Any],
    scaling_full: dict[str, Any] | Sequence[tuple[str, dict[str, Any]]] | None = None,
) -> list[str]:
    """Long correct runs audited at every step: the distribution of their windows' worst ratio to the
    allowance, and the windows flagged (benchmarks/test_audit_false_alarms.py); a committed full run
    among ``scaling_full`` (any file holding this benchmark) shown beside this run."""
    info = _false_alarm_runs(raw)
    fulls = (
        []
        if scaling_full is None or isinstance(scaling_full, dict)
        else [(name, run, found) for name, run in scaling_full if (found := _false_alarm_runs(run)) is not None]
    )
    if info is None and not fulls:
        return []
    lines = [
        "## equiv.audit on long correct runs: false alarms",
        "",
        "Correct runs audited at every optimizer step (`every=1`), each in segments of fresh seeds and data (no "
        "two windows alike): per judged window, its worst ratio to the allowance (the tensor closest to it; on "
        "any rank under DDP), and the windows flagged. A correct run should never be flagged, and its windows "
        f"should stay clear of the allowance: the target is 0 flagged and the tail (p99, max) below "
        f"{FALSE_ALARM_TAIL:g}. Floor samples run while a row is past, or above half of, its allowance, so a "
        "window settled early shows a ratio at or above the one every sample would give (the status is the same).",
        "",
    ]
    for name, run, full in fulls:
        lines += [
            f"Full run (`EQUIV_BENCH_QUICK=0 pytest benchmarks/test_audit_false_alarms.py --benchmark-only`), "
            f"committed as {name}: run of {str(run.get('datetime', 'unknown time'))[:19]}, "
            f"{full.get('threads', '?')} thread(s), torch {full.get('torch_version', '?')}, 1-minute load "
            f"{full.get('load_average_1min', '?')} at the end.",
            "",
            _false_alarms_table(full),
            "",
            *_false_alarms_verdict(full),
            "",
        ]
    if info is not None:
        mode = "quick: CI's count" if info.get("quick") else "full"
        lines += [
            f"This run ({mode}; {sum(run['windows'] for run in info['runs'].values()):,} windows, "
            f"{info.get('threads', '?')} thread(s), 1-minute load {info.get('load_average_1min', '?')} at the end):",
            "",
            _false_alarms_table(info),
            "",
            *_false_alarms_verdict(info),
            "",
        ]
    return lines

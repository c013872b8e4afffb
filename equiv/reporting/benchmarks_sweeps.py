"""The sweeps' sections of reports/benchmarks.md: what ``equiv sweep transformers`` costs per class
(benchmarks/test_sweep.py), and the Ray fan-out's tasks per second in this process and on a local Ray of 1, 2
and 4 workers (benchmarks/test_fanout_speed.py).  They render what the benchmarks recorded and measure nothing."""

from __future__ import annotations

from typing import Any

import pandas as pd

from equiv.reporting.markdown import markdown_table

__all__ = ["FANOUT_WORKERS", "IN_PROCESS", "fanout_section", "sweep_cost_section"]

#: The local Ray sizes the benchmark times, beside the in-process loop (its mode name).
FANOUT_WORKERS = (1, 2, 4)
IN_PROCESS = "in process"


def fanout_section(raw: dict[str, Any]) -> list[str]:
    """One table: per mode, wall seconds, Ray's own seconds, tasks per second in all and while running, speed-up."""
    infos = [b["extra_info"] for b in raw.get("benchmarks", []) if b.get("extra_info", {}).get("fanout")]
    if not infos:
        return []
    info = infos[0]
    running = info["tasks_per_second_running"]
    one_worker = str(FANOUT_WORKERS[0])
    rows = [
        {
            "mode": IN_PROCESS if mode == IN_PROCESS else f"local Ray, {mode} worker{'s' if mode != '1' else ''}",
            "wall s": f"{info['seconds'][mode]:.1f}",
            "tasks' span s": f"{info['span_seconds'][mode]:.1f}",
            "Ray's own s": "-" if mode == IN_PROCESS else f"{info['seconds'][mode] - info['span_seconds'][mode]:.1f}",
            "tasks/s": f"{info['tasks_per_second'][mode]:.2f}",
            "tasks/s while running": f"{running[mode]:.2f}",
            "speed-up vs 1 worker (while running)": (
                "-" if mode == IN_PROCESS else f"{running[mode] / running[one_worker]:.2f}x"
            ),
        }
        for mode in info["seconds"]
    ]
    return [
        "## Ray fan-out: tasks per second",
        "",
        f"`equiv.distributed.fanout.fan_out` (what `equiv sweep ... --ray` calls) on {info['tasks']} CPU-bound toy "
        f"tasks of {info['task_seconds']:.2f} s each (pure Python, one core; a sweep subject's order of size), in "
        "this process and on a local Ray started and shut down by each call, the modes timed alternately "
        f"({info['rounds']} round(s), medians) on a machine of {info['cpus']} cores at load "
        f"{info['load_average_1min']}. *The tasks' span* runs from the first task's start to the last one's end, "
        "as the tasks recorded them; *Ray's own* seconds are the rest of the call's wall time (ray.init, fresh "
        "workers, shutdown). Workers past the machine's idle cores share them: 4 workers on 2 cores cannot beat 2, "
        "and other work on the machine takes its share. Every mode returned the same values in the same order "
        "(asserted by the benchmark).",
        "",
        markdown_table(pd.DataFrame(rows)),
        "",
    ]


def sweep_cost_section(raw: dict[str, Any]) -> list[str]:
    """One table: per timed class, its verdict and median seconds; then the whole sweep projected from them."""
    infos = [b["extra_info"] for b in raw.get("benchmarks", []) if b.get("extra_info", {}).get("sweep_transformers")]
    if not infos:
        return []
    info = infos[0]
    classes = info["classes"]
    rows = [
        {
            "class": f"`{name}`",
            "verdict": entry["verdict"],
            "seconds (median)": f"{entry['median_s']:.2f}",
        }
        for name, entry in classes.items()
    ]
    per_class = sum(entry["median_s"] for entry in classes.values()) / len(classes)
    projected = per_class * info["subjects_installed"]
    return [
        "## `equiv sweep transformers`: cost per class",
        "",
        f"One class of the sweep, start to row: built tiny from its config, trained by the Trainer for 3 optimizer "
        f"steps of 2 micro-batches, 2 of them audited (and the failing one's witness recovered), on transformers "
        f"{info['transformers_version']}, {info['threads']} thread(s), {info['rounds']} round(s), medians, at load "
        f"{info['load_average_1min']}; the verdicts are asserted by the benchmark. At their mean, "
        f"{per_class:.2f} s a class, the installed release's {info['subjects_installed']} classes would take "
        f"{projected / 60:.1f} min in one process: a projection, not a measurement (a class that cannot be built "
        "stops early and costs less; a larger head costs more). `--ray` divides it by the workers the machine's "
        "idle cores allow, less Ray's own seconds (the next section).",
        "",
        markdown_table(pd.DataFrame(rows)),
        "",
    ]

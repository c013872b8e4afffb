"""The Ray fan-out's section of reports/benchmarks.md (benchmarks/test_fanout_speed.py): tasks per second of
``equiv.distributed.fanout.fan_out`` in this process and on a local Ray of 1, 2 and 4 workers.  It renders what
the benchmark recorded and measures nothing."""

from __future__ import annotations

from typing import Any

import pandas as pd

from equiv.reporting.markdown import markdown_table

__all__ = ["FANOUT_WORKERS", "IN_PROCESS", "fanout_section"]

#: The local Ray sizes the benchmark times, beside the in-process loop (its mode name).
FANOUT_WORKERS = (1, 2, 4)
IN_PROCESS = "in process"


def fanout_section(raw: dict[str, Any]) -> list[str]:
    """One table: per mode, wall seconds, Ray's start-up, tasks per second with and without it, speed-up."""
    infos = [b["extra_info"] for b in raw.get("benchmarks", []) if b.get("extra_info", {}).get("fanout")]
    if not infos:
        return []
    info = infos[0]
    rates, rates_after = info["tasks_per_second"], info["tasks_per_second_after_start_up"]
    one_worker = str(FANOUT_WORKERS[0])
    rows = [
        {
            "mode": IN_PROCESS if mode == IN_PROCESS else f"local Ray, {mode} worker{'s' if mode != '1' else ''}",
            "wall s": f"{info['seconds'][mode]:.1f}",
            "Ray start-up s": f"{info['start_up_seconds'][mode]:.1f}" if mode in info["start_up_seconds"] else "-",
            "tasks/s": f"{rates[mode]:.2f}",
            "tasks/s after start-up": f"{rates_after[mode]:.2f}" if mode in rates_after else "-",
            "speed-up vs 1 worker (after start-up)": (
                f"{rates_after[mode] / rates_after[one_worker]:.2f}x" if mode in rates_after else "-"
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
        f"{info['load_average_1min']}. *Ray start-up* is a one-task call of a no-op (ray.init, a fresh worker, "
        "shutdown); *after start-up* divides the tasks by the wall time less it. Workers past the machine's "
        "cores share them: 4 workers on 2 cores cannot beat 2. Every mode returned the same values in the same "
        "order (asserted by the benchmark).",
        "",
        markdown_table(pd.DataFrame(rows)),
        "",
    ]

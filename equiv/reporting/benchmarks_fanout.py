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

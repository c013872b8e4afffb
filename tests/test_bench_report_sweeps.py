"""reports/benchmarks.md's Ray fan-out section (equiv.reporting.benchmarks_sweeps), from a recorded run."""

from __future__ import annotations

from typing import Any

from test_bench_report import _fixture, _table_after

from equiv.reporting.benchmarks import render_report
from equiv.reporting.benchmarks_sweeps import FANOUT_WORKERS, IN_PROCESS


def _fanout_record(seconds: dict[str, float], spans: dict[str, float], tasks: int = 8) -> dict[str, Any]:
    return {
        "name": "test_fanout_speed",
        "extra_info": {
            "fanout": True,
            "tasks": tasks,
            "rounds": 3,
            "cpus": 2,
            "load_average_1min": 1.5,
            "task_seconds": spans[IN_PROCESS] / tasks,
            "seconds": seconds,
            "span_seconds": spans,
            "tasks_per_second": {mode: tasks / value for mode, value in seconds.items()},
            "tasks_per_second_running": {mode: tasks / value for mode, value in spans.items()},
        },
        "stats": {"median": 1.0},
    }


def test_the_fanout_rows_show_each_worker_count_with_and_without_rays_own_time() -> None:
    modes = [str(workers) for workers in FANOUT_WORKERS]
    seconds = {IN_PROCESS: 8.0, modes[0]: 13.0, modes[1]: 9.0, modes[2]: 10.0}
    spans = {IN_PROCESS: 8.0, modes[0]: 8.0, modes[1]: 4.0, modes[2]: 5.0}
    raw = _fixture()
    raw["benchmarks"].append(_fanout_record(seconds, spans))
    rows = _table_after(render_report(raw), "## Ray fan-out: tasks per second")
    assert [row["mode"] for row in rows] == [
        "in process",
        "local Ray, 1 worker",
        "local Ray, 2 workers",
        "local Ray, 4 workers",
    ]
    assert [row["tasks/s"] for row in rows] == ["1.00", "0.62", "0.89", "0.80"]
    assert [row["Ray's own s"] for row in rows] == ["-", "5.0", "5.0", "5.0"]  # wall less the tasks' span
    # while running: 8 tasks in 8 s, 4 s, 5 s; 2 workers twice 1 worker's rate
    assert [row["tasks/s while running"] for row in rows] == ["1.00", "1.00", "2.00", "1.60"]
    assert [row["speed-up vs 1 worker (while running)"] for row in rows] == ["-", "1.00x", "2.00x", "1.60x"]
    assert "## Ray fan-out" not in render_report(_fixture())  # no fan-out record, no section


def test_the_sweep_cost_rows_show_each_timed_class_and_project_the_whole_sweep_from_their_mean() -> None:
    raw = _fixture()
    raw["benchmarks"].append(
        {
            "name": "test_sweep_cost_per_class",
            "extra_info": {
                "sweep_transformers": True,
                "threads": 1,
                "rounds": 5,
                "load_average_1min": 1.0,
                "transformers_version": "5.24.0",
                "subjects_installed": 600,
                "classes": {
                    "GPT2ForTokenClassification": {
                        "outcome": "not_equivalent",
                        "verdict": "not equivalent",
                        "median_s": 1.5,
                    },
                    "LlamaForCausalLM": {"outcome": "equivalent", "verdict": "equivalent", "median_s": 0.5},
                },
            },
            "stats": {"median": 2.0},
        }
    )
    report = render_report(raw)
    rows = _table_after(report, "## `equiv sweep transformers`: cost per class")
    assert [(row["class"], row["verdict"], row["seconds (median)"]) for row in rows] == [
        ("`GPT2ForTokenClassification`", "not equivalent", "1.50"),
        ("`LlamaForCausalLM`", "equivalent", "0.50"),
    ]
    assert "1.00 s a class, the installed release's 600 classes would take 10.0 min" in report  # (1.5+0.5)/2 x 600
    assert "cost per class" not in render_report(_fixture())  # no sweep record, no section

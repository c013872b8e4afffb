"""equiv.reporting.benchmarks: a small --benchmark-json fixture renders a deterministic report."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from equiv.cli import main
from equiv.reporting.benchmarks import THREAD_MODES, VERIFY_MODES, load_benchmarks, render_report
from equiv.reporting.markdown import read_markdown_table

MIB, KIB = 2**20, 2**10
BATCH = 32
STATIC, PER_SAMPLE, STEP_PEAK = 1 * MIB, 64 * KIB, int(1.5 * MIB)
T_FIXED, T_SAMPLE = 0.001, 0.00001


def _bench(n: int, implementation: str, *, seconds: float, fwd_bwd: int) -> dict[str, Any]:
    sizes = [len(chunk) for chunk in _chunks(BATCH, n)]
    return {
        "name": f"test_step[toy-N{n}-{implementation}]",
        "extra_info": {
            "workload": "toy",
            "implementation": implementation,
            "n_micro_batches": n,
            "micro_batch_size": max(sizes),
            "micro_batch_sizes": sizes,
            "global_batch_size": BATCH,
            "device": "cpu",
            "dtype": "float32",
            "threads": 2,
            "quick": True,
            "torch_version": "2.13.0",
            "parameters": 1234,
            "description": "a toy",
            "memory_method": "storage-counter",
            "baseline_bytes": STATIC // 2,
            "forward_backward_peak_bytes": fwd_bwd,
            "optimizer_step_peak_bytes": STEP_PEAK,
            "peak_bytes": max(fwd_bwd, STEP_PEAK),
        },
        "stats": {"median": seconds, "q1": seconds * 0.9, "q3": seconds * 1.1, "rounds": 3},
    }


def _chunks(total: int, n: int) -> list[range]:
    base, extra = divmod(total, n)
    return [range(base + (i < extra)) for i in range(n)]


def _fixture() -> dict[str, Any]:
    benchmarks = []
    for n in (1, 2, 3, 4, 8):
        m = -(-BATCH // n)
        fwd_bwd = STATIC + PER_SAMPLE * m - (KIB if n == 1 else 0)  # N=1: no gradient temporary
        seconds = n * T_FIXED + BATCH * T_SAMPLE
        benchmarks.append(_bench(n, "native", seconds=seconds, fwd_bwd=fwd_bwd))
        benchmarks.append(_bench(n, "accumulator", seconds=seconds * 1.02, fwd_bwd=fwd_bwd))
    benchmarks.append(_bench(1, "checkpoint", seconds=0.002, fwd_bwd=STATIC + PER_SAMPLE * 8))
    benchmarks.append(
        {
            "name": "test_accumulator_overhead[toy]",
            "extra_info": {
                "workload": "toy",
                "implementation": "paired",
                "n_micro_batches": 8,
                "overhead_ratio": 1.0125,
                "overhead_ratio_q1": 1.0,
                "overhead_ratio_q3": 1.03,
                "pairs": 8,
            },
            "stats": {"median": 0.01, "q1": 0.01, "q3": 0.01, "rounds": 8},
        }
    )
    benchmarks.append({"name": "test_unrelated", "extra_info": {}, "stats": {"median": 1.0}})
    return {
        "datetime": "2026-01-01T00:00:00.000000",
        "machine_info": {"cpu": {"brand_raw": "Test CPU", "count": 2}},
        "benchmarks": benchmarks,
    }


def test_rows_are_sorted_whatever_the_json_order() -> None:
    raw = _fixture()
    shuffled = {**raw, "benchmarks": random.Random(0).sample(raw["benchmarks"], len(raw["benchmarks"]))}
    assert render_report(shuffled) == render_report(raw)
    steps, paired = load_benchmarks(raw)
    assert list(steps["implementation"][:3]) == ["native", "accumulator", "checkpoint"]
    assert len(steps) == 11 and len(paired) == 1  # the unrelated benchmark is left out


def _table_after(report: str, marker: str) -> list[dict[str, str]]:
    """The first table after ``marker``, parsed: cells compared, not tabulate's padding."""
    return read_markdown_table(report[report.index(marker) :])


def test_report_has_table_fit_and_chart() -> None:
    report = render_report(_fixture())
    rows = {(row["N"], row["implementation"]): row for row in _table_after(report, "## toy")}
    # Table rows: uneven split spelled out, memory in MiB at fixed precision, ratio to native.
    assert rows["3", "accumulator"]["micro-batch"] == "11+11+10"
    assert rows["3", "accumulator"]["fwd/bwd peak MiB"] == "1.688"
    assert rows["3", "accumulator"]["time / native"] == "1.020"
    # The fit recovers the synthetic terms (memory on N >= 2, time on every N).
    assert "**1.000 MiB + 64.00 KiB x micro-batch**" in report
    assert "optimizer-step peak **1.500 MiB**" in report
    assert "**N x 1.02 ms + B x 10.2 us**" in report
    # Leave-one-out on exact lines: no error, except N=1, predicted without its missing temporary.
    held_out = {row["N left out"]: row for row in _table_after(report, "Prediction error on each N left out")}
    assert (held_out["4"]["fwd/bwd MiB measured"], held_out["4"]["fwd/bwd MiB predicted"]) == ("1.500", "1.500")
    assert held_out["4"]["fwd/bwd error"] == "+0.0%"
    assert held_out["1"]["fwd/bwd MiB measured"] == "2.999"
    assert "**1.012x** the native loop's step time" in report
    # The paired figure sits on the Accumulator row of its N only, and in the summary.
    assert [key for key, row in rows.items() if row["overhead, paired"] != "-"] == [("8", "accumulator")]
    assert rows["8", "accumulator"]["overhead, paired"] == "1.012"
    assert rows["8", "accumulator"]["micro-batch"] == "4"
    assert _table_after(report, "## Summary")[0]["Accumulator overhead N=8 (paired)"] == "1.012"
    assert "```mermaid\nxychart-beta" in report
    assert 'x-axis ["N=1", "N=2", "N=3", "N=4", "N=8"]' in report


def test_main_writes_the_markdown(tmp_path: Path) -> None:
    source = tmp_path / "benchmarks.json"
    source.write_text(json.dumps(_fixture()))
    out = tmp_path / "reports" / "benchmarks.md"
    # The output's folder must exist: refused up front, not created (a typo must not make folders).
    assert main(["report", "benchmarks", "--json", str(source), "--out", str(out)]) == 2
    assert not out.parent.exists()
    out.parent.mkdir()
    assert main(["report", "benchmarks", "--json", str(source), "--out", str(out)]) == 0
    assert out.read_text() == render_report(_fixture())


def test_json_without_equiv_benchmarks_is_refused() -> None:
    with pytest.raises(ValueError, match="holds no equiv step benchmarks"):
        render_report({"benchmarks": []})


def test_checker_scaling_rows_get_their_own_table_with_targets() -> None:
    raw = _fixture()
    rows_in = ((100_000, "passing", 40.0, 143.0), (1_000_000, "passing", 7.5, 96.0), (1_000_000, "failing", 20.0, 99.0))
    for parameters, verdict, ratio, bytes_per_parameter in rows_in:
        raw["benchmarks"].append(
            {
                "name": f"test_check_scaling[{verdict}-{parameters}]",
                "extra_info": {
                    "scaling": True,
                    "parameters": parameters,
                    "verdict": verdict,
                    "check_median_s": 1.0,
                    "own_steps_median_s": 1.0 / ratio,
                    "time_ratio": ratio,
                    "check_bytes_per_parameter": bytes_per_parameter,
                    "runs": ["full batch float64", "candidate float64", "candidate float32", "full batch float32"],
                },
                "stats": {"median": 1.0},
            }
        )
    report = render_report(raw)
    rows = _table_after(report, "## What a check costs as the model grows")
    assert [row["parameters"] for row in rows] == ["0.10M", "1.00M", "1.00M"]
    assert [row["candidate"] for row in rows] == ["passing", "passing", "failing"]
    assert [row["check / own steps"] for row in rows] == ["40.0x", "7.5x", "20.0x"]
    # The time targets hold from 1M parameters on: 8x passing, 15x failing.
    assert [row["time target (>= 1M)"] for row in rows] == ["-", "met (<= 8x)", "NOT met (<= 15x: 1.33x over)"]
    assert [row["memory target <= 100 B/param"] for row in rows] == ["NOT met", "met", "met"]
    assert rows[0]["runs made"] == "truth + 1 floor + 2 candidate"
    assert "## What a check costs" not in render_report(_fixture())  # no scaling rows, no section


def test_peer_rows_get_their_own_table_and_stay_out_of_the_step_tables() -> None:
    raw = _fixture()
    steps_only = render_report(_fixture())
    raw["benchmarks"].append(
        {
            "name": "test_peer_step_ratios[mlp-N8]",
            "extra_info": {
                "peers": True,
                "workload": "mlp",
                "n_micro_batches": 8,
                "rotations": 6,
                "accelerate_version": "1.15.0",
                "native_median_s": 0.1,
                "accumulator_ratio": 1.01,
                "accumulator_ratio_q1": 0.99,
                "accumulator_ratio_q3": 1.02,
                "accelerate_ratio": 1.2,
                "accelerate_ratio_q1": 1.1,
                "accelerate_ratio_q3": 1.3,
            },
            "stats": {"median": 0.6},
        }
    )
    report = render_report(raw)
    rows = _table_after(report, "## Peers' steps, timed side by side")
    assert rows[0]["Accelerate 1.15.0 accumulate() / native"] == "1.200 (1.100-1.300)"
    assert rows[0]["equiv.Accumulator / native"] == "1.010 (0.990-1.020)"
    # Everything before the peers' section is what the step benchmarks alone give.
    assert report[: report.index("## Peers'")].rstrip() == steps_only.rstrip()
    # Fabric was not installed in that run: no column, and the section says so.
    assert not any("Fabric" in key for key in rows[0])
    assert "Lightning Fabric was not installed in this run" in report


def test_a_fabric_column_when_fabric_was_timed() -> None:
    raw = _fixture()
    raw["benchmarks"].append(
        {
            "name": "test_peer_step_ratios[mlp-N8]",
            "extra_info": {
                "peers": True,
                "workload": "mlp",
                "n_micro_batches": 8,
                "rotations": 6,
                "accelerate_version": "1.15.0",
                "fabric_version": "2.6.6",
                "native_median_s": 0.1,
                **{
                    f"{name}_ratio{q}": value
                    for name in ("accumulator", "accelerate", "fabric")
                    for q, value in (("", 1.05), ("_q1", 1.0), ("_q3", 1.1))
                },
            },
            "stats": {"median": 0.6},
        }
    )
    report = render_report(raw)
    rows = _table_after(report, "## Peers' steps, timed side by side")
    assert rows[0]["Lightning Fabric 2.6.6 no_backward_sync / native"] == "1.050 (1.000-1.100)"
    assert "not installed" not in report[report.index("## Peers'") :]


def test_planner_regret_rows_say_whether_the_goal_is_met() -> None:
    raw = _fixture()
    exhaustive = {"1": {"peak_bytes": 300, "median_step_s": 1.0}, "2": {"peak_bytes": 200, "median_step_s": 1.2}}
    raw["benchmarks"].append(
        {
            "name": "test_planner_regret[mlp]",
            "extra_info": {
                "planner_regret": True,
                "workload_name": "mlp",
                "exhaustive": exhaustive,
                "rows": [
                    {
                        "budget_bytes": 250,
                        "picked_n": 2,
                        "picked_fits": True,
                        "best_n": 2,
                        "regret": 0.0,
                        "probes": 3,
                        "probes_over_budget": 0,
                    },
                    {
                        "budget_bytes": 330,
                        "picked_n": 2,
                        "picked_fits": True,
                        "best_n": 1,
                        "regret": 0.2,
                        "probes": 4,
                        "probes_over_budget": 1,
                    },
                ],
            },
            "stats": {"median": 1.0},
        }
    )
    rows = _table_after(render_report(raw), "## Planner regret")
    assert [row["N fitting (measured)"] for row in rows] == ["2", "1, 2"]
    assert [row["regret"] for row in rows] == ["0.0%", "20.0%"]
    assert [row["goal <= 5%"] for row in rows] == ["met", "NOT met"]
    assert rows[1]["probes (over budget)"] == "4 (1)"


def test_a_committed_full_scaling_run_is_shown_beside_this_runs_sizes() -> None:
    full = {
        "datetime": "2026-11-23T03:18:39",
        "benchmarks": [
            {
                "name": "test_check_scaling[124M GPT-2]",
                "extra_info": {
                    "scaling": True,
                    "size": "124M GPT-2",
                    "parameters": 124_439_808,
                    "check_median_s": 160.8,
                    "own_steps_median_s": 9.59,
                    "time_ratio": 16.8,
                    "bare_runs_ratio": 14.9,
                    "check_over_bare_runs": 1.13,
                    "check_bytes_per_parameter": 110.0,
                    "verdict": "passing",
                    "load_average_1min": 2.43,
                    "torch_version": "2.13.0+cpu",
                    "threads": 1,
                },
                "stats": {"median": 160.8},
            }
        ],
    }
    report = render_report(_fixture(), scaling_full=full)
    assert "run of 2026-11-23T03:18:39" in report
    rows = _table_after(report, "committed as reports/check_scaling_full.json")
    assert len(rows) == 1 and rows[0]["model"] == "124M GPT-2"
    assert rows[0]["bare runs / own steps"] == "14.9x" and rows[0]["check / bare runs"] == "1.13x"
    assert rows[0]["time target (>= 1M)"] == "NOT met (<= 8x: 2.10x over)"
    assert rows[0]["memory target <= 100 B/param"] == "NOT met"


def test_a_gpu_full_run_is_shown_beside_the_cpu_one_without_the_cpu_targets() -> None:
    def run(device: str, check_s: float) -> dict[str, Any]:
        return {
            "datetime": "2026-11-24T22:49:01",
            "benchmarks": [
                {
                    "name": "test_check_scaling[4M]",
                    "extra_info": {
                        "scaling": True,
                        "size": "4M",
                        "parameters": 4_180_740,
                        "check_median_s": check_s,
                        "own_steps_median_s": 0.05,
                        "time_ratio": check_s / 0.05,
                        "bare_runs_ratio": 10.0,
                        "check_over_bare_runs": check_s / 0.5,
                        "model_build_ratio": 5.3,
                        "device": device,
                        "check_bytes_per_parameter": 95.0,
                        "verdict": "passing",
                        "threads": 1,
                    },
                }
            ],
        }

    report = render_report(
        _fixture(),
        scaling_full=[
            ("reports/check_scaling_full.json", run("cpu", 0.6)),
            ("reports/check_scaling_gpu.json", run("cuda", 0.7)),
        ],
    )
    cpu = _table_after(report, "committed as reports/check_scaling_full.json")
    gpu = _table_after(report, "committed as reports/check_scaling_gpu.json")
    assert cpu[0]["time target (>= 1M)"] == "NOT met (<= 8x: 1.50x over)"
    assert gpu[0]["time target (>= 1M)"] == "-"  # the targets are the CPU's
    assert gpu[0]["model build / own steps"] == "5.3x"
    assert "Full run on the GPU" in report and "building the case's model takes 5.3-5.3x" in report


def test_a_full_run_says_how_the_host_allocator_was_set() -> None:
    def run(allocator: str) -> dict[str, Any]:
        return {
            "datetime": "2026-11-25T01:16:08",
            "benchmarks": [
                {
                    "name": "test_check_scaling[4M]",
                    "extra_info": {
                        "scaling": True,
                        "size": "4M",
                        "parameters": 4_180_740,
                        "check_median_s": 0.4,
                        "own_steps_median_s": 0.05,
                        "time_ratio": 8.0,
                        "bare_runs_ratio": 5.0,
                        "check_over_bare_runs": 1.6,
                        "check_bytes_per_parameter": 92.0,
                        "verdict": "passing",
                        "threads": 1,
                        "host_allocator": allocator,
                    },
                }
            ],
        }

    kept = "glibc malloc keeps freed memory (M_MMAP_THRESHOLD=33554432, M_TRIM_THRESHOLD=never)"
    report = render_report(
        _fixture(),
        scaling_full=[
            ("reports/check_scaling_full.json", run("glibc default")),
            ("reports/check_scaling_full_kept_memory.json", run(kept)),
        ],
    )
    assert "1 thread(s), 1-minute load ?-?, glibc's malloc as it comes." in report
    assert "host memory as the `equiv` command sets it (`EQUIV_BENCH_KEEP_FREED_MEMORY=1`" in report
    assert _table_after(report, "check_scaling_full_kept_memory.json")[0]["time target (>= 1M)"] == "met (<= 8x)"


def test_verify_speed_rows_say_whether_the_correct_step_doubled() -> None:
    raw = _fixture()
    modes = VERIFY_MODES
    for verdict, examples, shipped_seconds, eager_seconds in (("failing", 58, 2.0, 2.8), ("passing", 200, 5.0, 9.0)):
        raw["benchmarks"].append(
            {
                "name": f"test_verify_speed[{verdict}]",
                "extra_info": {
                    "verify_speed": True,
                    "verdict": verdict,
                    "candidate": f"{verdict}_step",
                    "seed": 0,
                    "max_examples": 200,
                    "examples": examples,
                    "found": verdict == "failing",
                    "seconds": dict(zip(modes, (shipped_seconds, eager_seconds), strict=True)),
                    "cases_per_second": {modes[0]: examples / shipped_seconds, modes[1]: examples / eager_seconds},
                    "speedup": eager_seconds / shipped_seconds,
                },
                "stats": {"median": 1.0},
            }
        )
    rows = _table_after(render_report(raw), "## equiv verify: cases per second")
    assert [row["candidate"] for row in rows] == ["passing_step (passing)", "failing_step (failing)"]
    assert [row["cases/s, as shipped"] for row in rows] == ["40.0", "29.0"]
    assert [row["speed-up"] for row in rows] == ["1.80x", "1.40x"]
    # The target is on the correct step only: 1.8x is short of 2x, and says by how much.
    assert [row["target (correct step, >= 2x)"] for row in rows] == ["NOT met (>= 2x: 1.80x)", "-"]
    assert "## equiv verify" not in render_report(_fixture())  # no verify rows, no section


def test_a_missed_check_target_says_why_from_the_rows_own_figures() -> None:
    raw = _fixture()
    for verdict, ratio, bare, bytes_per_parameter in (("passing", 12.0, 6.0, 96.0), ("failing", 30.0, 16.0, 104.0)):
        raw["benchmarks"].append(
            {
                "name": f"test_check_scaling[{verdict}]",
                "extra_info": {
                    "scaling": True,
                    "parameters": 4_000_000,
                    "verdict": verdict,
                    "check_median_s": 1.0,
                    "own_steps_median_s": 1.0 / ratio,
                    "time_ratio": ratio,
                    "bare_runs_ratio": bare,
                    "check_over_bare_runs": ratio / bare,
                    "check_bytes_per_parameter": bytes_per_parameter,
                    "runs": ["full batch float64", "candidate float64"],
                },
                "stats": {"median": 1.0},
            }
        )
    why = render_report(raw).split("Why a target is missed:")[1]
    assert "Passing check, 8x target missed at 1 of 1 sizes" in why
    assert "alone take 6.0-6.0x" in why and "past the target at 0 of 1 sizes" in why
    assert "Failing check, 15x target missed at 1 of 1 sizes" in why and "alone take 16.0-16.0x" in why
    assert "past the target at 1 of 1 sizes" in why
    assert "Memory, 100 B/param target missed by 1 row(s) (failing; 104 B/param at most)" in why


@pytest.mark.parametrize(("chosen_ms", "verdict"), [(110.0, "met"), (400.0, "NOT met")])
def test_verify_threads_rows_say_whether_equivs_choice_is_within_the_target(chosen_ms: float, verdict: str) -> None:
    raw = _fixture()
    default, chosen, one = THREAD_MODES
    per_case = {default: 800.0, chosen: chosen_ms, one: 100.0}
    raw["benchmarks"].append(
        {
            "name": "test_verify_threads",
            "extra_info": {
                "verify_threads": True,
                "seed": 0,
                "max_examples": 20,
                "examples": 20,
                "default_threads": 2,
                "per_case_ms": per_case,
                "ratio_chosen": chosen_ms / 100.0,
                "ratio_default": 8.0,
            },
            "stats": {"median": 1.0},
        }
    )
    [row] = _table_after(render_report(raw), "## equiv verify on a busy machine: threads")
    assert row[f"{chosen} / {one}"] == f"{chosen_ms / 100:.2f}x" and row[f"{default} / {one}"] == "8.00x"
    assert row["ms per case, torch's default threads (2)"] == "800"
    assert row["target (<= 1.5x)"] == verdict


def test_the_ddp_audit_row_states_bytes_per_parameter() -> None:
    from equiv.reporting.benchmarks_audit import _audit_ddp_lines

    info = {
        "audit_ddp_overhead": True,
        "world_size": 2,
        "parameters": 1000,
        "micro_batches": 4,
        "rounds": 5,
        "plain_step_median_s": 0.01,
        "audited_ratio": 8.0,
        "bytes_per_audited_step": 20008.0,
    }
    text = "\n".join(_audit_ddp_lines({"benchmarks": [{"extra_info": info}]}))
    assert "| 2 " in text and "8.0x" in text and "20,008" in text and "| 20.0 " in text
    deepspeed = {**info, "engine": "deepspeed", "audited_ratio": 9.0}
    rows = "\n".join(_audit_ddp_lines({"benchmarks": [{"extra_info": info}, {"extra_info": deepspeed}]}))
    assert "| DDP " in rows and "| DeepSpeed ZeRO-2 " in rows and "9.0x" in rows  # beside each other
    assert _audit_ddp_lines({"benchmarks": []}) == []


def test_search_time_rows_are_shown_beside_the_search_they_extend() -> None:
    raw = _fixture()
    rows = [
        {
            "search": "verify_distributed: DDP, tokens",
            "cases": 10,
            "seconds": 5.0,
            "per_case_s": 0.5,
            "baseline": "",
            "ratio": None,
        },
        {
            "search": "verify_distributed: CP, tokens",
            "cases": 10,
            "seconds": 8.0,
            "per_case_s": 0.8,
            "baseline": "verify_distributed: DDP, tokens",
            "ratio": 1.6,
        },
    ]
    raw["benchmarks"].append(
        {
            "name": "test_search_times",
            "extra_info": {"search_times": True, "seed": 0, "threads": 1, "load_average_1min": 1.5, "rows": rows},
            "stats": {"median": 1.0},
        }
    )
    base, cp = _table_after(
        render_report(raw), "## Search times: context parallelism, router losses, packed and RL losses"
    )
    assert base["beside"] == "-" and base["per case / beside"] == "-" and base["s per case"] == "0.500"
    assert cp["beside"] == "verify_distributed: DDP, tokens" and cp["per case / beside"] == "1.60x"
    assert cp["seconds"] == "8.0" and cp["cases"] == "10"


def _false_alarm_run(windows: int, *, p99: float, largest: float, flagged: int = 0) -> dict[str, Any]:
    return {
        "windows": windows,
        "segments": 2,
        "windows_per_segment": windows // 2,
        "p50": 0.2,
        "p90": 0.4,
        "p99": p99,
        "max": largest,
        "at_least_0_9": int(largest >= 0.9),
        "flagged": flagged,
        "seconds": 12.0,
        "flagged_lines": [f"seed 1: step 3: NOT equivalent (x{i})" for i in range(flagged)],
        "closest_lines": [f"seed 0: step 7: equivalent (worst {largest:.2g} of its allowance)"],
    }


def test_long_audited_runs_show_each_runs_tail_and_false_alarms() -> None:
    raw = _fixture()
    runs = {
        "trainer": _false_alarm_run(100, p99=0.6, largest=0.85),
        "adamw_clipped": {**_false_alarm_run(200, p99=0.5, largest=0.95), "clipped_steps": 150},
        "ddp": _false_alarm_run(100, p99=0.4, largest=1.2, flagged=1),
    }
    raw["benchmarks"].append(
        {
            "name": "test_audit_false_alarms",
            "stats": {"median": 1.0},
            "extra_info": {
                "audit_false_alarms": True,
                "quick": True,
                "threads": 1,
                "load_average_1min": 1.5,
                "runs": runs,
            },
        }
    )
    report = render_report(raw)
    section = report[report.index("## equiv.audit on long correct runs: false alarms") :]
    trainer, adamw, ddp, total = _table_after(report, "## equiv.audit on long correct runs: false alarms")
    assert trainer["run"].startswith("`trainer`") and trainer["p99"] == "0.60" and trainer["max"] == "0.85"
    assert trainer["windows (segments x steps)"] == "100 (2 x 50)"
    assert "150 of 200 steps clipped" in adamw["run"] and adamw[">= 0.9"] == "1"
    assert ddp["flagged (target 0)"] == "1"
    assert (
        total["windows (segments x steps)"] == "400" and total["flagged (target 0)"] == "1" and total["max"] == "1.20"
    )
    assert "quick: CI's count; 400 windows" in section
    assert "False alarms: **1** (target 0, NOT met)" in section and "reaches 0.9" in section
    assert "Flagged: seed 1: step 3: NOT equivalent (x0)." in section


def test_a_committed_full_false_alarm_run_is_shown_beside_this_one() -> None:
    raw = _fixture()
    info = {"audit_false_alarms": True, "threads": 1, "torch_version": "2.13.0", "load_average_1min": 2.0}
    full = {
        "datetime": "2026-11-27T15:00:00",
        "benchmarks": [
            {"extra_info": {**info, "quick": False, "runs": {"trainer": _false_alarm_run(2000, p99=0.3, largest=0.5)}}}
        ],
    }
    report = render_report(raw, scaling_full=[("reports/audit_false_alarms_full.json", full)])
    section = report[report.index("## equiv.audit on long correct runs: false alarms") :]
    assert "committed as reports/audit_false_alarms_full.json" in section and "This run" not in section
    assert _table_after(section, "Full run")[0]["windows (segments x steps)"] == "2,000 (2 x 1000)"
    assert "False alarms: **0** (target 0, met); the tail (p99 and max) below 0.9 of the allowance (met)" in section


@pytest.mark.parametrize("ratio, said", [(1.17, "this run is within it"), (1.28, "this run is past it")])
def test_the_witness_cost_is_shown_against_its_target(ratio: float, said: str) -> None:
    from equiv.reporting.benchmarks_audit import _audit_witness_lines

    info = {
        "audit_witness": True,
        "parameters": 700_000,
        "rounds": 15,
        "failing_without_witness_median_s": 0.197,
        "failing_with_witness_median_s": 0.197 * ratio,
        "failing_witness_ratio": ratio,
        "passing_witness_ratio": 0.95,
    }
    text = "\n".join(_audit_witness_lines({"benchmarks": [{"extra_info": info}]}))
    assert said in text and f"{ratio:.2f}x" in text and "0.95x" in text and "15 rounds" in text
    assert _audit_witness_lines({"benchmarks": []}) == []

"""The distributed and loss-scale sections of reports/equivalence.md, rendered.

DDP verdicts on uneven shards and its communication as N grows, FSDP2's
verdicts, cost per rank and their chart, and the loss-scale windows, as
:mod:`equiv.findings.distributed` measured them (W=2 gloo ranks on the CPU,
single-process loss-scale windows: see there).  Nothing here measures.
"""

from __future__ import annotations

import pandas as pd

from equiv.findings.results import DEEPSPEED_SHARDS, FSDP2_POLICY_LABELS, DistributedFindings, Fsdp2Findings
from equiv.reporting.markdown import markdown_table

__all__ = ["deepspeed_section", "distributed_section", "fsdp2_chart", "fsdp2_section"]


def distributed_section(findings: DistributedFindings) -> str:
    """The markdown of the distributed and loss-scale sections, from
    :func:`equiv.findings.distributed.measure_distributed`."""
    return "\n\n".join(
        [
            "## Distributed data parallel (W=2 gloo ranks on the CPU)",
            f"Every rank against the single-process full-batch step; shards {findings.shards} (samples per micro-batch, "
            f"per rank), case `{findings.case}`. All-reduces are DDP gradient buckets counted "
            "by a comm hook (this model fits one bucket).",
            markdown_table(findings.verdicts),
            "Communication per optimizer step as the micro-batches per rank N grow (float64 gradients): "
            "`no_sync` keeps it at one all-reduce per window.",
            markdown_table(findings.communication),
            fsdp2_section(findings.fsdp2),
            *deepspeed_section(findings.deepspeed, findings.deepspeed_communication),
            "## Loss-scale window (dynamic loss scaling, one overflowing sample)",
            f"Case `{findings.loss_scale_case}` with `overflow_at=[1, sample]`: the full-batch step skips step 1 and "
            "backs the scale off once; so must the accumulation, whichever micro-batch overflowed.",
            markdown_table(findings.loss_scale),
        ]
    )


def deepspeed_section(table: pd.DataFrame | None, communication: pd.DataFrame | None = None) -> list[str]:
    """The DeepSpeed section: the DeepSpeed zoo under ZeRO-1 and ZeRO-2 and the engine's collectives as N grows,
    or why it was not measured."""
    intro = (
        '`check_distributed(step, dcase, engine="deepspeed-zero1" | "deepspeed")`: each rank\'s model and the case\'s '
        "optimizer wrapped by `deepspeed.initialize` (`gradient_accumulation_steps` the rank's micro-batch count, "
        "`gradient_clipping` the case's clip norm, DeepSpeed's CPU accelerator), the step calling `engine.backward` "
        "and `engine.step` per micro-batch as DeepSpeed users do; every rank's parameters and ZeRO's flat optimizer "
        "state (gathered, cut back per parameter) compared with the single-process full-batch step in both tiers "
        "(ZeRO's float32 master weights, accumulation and reduction lifted to float64 in the exact tier). Shards "
        f"{DEEPSPEED_SHARDS} (one `gradient_accumulation_steps` for every rank), the DDP section's case: with its "
        "AdamW, and with DeepSpeed's own Muon (the config's `\"Muon\"`, every parameter of the MLP without biases "
        'tagged `use_muon`; `optimizer="DeepSpeedMuon"`), whose truth is the same optimizer on whole weights in '
        "one process: ZeRO orthogonalising a partly reduced gradient (DeepSpeed #7807) would show there."
    )
    if table is None:
        return [
            "## DeepSpeed (ZeRO-1 and ZeRO-2, gloo ranks on the CPU)",
            intro,
            "Not measured: DeepSpeed is not installed (`pip install 'equiv[deepspeed]'`; `tox -e equivalence` installs it).",
        ]
    out = ["## DeepSpeed (ZeRO-1 and ZeRO-2, gloo ranks on the CPU)", intro, markdown_table(table)]
    if communication is not None:
        out += [
            "The engine's own collectives per optimizer step as the micro-batches per rank N grow (the correct "
            "step, 2 ranks, exact tier): every `torch.distributed` call made inside `engine.backward` and "
            "`engine.step` (DeepSpeed's gradient reductions, its step's norm and all-gather), counted by wrapping "
            "the two methods, none of them counted as the step's own.",
            markdown_table(communication),
        ]
    return out


# ---------------------------------------------------------------------- FSDP2
def fsdp2_chart(table: pd.DataFrame) -> list[str]:
    """Mermaid xychart: fwd/bwd peak per rank (bars) and reduce-scatter volume
    per step (lines), both in MiB, against N; sync once first, then every."""
    series = {policy: table[table["policy"] == label] for policy, label in FSDP2_POLICY_LABELS.items()}
    if any(frame.empty for frame in series.values()):
        return []

    def values(frame: pd.DataFrame, column: str) -> list[float]:
        # The largest rank's figure where ranks differ ("a / b").
        return [max(float(v) for v in str(cell).split(" / ")) for cell in frame[column]]

    bars = {p: values(f, "fwd/bwd peak MiB") for p, f in series.items()}
    lines = {p: values(f, "reduce-scatter MiB / step") for p, f in series.items()}
    top = max(max(v) for v in [*bars.values(), *lines.values()])
    labels = ", ".join(f'"N={n}"' for n in series[next(iter(FSDP2_POLICY_LABELS))]["N"])
    return [
        "```mermaid",
        "xychart-beta",
        '    title "FSDP2, 2 ranks: fwd/bwd peak per rank (bars) and reduce-scatter volume per step (lines), MiB"',
        f"    x-axis [{labels}]",
        f'    y-axis "MiB" 0 --> {int(top // 10 * 10 + 10)}',
        *(f"    bar [{', '.join(f'{v:.1f}' for v in bars[p])}]" for p in FSDP2_POLICY_LABELS),
        *(f"    line [{', '.join(f'{v:.1f}' for v in lines[p])}]" for p in FSDP2_POLICY_LABELS),
        "```",
    ]


def fsdp2_section(findings: Fsdp2Findings) -> str:
    """The FSDP2 section, from :func:`equiv.findings.distributed.measure_fsdp2`: verdicts, then
    communication and per-rank peak memory against N for both sync policies, and their chart."""
    return "\n\n".join(
        [
            "## FSDP2 (fully_shard, gloo ranks on the CPU)",
            '`check_distributed(step, dcase, engine="fsdp2")`: `fully_shard` on each layer and on the root, every '
            "rank's parameters and optimizer state gathered (`full_tensor()`) and compared with the single-process "
            f"full-batch step in both tiers. Shards {findings.shards[2]} at W=2 and {findings.shards[3]} at W=3 (FSDP2 "
            "needs the same number of micro-batches on every rank: each forward all-gathers), case "
            f"`{findings.case}` (the clip bug needs clipping on). Reduce-scatters are counted through "
            "`set_custom_reduce_scatter`: one per FSDP unit (each Linear layer here) per gradient sync. The accumulator "
            "makes FSDP sum gradients over ranks (`set_gradient_divide_factor(1.0)`, SUM reductions) and divides once "
            "by the global item count: no average to multiply back, so W=3 is exact too.",
            markdown_table(findings.verdicts),
            f"Cost per optimizer step as the micro-batches per rank N grow: {findings.workload_description}, global "
            f"batch {findings.workload_global_batch_size} over 2 ranks, AdamW, float32, `equiv.Accumulator` with "
            "gradient sync once per window (`micro_batch(last=...)`) or on every micro-batch; all of it measured in "
            "one run of the two ranks, per rank (one figure where the ranks agree). Reduce-scatter MiB are the padded "
            "unsharded gradients put in; all-gather MiB the unsharded parameters gathered (each forward and each backward). "
            "Peak memory is counted from live tensor storages (local shards of DTensors, FSDP's in-place frees "
            "included), so it is the same on every run; step times vary and are left out here "
            "(`equiv.findings.distributed.measure_fsdp2(with_times=True)`).",
            markdown_table(findings.costs),
            "Bars: forward/backward peak per rank, sync once per window then sync every micro-batch; lines: "
            "reduce-scatter MiB per step, same order. Syncing once holds every unit's gradient unsharded through "
            "the window; syncing every micro-batch keeps it sharded and sends N times the bytes.",
            "\n".join(fsdp2_chart(findings.costs)),
        ]
    )

"""What the distributed and loss-scale sections of reports/equivalence.md show, measured.

Runs W=2 gloo ranks on the CPU: the reference accumulator and the distributed
bug zoo on uneven shards under DDP and under FSDP2 (``fully_shard``), the
gradient collectives and bytes per optimizer step as the number of
micro-batches per rank N grows, FSDP2's per-rank memory for its two sync
policies, and single-process loss-scale windows where one micro-batch
overflows.  :mod:`equiv.reporting.distributed` renders it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import pandas as pd

from equiv.accumulator import accumulator_step
from equiv.cases.case import Case
from equiv.checking.check import check
from equiv.checking.distributed import DistributedCase, DistributedVerdict, check_distributed
from equiv.cost.fsdp import POLICIES, FsdpCostRow, FsdpCostSweep
from equiv.cost.workloads import WORKLOADS
from equiv.distributed.launcher import run_on_ranks
from equiv.findings.results import DEEPSPEED_SHARDS, FSDP2_POLICY_LABELS, DistributedFindings, Fsdp2Findings
from equiv.outcomes import Outcome, outcome_words
from equiv.results.facts import Divergence, magnitude, ratio_band
from equiv.zoo.distributed_bugs import DISTRIBUTED_BUGS, FSDP2_BUGS, LOSS_SCALE_BUGS, Fsdp2Entry, upstream_report

__all__ = [
    "deepspeed_communication_table",
    "deepspeed_verdict_table",
    "fsdp2_cost_table",
    "fsdp2_verdict_table",
    "measure_distributed",
    "measure_fsdp2",
]

log = logging.getLogger(__name__)

_BASE = Case(
    batch_size=1,
    micro_batch_sizes=(1,),
    model_kwargs={"hidden": (16, 16)},
    optimizer="AdamW",
    optimizer_kwargs={"lr": 1e-3, "weight_decay": 0.1},
    steps=2,
)
#: Uneven shards: rank 0 holds 6 samples in 3 micro-batches, rank 1 holds 3 in 3.
_UNEVEN = [[1, 2, 3], [1, 1, 1]]
#: FSDP2: the same micro-batch count on every rank (each forward all-gathers),
#: uneven shard sizes; clipping on, so a wrong clip shows.
_FSDP2_BASE = _BASE.replace(max_grad_norm=0.05)
_FSDP2_UNEVEN = {2: [[1, 2, 3], [2, 1, 1]], 3: [[1, 2, 3], [2, 1, 1], [1, 1, 1]]}
_MIB = 2**20


def measure_distributed() -> DistributedFindings:
    """DDP verdicts on uneven shards, all-reduces as N grows, the loss-scale
    windows, then FSDP2 (:func:`measure_fsdp2`), in the order the report shows them."""
    verdicts = _uneven_shard_verdicts()
    communication = _allreduce_sweep()
    scaled = _BASE.replace(batch_size=6, micro_batch_sizes=[1, 2, 3], steps=3, loss_scale=2.0**10)
    loss_scale = _loss_scale_windows(scaled)
    return DistributedFindings(
        shards=_UNEVEN,
        case=repr(DistributedCase.of(_BASE, _UNEVEN)),
        verdicts=verdicts,
        communication=communication,
        fsdp2=measure_fsdp2(),
        loss_scale_case=repr(scaled),
        loss_scale=loss_scale,
        deepspeed=deepspeed_verdict_table(),
        deepspeed_communication=deepspeed_communication_table(),
    )


def _uneven_shard_verdicts() -> pd.DataFrame:
    """The reference accumulator and each distributed bug on the uneven shards, under DDP."""
    candidates: dict[str, Callable[..., Any]] = {"accumulator_step": accumulator_step, **DISTRIBUTED_BUGS}
    rows = []
    for name, candidate in candidates.items():
        verdict = check_distributed(candidate, DistributedCase.of(_BASE, _UNEVEN))
        log.info("distributed: %s", name)
        first = next((v.first_mismatch for v in verdict.ranks if v.first_mismatch), None)
        rows.append(
            {
                "candidate": name,
                "verdict": outcome_words(verdict.status),
                "worst exact / allowed": (
                    ratio_band(max(v.worst["exact"].ratio for v in verdict.ranks))
                    if all("exact" in v.worst for v in verdict.ranks)
                    else "-"  # not judged (not applicable: the row's verdict says why)
                ),
                "all-reduces per step": ", ".join(map(str, sorted(verdict.allreduces_per_step()))),
                "first divergence": "-" if first is None else Divergence.of(first).describe(),
                "reproduces": _reproduces(verdict.outcome, upstream_report(candidate)),
            }
        )
    return pd.DataFrame(rows)


def _allreduce_sweep() -> pd.DataFrame:
    """All-reduces and bytes per step as the micro-batches per rank grow, with and without no_sync."""
    sweep = []
    for per_rank in (1, 2, 4, 8):
        shards = [[1] * per_rank, [1] * per_rank]
        for name, candidate in (
            ("accumulator_step", accumulator_step),
            ("no_sync_missing", DISTRIBUTED_BUGS["no_sync_missing"]),
        ):
            verdict = check_distributed(candidate, DistributedCase.of(_BASE.replace(steps=1), shards), tiers=("exact",))
            log.info("all-reduce sweep: N=%d %s", per_rank, name)
            sweep.append(
                {
                    "N per rank": per_rank,
                    "candidate": name,
                    "equivalent": "yes" if verdict else "no",
                    "all-reduces per step": max(verdict.allreduces_per_step()),
                    "bytes per step per rank": verdict.bytes_per_step(),
                }
            )
    return pd.DataFrame(sweep).sort_values(["candidate", "N per rank"], kind="stable")


def _loss_scale_windows(scaled: Case) -> pd.DataFrame:
    """The reference and each loss-scale bug with an overflow in the first, second or last micro-batch."""
    loss_rows = []
    for sample, where in ((0, "first micro-batch"), (2, "second micro-batch"), (5, "last micro-batch")):
        for name, candidate in (("accumulator_step", accumulator_step), *LOSS_SCALE_BUGS.items()):
            single = check(candidate, scaled.replace(overflow_at=[1, sample]))
            loss_rows.append(
                {
                    "overflow in": f"{where} (sample {sample}) of step 1",
                    "candidate": name,
                    "verdict": outcome_words(single.status),
                    "worst exact / allowed": ratio_band(single.worst["exact"].ratio),
                }
            )
    return pd.DataFrame(loss_rows)


# ---------------------------------------------------------------------- FSDP2
def _fsdp2_row(
    label: str,
    world_size: int,
    entry: Fsdp2Entry,
    verdict: DistributedVerdict,
    *,
    collectives_column: str = "reduce-scatters per step",
) -> dict[str, str]:
    finding = "-"
    if verdict.outcome is Outcome.PRECISION:
        parts = []
        for tier in ("exact", "noise"):
            diff = verdict.measured_error(tier)
            if diff is not None and not diff.ok:
                parts.append(f"{tier}: {diff.label} off by {magnitude(diff.relative_error)} of its scale")
        finding = "measured error " + "; ".join(parts)
    else:
        first = next((v.first_mismatch for v in verdict.ranks if v.first_mismatch), None)
        if first is not None:
            finding = Divergence.of(first).describe()
    row = {
        "candidate": label,
        "W": str(world_size),
        "what": entry.what or "the reference",
        "expected": outcome_words(entry.expected),
        "verdict": outcome_words(verdict.outcome),
        "worst exact / allowed": (
            ratio_band(max(v.worst["exact"].ratio for v in verdict.ranks))
            if all("exact" in v.worst for v in verdict.ranks)
            else "-"  # not judged (not applicable: the row's verdict says why)
        ),
        # FSDP2's reduce-scatters, or DeepSpeed's engine.backward and engine.step collectives (the engine's record)
        collectives_column: ", ".join(map(str, sorted(verdict.collectives_per_step()))),
        "finding": finding,
        "reproduces": _reproduces(verdict.outcome, entry.upstream or upstream_report(entry.candidate)),
    }
    return row


#: DeepSpeed: DEEPSPEED_SHARDS (equiv.findings.results), no clipping (the engine's own, from the config: the zoo's
#: steps take no max_grad_norm).
_ZERO_STAGES = {"deepspeed-zero1": "ZeRO-1", "deepspeed": "ZeRO-2"}
#: The optimizers the DeepSpeed zoo runs with: the DDP section's AdamW, and DeepSpeed's own Muon (its config's
#: "Muon", judged against the same optimizer on whole weights in one process: DeepSpeed #7807) on the same MLP
#: without biases (every parameter a matrix); as changes to _BASE, a case naming DeepSpeed's Muon being made only
#: where DeepSpeed is installed.
_DEEPSPEED_OPTIMIZERS: dict[str, dict[str, Any]] = {
    "AdamW": {},
    "DeepSpeed's Muon": {
        "optimizer": "DeepSpeedMuon",
        "optimizer_kwargs": {"lr": 0.02},
        "model_kwargs": {**_BASE.model_kwargs, "bias": False},
    },
}
#: The column of the collectives counted inside DeepSpeed's engine.backward and engine.step.
DEEPSPEED_COLLECTIVES = "engine collectives per step"


def deepspeed_verdict_table() -> pd.DataFrame | None:
    """The DeepSpeed zoo (``equiv.zoo.deepspeed_bugs``) under ZeRO-1 and ZeRO-2 at W=2, each checked with
    ``check_distributed(..., engine=...)`` on uneven shards; None where DeepSpeed is not installed."""
    import importlib.util

    if importlib.util.find_spec("deepspeed") is None:
        return None
    from equiv.zoo.deepspeed_bugs import DEEPSPEED_ZOO

    rows = []
    for optimizer, changes in _DEEPSPEED_OPTIMIZERS.items():
        case = _BASE.replace(**changes)
        for engine, stage in _ZERO_STAGES.items():
            for name, entry in DEEPSPEED_ZOO.items():
                verdict = check_distributed(entry.candidate, DistributedCase.of(case, DEEPSPEED_SHARDS), engine=engine)
                log.info("deepspeed: %s %s %s %s", name, engine, optimizer, verdict.outcome)
                row = _fsdp2_row(name, 2, entry, verdict, collectives_column=DEEPSPEED_COLLECTIVES)
                rows.append({"engine": stage, "optimizer": optimizer, **row})
    return pd.DataFrame(rows)


def deepspeed_communication_table() -> pd.DataFrame | None:
    """DeepSpeed's own collectives (those of ``engine.backward`` and ``engine.step``) and their bytes per step per
    rank, for ZeRO-1 and ZeRO-2 as the micro-batches per rank N grow (the correct step, W=2, the exact tier); None
    where DeepSpeed is not installed."""
    import importlib.util

    if importlib.util.find_spec("deepspeed") is None:
        return None
    from equiv.zoo.deepspeed_bugs import deepspeed_global_item_count

    rows = []
    for engine, stage in _ZERO_STAGES.items():
        for per_rank in (1, 2, 4):
            shards = [[1] * per_rank, [1] * per_rank]
            dcase = DistributedCase.of(_BASE.replace(steps=1), shards)
            verdict = check_distributed(deepspeed_global_item_count, dcase, tiers=("exact",), engine=engine)
            log.info("deepspeed communication: %s N=%d", stage, per_rank)
            rows.append(
                {
                    "engine": stage,
                    "N per rank": per_rank,
                    "equivalent": "yes" if verdict else "no",
                    DEEPSPEED_COLLECTIVES: max(verdict.collectives_per_step()),
                    "bytes per step per rank (float64)": verdict.bytes_per_step(),
                }
            )
    return pd.DataFrame(rows)


def _reproduces(outcome: Outcome, upstream: str) -> str:
    """The upstream report a failing row reproduces (each NOT names one, or says there is none)."""
    if outcome is Outcome.EQUIVALENT:
        return "-"
    return upstream or "equiv's zoo, no upstream report"


def fsdp2_verdict_table(world_sizes: Sequence[int] = (2, 3)) -> pd.DataFrame:
    """The reference at each world size and the FSDP2 zoo at W=2, each checked
    with ``check_distributed(..., engine="fsdp2")`` on uneven shards."""
    runs: list[tuple[str, int, Fsdp2Entry]] = [
        ("accumulator_step", w, Fsdp2Entry(accumulator_step, expected=Outcome.EQUIVALENT)) for w in world_sizes
    ]
    runs += [(name, 2, entry) for name, entry in FSDP2_BUGS.items()]
    rows = []
    for label, world_size, entry in runs:
        dcase = DistributedCase.of(_FSDP2_BASE, _FSDP2_UNEVEN[world_size])
        verdict = check_distributed(entry.candidate, dcase, engine="fsdp2", mp_policy=entry.mp_policy)
        log.info("fsdp2: %s W=%d %s", label, world_size, verdict.outcome)
        rows.append(_fsdp2_row(label, world_size, entry, verdict))
    return pd.DataFrame(rows)


def _per_rank(values: Sequence[Any], fmt: Callable[[Any], str] = str) -> str:
    """One figure when every rank agrees, else each rank's, in rank order."""
    texts = [fmt(v) for v in values]
    return texts[0] if len(set(texts)) == 1 else " / ".join(texts)


def fsdp2_cost_table(per_rank: Sequence[Sequence[FsdpCostRow]], *, with_times: bool = False) -> pd.DataFrame:
    """One row per (policy, N): communication and peak memory per rank (and
    the median step time per rank, if asked: it is not reproducible)."""
    by_key: dict[tuple[str, int], list[FsdpCostRow]] = {}
    for rows in per_rank:
        for row in rows:
            by_key.setdefault((row.policy, row.micro_batches), []).append(row)
    out = []
    for (policy, n), rows in sorted(by_key.items(), key=lambda kv: (POLICIES.index(kv[0][0]), kv[0][1])):
        rows.sort(key=lambda r: r.rank)
        record = {
            "policy": FSDP2_POLICY_LABELS[policy],
            "N": str(n),
            "reduce-scatters / step": _per_rank([r.reduce_scatters for r in rows]),
            "reduce-scatter MiB / step": _per_rank([r.reduce_scatter_bytes / _MIB for r in rows], "{:.2f}".format),
            "all-gathers / step": _per_rank([r.all_gathers for r in rows]),
            "all-gather MiB / step": _per_rank([r.all_gather_bytes / _MIB for r in rows], "{:.2f}".format),
            "fwd/bwd peak MiB": _per_rank([r.memory.forward_backward_peak_bytes / _MIB for r in rows], "{:.2f}".format),
            "optimizer-step peak MiB": _per_rank(
                [r.memory.optimizer_step_peak_bytes / _MIB for r in rows], "{:.2f}".format
            ),
        }
        if with_times:
            record["step ms"] = _per_rank([r.step_seconds * 1e3 for r in rows], "{:.0f}".format)
        out.append(record)
    return pd.DataFrame(out)


def measure_fsdp2(
    *, world_sizes: Sequence[int] = (2, 3), sweep: FsdpCostSweep | None = None, with_times: bool = False
) -> Fsdp2Findings:
    """FSDP2's verdicts (reference at each of ``world_sizes``, the zoo at W=2)
    and, measured in one run of two ranks, communication and per-rank peak
    memory against N for both sync policies.  Step times are measured too but
    left out of the table unless ``with_times`` (they differ run to run, and
    reports/equivalence.md must not)."""
    sweep = sweep or FsdpCostSweep()
    verdicts = fsdp2_verdict_table(world_sizes)
    per_rank = run_on_ranks(sweep, 2, device=sweep.device, timeout_s=600, describe=f"FSDP2 cost sweep {sweep!r}")
    log.info("fsdp2: cost sweep done")
    costs = fsdp2_cost_table(per_rank, with_times=with_times)
    workload = WORKLOADS[sweep.workload]
    return Fsdp2Findings(
        verdicts=verdicts,
        costs=costs,
        shards=_FSDP2_UNEVEN,
        case=repr(_FSDP2_BASE),
        workload_description=workload.description,
        workload_global_batch_size=workload.global_batch_size,
    )

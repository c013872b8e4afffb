"""equiv under FSDP2 (fully_shard): gloo ranks on the CPU.

Each check spawns its ranks, so this file holds few, meaningful cases.  The
candidates and per-rank tasks live at module level: spawned ranks import them.
"""

import math
import multiprocessing
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

import equiv
from equiv.checking.distributed import (
    DistributedCase,
    DistributedCheckError,
    DistributedVerdict,
    check_distributed,
    fully_shard_layers,
    run_on_ranks,
)
from equiv.cost.fsdp import POLICIES, FsdpCostRow, FsdpCostSweep
from equiv.cost.memory import StepMemory
from equiv.cost.workloads import WORKLOADS, build_workload_model
from equiv.findings.distributed import fsdp2_cost_table
from equiv.findings.results import FSDP2_POLICY_LABELS
from equiv.reporting.distributed import fsdp2_chart
from equiv.zoo.distributed_bugs import FSDP2_BUGS, sum_over_ranks_divided_by_global_tokens

# Spawned process groups are slow to start: tox -e slow runs them, tox -e tests leaves them out.
pytestmark = pytest.mark.distributed

MLP = {"hidden": (8,), "activation": "tanh"}  # two Linear layers: two FSDP units
BASE = equiv.Case(
    batch_size=1,
    micro_batch_sizes=(1,),
    model_kwargs=MLP,
    optimizer="Adam",
    optimizer_kwargs={"lr": 1e-2},
    steps=2,
    max_grad_norm=0.05,
)
UNITS = 2


def no_stray_processes() -> bool:
    return not multiprocessing.active_children()


def padded_parameter_bytes(case: equiv.Case, world_size: int) -> int:
    """What one reduce-scatter of every unit puts in, in float64: FSDP2 pads
    each parameter's first dimension to a multiple of the world size."""
    numel = 0
    for p in case.build_model().module.parameters():
        rows = math.ceil(p.shape[0] / world_size) * world_size
        numel += rows * (p.numel() // p.shape[0])
    return numel * 8


@pytest.mark.parametrize("shards", [[[1, 3], [2, 1]], [[1, 3], [2, 1], [1, 1]]], ids=["W=2", "W=3"])
def test_accumulator_is_exact_under_fsdp2_with_uneven_shards_and_one_reduce_scatter_per_window(
    shards: list[list[int]],
) -> None:
    # Ranks hold 4, 3 (and 2) samples; clipping is active; W=3 has no exact
    # division by the world size anywhere (the accumulator sums over ranks).
    dcase = DistributedCase.of(BASE.replace(steps=3), shards)
    verdict = check_distributed(equiv.accumulator_step, dcase, engine="fsdp2")
    verdict.assert_ok()
    assert verdict.outcome == "equivalent" and len(verdict.ranks) == len(shards)
    assert verdict.fsdp_units == UNITS
    assert verdict.reduce_scatters_per_step("exact") == {UNITS}  # one per unit per window...
    assert verdict.reduce_scatters_per_step("noise") == {UNITS}
    assert verdict.bytes_per_step("exact") == padded_parameter_bytes(dcase.case, len(shards))  # ...of every gradient
    assert f"{len(shards)} ranks under FSDP2 (fully_shard)" in verdict.message()
    assert "engine='fsdp2'" in verdict.message()
    assert no_stray_processes()


@pytest.mark.parametrize("name", list(FSDP2_BUGS))
def test_each_fsdp2_zoo_entry_is_found(name: str) -> None:
    entry = FSDP2_BUGS[name]
    dcase = DistributedCase.of(BASE, [[1, 2, 3], [2, 1, 1]])  # uneven: 6 and 4 samples, 3 micro-batches each
    verdict = check_distributed(entry.candidate, dcase, engine="fsdp2", mp_policy=entry.mp_policy)
    assert verdict.outcome == entry.expected, verdict.message()
    if entry.expected == "equivalent":  # sync on every micro-batch: right, at N times the reduce-scatters
        verdict.assert_ok()
        assert verdict.reduce_scatters_per_step() == {3 * UNITS}
        assert verdict.bytes_per_step() == 3 * padded_parameter_bytes(dcase.case, 2)
        return
    assert not verdict
    with pytest.raises(equiv.EquivalenceError, match=r"rank \d of 2: Not equivalent to full-batch training"):
        verdict.assert_ok()
    if name == "sync_disabled_on_last_micro_batch":
        assert verdict.reduce_scatters_per_step() == {0}
    if entry.expected == "precision":
        # Beyond the noise tier, and told apart from a mathematical mismatch by
        # the same step matching without the 16-bit policy.
        assert {d.tier for v in verdict.ranks for d in v.mismatches} == {"exact", "noise"}
        noise = verdict.measured_error("noise")
        assert noise is not None and noise.quantity == "update" and not noise.ok
        # bfloat16-sized (unit roundoff 2**-8), not float32's (2**-24)
        assert noise.max_rel_diff > 1e-4 and noise.max_abs_diff > 1e3 * noise.allowed
        assert "the policy's bfloat16 gradient reduction" in verdict.message()
        assert "Measured error, noise tier (float32)" in verdict.message()
        # The Reproduce line runs as printed: its imports, then a policy torch reaches by name.
        line = next(text for text in verdict.message().splitlines() if text.startswith("Reproduce: "))
        assert line.startswith("Reproduce: import torch, equiv; equiv.check_distributed(")
        assert "mp_policy=torch.distributed.fsdp.MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)" in line
    else:
        first = verdict.ranks[0].first_mismatch
        assert first is not None and first.step == 1 and first.tier == "exact"


def test_fsdp2_cost_sweep_counts_communication_and_memory_per_policy() -> None:
    sweep = FsdpCostSweep(micro_batches=(1, 2), timed_steps=1)
    per_rank = run_on_ranks(sweep, 2, describe="test sweep")
    assert [len(rows) for rows in per_rank] == [4, 4]
    rows = {(r.rank, r.policy, r.micro_batches): r for rank_rows in per_rank for r in rank_rows}
    gradient_bytes = 4 * sum(  # the mlp workload's float32 gradients, padded to 2 ranks
        math.ceil(p.shape[0] / 2) * 2 * (p.numel() // p.shape[0])
        for p in build_workload_model(WORKLOADS["mlp"]).parameters()
    )
    units = 3  # two blocks and the head
    for rank in (0, 1):
        for n in (1, 2):
            once, every = rows[rank, "sync_once_per_window", n], rows[rank, "sync_every_micro_batch", n]
            assert (once.reduce_scatters, once.reduce_scatter_bytes) == (units, gradient_bytes)
            assert (every.reduce_scatters, every.reduce_scatter_bytes) == (n * units, n * gradient_bytes)
            # Both all-gather every unit in each forward and each backward.
            assert once.all_gathers == every.all_gathers == 2 * n * units
            assert once.memory.optimizer_step_peak_bytes == every.memory.optimizer_step_peak_bytes
            assert once.step_seconds > 0
        # One micro-batch: the same step either way, byte for byte.
        assert rows[rank, "sync_once_per_window", 1].memory == rows[rank, "sync_every_micro_batch", 1].memory
        # Two: syncing once holds the gradients unsharded through the window.
        assert (
            rows[rank, "sync_once_per_window", 2].memory.forward_backward_peak_bytes
            > rows[rank, "sync_every_micro_batch", 2].memory.forward_backward_peak_bytes
        )
    # Equal shards: the storage counter gives both ranks the same figures.
    assert all(rows[0, p, n].memory == rows[1, p, n].memory for _, p, n in rows)
    assert no_stray_processes()


# ------------------------------------------------------- the accumulator, in a rank
def accumulator_contract_on_rank(rank: int, world_size: int, progress: object) -> dict[str, object]:
    """Runs on each rank: what the Accumulator does with an FSDP2 module."""
    mesh = init_device_mesh("cpu", (world_size,))
    out: dict[str, object] = {}
    misuse = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 1))  # float32
    fully_shard_layers(misuse, mesh)
    for name, kwargs in {
        "grad_scaler": {"grad_scaler": torch.amp.GradScaler("cpu")},
        "accumulate_dtype": {"accumulate_dtype": torch.float64},
    }.items():
        try:
            equiv.Accumulator(misuse, torch.optim.SGD(misuse.parameters()), **kwargs)  # type: ignore[arg-type]
        except ValueError as exc:
            out[name] = str(exc)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 1)).double()
    out["reference"] = [p.detach().clone() for p in model.parameters()]
    fully_shard_layers(model, mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    # Two micro-batches on each rank (every forward all-gathers); rank 0 holds
    # 2 samples, rank 1 holds 3: the global count is 5.
    sizes = [[1, 1], [1, 2]][rank]
    generator = torch.Generator().manual_seed(rank)
    x = torch.randn(sum(sizes), 4, dtype=torch.float64, generator=generator)
    y = torch.randn(sum(sizes), 1, dtype=torch.float64, generator=generator)
    acc = equiv.Accumulator(model, optimizer, max_grad_norm=1e-3)
    for index, (xb, yb) in enumerate(zip(x.split(sizes), y.split(sizes), strict=True)):
        with acc.micro_batch(last=index == len(sizes) - 1):
            acc.backward(((model(xb) - yb) ** 2).sum(), items=len(yb))
        if index == 0:  # gradient sync was off: no sharded gradient yet
            out["grad_after_first"] = [p.grad for p in model.parameters()]
    # The sharded gradients are summed (not averaged) over ranks; only step() divides.
    out["grad"] = [p.grad.full_tensor() for p in model.parameters()]  # type: ignore[union-attr]
    result = acc.step()
    out["grad_norm"], out["items"], out["x"], out["y"] = result.grad_norm, int(result.items), x, y
    # A window whose last backward ran without sync leaves no gradient to step on.
    model.set_requires_gradient_sync(False)  # type: ignore[operator]
    acc.backward(((model(x) - y) ** 2).sum(), items=len(y))
    try:
        acc.step()
    except RuntimeError as exc:
        out["no_sync"] = str(exc)
    return out


def test_accumulator_under_fsdp2_sums_over_ranks_clips_with_the_global_norm_and_refuses_misuse() -> None:
    per_rank = run_on_ranks(accumulator_contract_on_rank, 2, describe="accumulator contract")
    first = per_rank[0]
    assert "grad_scaler is not supported under FSDP2" in str(first["grad_scaler"])
    assert "accumulate_dtype wider than the parameters is not supported under FSDP2" in str(first["accumulate_dtype"])
    assert "no parameter holds a gradient" in str(first["no_sync"])
    assert first["grad_after_first"] == [None] * 4
    # The full-batch gradient, by hand: the sum over every rank's samples.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 1)).double()
    x = torch.cat([r["x"] for r in per_rank])
    y = torch.cat([r["y"] for r in per_rank])
    ((model(x) - y) ** 2).sum().backward()
    expected = [p.grad for p in model.parameters() if p.grad is not None]
    for results in per_rank:
        assert results["items"] == 5
        for got, want in zip(results["grad"], expected, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
        # Clipped with the norm of the whole (normalised) gradient, not of a shard.
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g / 5) for g in expected]))
        assert not isinstance(results["grad_norm"], DTensor)
        torch.testing.assert_close(results["grad_norm"], norm, rtol=1e-12, atol=0)
    assert no_stray_processes()


# ------------------------------------------------------- correct real-world steps
def test_a_step_that_sums_over_ranks_and_divides_by_the_global_token_count_passes_on_gloo() -> None:
    # Gloo has no PREMUL_SUM, which FSDP2 picks for a float32 reduce-scatter
    # with a divide factor other than the world size; the check makes FSDP2
    # reduce with a plain sum there (the same sum), so this correct step passes
    # in both tiers instead of raising in the float32 one.
    tokens = BASE.replace(model="token_mlp", model_kwargs={}, loss="token_cross_entropy")
    verdict = check_distributed(
        sum_over_ranks_divided_by_global_tokens, DistributedCase.of(tokens, [[1, 2], [3, 1]]), engine="fsdp2"
    )
    verdict.assert_ok()
    assert set(verdict.comm) == {"exact", "noise"}  # both tiers ran
    assert verdict.reduce_scatters_per_step("noise") == {2 * verdict.fsdp_units}  # sync on both micro-batches
    assert no_stray_processes()


# ------------------------------------------------------------------ faults
def raises_on_rank_1(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: list,
    loss_fn: object,
    *,
    max_grad_norm: float | None = None,
) -> None:
    if dist.get_rank() == 1:
        raise ValueError("rank 1 cannot go on")
    equiv.accumulator_step(model, optimizer, micro_batches, loss_fn, max_grad_norm=max_grad_norm)  # type: ignore[arg-type]


def hangs_on_rank_1(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: list,
    loss_fn: object,
    *,
    max_grad_norm: float | None = None,
) -> None:
    if dist.get_rank() == 1:
        time.sleep(3600)
    equiv.accumulator_step(model, optimizer, micro_batches, loss_fn, max_grad_norm=max_grad_norm)  # type: ignore[arg-type]


FAULT_CASE = DistributedCase.of(BASE, [[1, 1], [2, 1]])


def test_a_rank_that_raises_under_fsdp2_is_named_with_the_case() -> None:
    # Rank 0 waits in an all-gather for rank 1, which has raised: the check
    # ends after the grace period, naming rank 1 first.
    with pytest.raises(DistributedCheckError) as info:
        check_distributed(raises_on_rank_1, FAULT_CASE, engine="fsdp2", timeout_s=60)
    text = str(info.value)
    assert text.startswith("rank 1 raised (exact tier, step 0: in the candidate)")
    assert "rank 1 cannot go on" in text
    assert "DistributedCase.of(Case(batch_size=5" in text and "engine='fsdp2'" in text
    assert no_stray_processes()


def test_a_rank_that_hangs_under_fsdp2_ends_the_check_within_the_timeout() -> None:
    started = time.monotonic()
    with pytest.raises(DistributedCheckError, match=r"did not finish within 8 s: .*rank 1 hung \(exact tier, step 0"):
        check_distributed(hangs_on_rank_1, FAULT_CASE, engine="fsdp2", timeout_s=8)
    assert time.monotonic() - started < 60  # the slack is start-up and clean-up
    assert no_stray_processes()


def skips_the_last_backward_on_rank_1(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: list,
    loss_fn: object,
    *,
    max_grad_norm: float | None = None,
) -> None:
    optimizer.zero_grad(set_to_none=True)
    for index, (inputs, targets) in enumerate(micro_batches):
        loss = loss_fn(model(inputs), targets)  # type: ignore[operator]
        if dist.get_rank() == 1 and index == len(micro_batches) - 1:
            continue  # and with it FSDP2's reduce-scatters (and the backward's all-gathers)
        loss.backward()
    optimizer.step()


def test_a_rank_that_skips_a_backward_under_fsdp2_is_named_at_once() -> None:
    started = time.monotonic()
    with pytest.raises(
        DistributedCheckError,
        match=(
            r"^mismatched collectives: rank 0 called all_gather_single of shape \[\d+\] float64 as its collective #\d+ "
            r"\(exact tier, step 0: in the candidate\); rank 1 made no collective #\d+: it went on to exact tier, step 1"
        ),
    ):
        check_distributed(skips_the_last_backward_on_rank_1, FAULT_CASE, engine="fsdp2")
    assert time.monotonic() - started < 30  # the timeout is 120 s
    assert no_stray_processes()


# ------------------------------------------------------------ bad input (no ranks)
def test_bad_fsdp2_input_is_refused_before_anything_runs() -> None:
    with pytest.raises(
        ValueError,
        match=r"engine must be one of \('ddp', 'fsdp2', 'tp', 'fsdp2\+tp', 'cp', 'fsdp2\+cp', 'deepspeed', 'deepspeed-zero1'\), got 'fsdp'",
    ):
        check_distributed(equiv.accumulator_step, FAULT_CASE, engine="fsdp")
    with pytest.raises(ValueError, match="mp_policy is an FSDP2 setting: it needs engine='fsdp2', got engine='ddp'"):
        check_distributed(equiv.accumulator_step, FAULT_CASE, mp_policy=MixedPrecisionPolicy())
    with pytest.raises(
        TypeError, match=r"mp_policy must be a torch\.distributed\.fsdp\.MixedPrecisionPolicy or None, got dtype"
    ):
        check_distributed(equiv.accumulator_step, FAULT_CASE, engine="fsdp2", mp_policy=torch.bfloat16)  # type: ignore[arg-type]
    with pytest.raises(equiv.InvalidCase, match=r"same number of micro-batches .* got \[2, 1\] micro-batches per rank"):
        check_distributed(equiv.accumulator_step, DistributedCase.of(BASE, [[1, 3], [2]]), engine="fsdp2")
    ddp_verdict = DistributedVerdict(case=FAULT_CASE, candidate="x", ranks=())
    with pytest.raises(ValueError, match="counts FSDP2's reduce-scatters; this check ran engine='ddp'"):
        ddp_verdict.reduce_scatters_per_step()
    fsdp_verdict = DistributedVerdict(case=FAULT_CASE, candidate="x", ranks=(), engine="fsdp2")
    with pytest.raises(ValueError, match="counts DDP's gradient all-reduces; this check ran engine='fsdp2'"):
        fsdp_verdict.allreduces_per_step()
    with pytest.raises(ValueError, match="unknown workload 'resnet'"):
        FsdpCostSweep(workload="resnet")
    with pytest.raises(ValueError, match=r"policies must be a non-empty subset of .* got \('sync_never',\)"):
        FsdpCostSweep(policies=("sync_never",))


# ------------------------------------------------------------ report rendering
def test_fsdp2_cost_table_gives_one_figure_where_ranks_agree_and_charts_both_policies() -> None:
    def row(rank: int, policy: str, n: int, peak: int) -> FsdpCostRow:
        memory = StepMemory(
            device="cpu",
            method="storage-counter",
            baseline_bytes=1,
            forward_backward_peak_bytes=peak,
            optimizer_step_peak_bytes=3 * 2**20,
        )
        every = policy == "sync_every_micro_batch"
        return FsdpCostRow(
            policy=policy,
            micro_batches=n,
            rank=rank,
            world_size=2,
            reduce_scatters=3 * (n if every else 1),
            reduce_scatter_bytes=2**20 * (n if every else 1),
            all_gathers=6 * n,
            all_gather_bytes=2**21 * n,
            memory=memory,
            step_seconds=0.1 + rank,
        )

    per_rank = [
        [
            row(rank, policy, n, (30 + n + (rank if policy == "sync_every_micro_batch" and n == 2 else 0)) * 2**20)
            for policy in ("sync_once_per_window", "sync_every_micro_batch")
            for n in (1, 2)
        ]
        for rank in (0, 1)
    ]
    table = fsdp2_cost_table(per_rank)
    assert list(table["policy"]) == ["sync once per window"] * 2 + ["sync every micro-batch"] * 2
    assert list(table["reduce-scatters / step"]) == ["3", "3", "3", "6"]
    assert list(table["fwd/bwd peak MiB"]) == ["31.00", "32.00", "31.00", "32.00 / 33.00"]  # ranks differ: both
    assert "step ms" not in table.columns  # not reproducible: only when asked
    assert list(fsdp2_cost_table(per_rank, with_times=True)["step ms"]) == ["100 / 1100"] * 4
    chart = "\n".join(fsdp2_chart(table))
    assert chart.count("    bar [") == 2 and chart.count("    line [") == 2
    assert 'x-axis ["N=1", "N=2"]' in chart and "bar [31.0, 33.0]" in chart and "line [1.0, 2.0]" in chart
    # The renderer knows the policies by their labels, in the sweep's order.
    assert tuple(FSDP2_POLICY_LABELS) == POLICIES

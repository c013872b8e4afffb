"""equiv.cost: the three step implementations agree; plan() recommends an N that fits on a real model.

The planning algorithm on synthetic memory and time curves: tests/test_plan_search.py."""

from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from equiv.batches import even_sizes, split_batch
from equiv.cli import UsageError, build_parser, main, parse_bytes
from equiv.cost.planner import NothingFitsError, plan
from equiv.cost.steps import make_train_step
from equiv.cost.workloads import WORKLOADS, BlockNet, build_workload_model

MIB = 2**20


def _tiny_model() -> BlockNet:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(32, 64), nn.Tanh()), nn.Sequential(nn.Linear(64, 64), nn.Tanh())]
    return BlockNet(nn.Identity(), blocks, nn.Linear(64, 5))


def _tiny_batch(size: int = 24) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(size, 32, generator=generator), torch.randint(0, 5, (size,), generator=generator)


def _ce_sum(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output, target, reduction="sum")


def test_split_batch_is_as_even_as_possible() -> None:
    pieces = split_batch(_tiny_batch(64), even_sizes(64, 3))
    assert [len(x) for x, _ in pieces] == [22, 21, 21]
    assert torch.equal(torch.cat([y for _, y in pieces]), _tiny_batch(64)[1])


@pytest.mark.parametrize("n", [0, 25], ids=["zero", "more-than-samples"])
def test_even_sizes_refuses_impossible_n(n: int) -> None:
    with pytest.raises(ValueError, match=rf"n_micro_batches must be in 1..24 \(the batch size\), got {n}"):
        even_sizes(24, n)


def test_split_batch_refuses_sizes_that_do_not_add_up() -> None:
    with pytest.raises(ValueError, match=r"micro-batch sizes \[5, 5\] must be positive and add up to the batch's 24"):
        split_batch(_tiny_batch(), [5, 5])


def test_split_batch_copies_only_when_asked() -> None:
    batch = _tiny_batch()
    views, copies = split_batch(batch, [4, 20]), split_batch(batch, [4, 20], copy=True)
    assert views[0][0].untyped_storage().data_ptr() == batch[0].untyped_storage().data_ptr()
    assert copies[0][0].untyped_storage().data_ptr() != batch[0].untyped_storage().data_ptr()


def test_benchmarked_implementations_take_the_same_step() -> None:
    """The benchmark compares like with like: all three do the full-batch update."""
    batch = _tiny_batch()
    updated = {}
    for implementation, n in [("native", 1), ("native", 5), ("accumulator", 5), ("checkpoint", 1)]:
        model = _tiny_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        make_train_step(
            implementation,
            model,
            optimizer,
            split_batch(batch, even_sizes(len(batch[0]), n)),
            _ce_sum,
            lambda t: t.shape[0],
        )()
        updated[(implementation, n)] = torch.cat([p.detach().flatten() for p in model.parameters()])
        assert all(p.grad is None for p in model.parameters()), "a step must leave no gradient behind"
    reference = updated[("native", 1)]
    for key, params in updated.items():
        torch.testing.assert_close(params, reference, msg=lambda m, key=key: f"{key}: {m}")


def test_checkpoint_needs_a_block_net() -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="needs a BlockNet to checkpoint, got Linear"):
        make_train_step("checkpoint", model, torch.optim.SGD(model.parameters(), lr=0.1), [], _ce_sum, len)


def test_workloads_build_and_run_forward() -> None:
    for name, workload in WORKLOADS.items():
        model = build_workload_model(workload)
        inputs, targets = workload.make_batch(2, torch.Generator().manual_seed(0))
        loss = workload.loss_sum(model(inputs), targets)
        assert loss.dim() == 0 and torch.isfinite(loss), name


def test_plan_recommends_a_measured_n_within_budget() -> None:
    budget = 3 * MIB
    result = plan(_tiny_model(), _tiny_batch(), global_batch_size=48, memory_budget_bytes=budget, repeats=1)
    row = result.recommended
    assert row is not None and row.measured_samples_per_s is not None
    assert row.measured_peak_bytes is not None and row.measured_peak_bytes <= budget
    # The smallest micro-batches are probed first: nothing larger ran before them.
    assert result.probed_micro_batch_sizes[:2] == [1, 2]
    # The recommendation is the fastest measured whole step among those that fit.
    assert row.measured_samples_per_s == max(
        r.measured_samples_per_s for r in result.rows if r.fits and r.measured_samples_per_s is not None
    )
    # Memory is deterministic on CPU: a probe and the whole step agree where both ran (N >= 2).
    for r in result.rows:
        if r.probed_peak_bytes is not None and r.measured_peak_bytes is not None and r.n_micro_batches >= 2:
            assert r.probed_peak_bytes == r.measured_peak_bytes


def test_plan_says_when_nothing_fits() -> None:
    with pytest.raises(
        NothingFitsError, match=r"no N fits: even micro-batch 1 \(N=48\) peaks at \d+ bytes > budget 1000"
    ):
        plan(_tiny_model(), _tiny_batch(), global_batch_size=48, memory_budget_bytes=1000, repeats=1)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"global_batch_size": 0}, "global_batch_size must be >= 1, got 0"),
        ({"memory_budget_bytes": -5}, "memory_budget_bytes must be > 0, got -5"),
        ({"candidates": [1, 99]}, r"candidates must be in 1..48 \(the global batch size\), got \[99\]"),
        ({"candidates": [48]}, "give fewer than 2 micro-batch sizes"),
        ({"device": "meta"}, "device must be 'cpu' or 'cuda"),
        pytest.param(
            {"device": "cuda"},
            "torch.cuda.is_available\\(\\) is False",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present"),
        ),
    ],
    ids=["zero-batch", "negative-budget", "n-beyond-batch", "one-size", "meta-device", "cuda-missing"],
)
def test_plan_refuses_bad_input_naming_the_value(overrides: dict[str, object], message: str) -> None:
    arguments: dict[str, object] = {"global_batch_size": 48, "memory_budget_bytes": 8 * MIB, **overrides}
    with pytest.raises(ValueError, match=message):
        plan(_tiny_model(), _tiny_batch(), **arguments)  # type: ignore[arg-type]


def test_plan_leaves_the_callers_weights_alone() -> None:
    model = _tiny_model()
    before = [p.detach().clone() for p in model.parameters()]
    plan(model, _tiny_batch(), global_batch_size=24, memory_budget_bytes=64 * MIB, repeats=1)
    for old, new in zip(before, model.parameters(), strict=True):
        assert torch.equal(old, new)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("1000", 1000), ("2KiB", 2048), ("1.5 MiB", 3 * 2**19), ("2GB", 2 * 10**9), ("8gib", 8 * 2**30)],
)
def test_parse_bytes(text: str, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "MiB", "12 parsecs", "-1MiB"])
def test_parse_bytes_refuses_nonsense(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=f"got {text!r}"):
        parse_bytes(text)


def _cli(argv: list[str]) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def test_cli_plans_a_user_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "user_model.py").write_text(
        textwrap.dedent(
            """
            import torch
            from torch import nn

            def build():
                torch.manual_seed(0)
                model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
                return model, (torch.randn(16, 8), torch.randint(0, 3, (16,)))
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    args = _cli(["plan", "user_model:build", "--budget", "8MiB", "--repeats", "1", "--candidates", "1,2,4,8,16"])
    assert args.handler(args) == 0
    out = capsys.readouterr().out
    assert "<- recommended" in out and "memory model: peak = max(" in out
    sys.modules.pop("user_model", None)


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("nosuchworkload", r"target must be a built-in workload \['convnet', 'mlp', 'transformer'\] or MODULE:FUNC"),
        ("math:nope", "module 'math' has no attribute 'nope'"),
        ("math:pi", "'math:pi' is a float, not a callable"),
        ("math:sqrt", r"math:sqrt\(\) raised TypeError: .*argument"),
    ],
    ids=["unknown-name", "missing-function", "not-callable", "bad-call"],
)
def test_cli_names_a_bad_target(target: str, message: str) -> None:
    args = _cli(["plan", target, "--budget", "1MiB"])
    with pytest.raises(UsageError, match=message):
        args.handler(args)


def test_cli_exit_code_when_nothing_fits(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "mlp", "--budget", "1MiB", "--repeats", "1"]) == 1
    assert "no N fits: even micro-batch 1 (N=256)" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "flag", "shown"),
    [
        # Issue 36: --global-batch-size 0 planned for the workload's 64 and exited 0.
        (["--global-batch-size", "0"], "--global-batch-size", "0"),
        (["--global-batch-size", "-4"], "--global-batch-size", "-4"),
        (["--repeats", "0"], "--repeats", "0"),
        (["--threads", "0"], "--threads", "0"),  # was exit 4: torch.set_num_threads raised
        (["--candidates", "4,0"], "--candidates", "0"),
    ],
    ids=["zero-batch", "negative-batch", "zero-repeats", "zero-threads", "zero-candidate"],
)
def test_cli_refuses_a_count_below_one_naming_the_flag(
    capsys: pytest.CaptureFixture[str], argv: list[str], flag: str, shown: str
) -> None:
    with pytest.raises(SystemExit) as refused:
        main(["plan", "mlp", "--budget", "1GiB", *argv])
    assert refused.value.code == 2  # argparse's usage error: the CLI's EXIT_USAGE
    assert f"argument {flag}: expected a whole number >= 1, got {shown}" in capsys.readouterr().err

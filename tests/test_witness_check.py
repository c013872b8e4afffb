"""The witness in ``equiv.check`` (issue 44): a failing verdict says which weight its step gave each micro-batch.

Each buggy step records the weight it applied to each micro-batch's loss SUM from its own divisor (its weight of
the micro-batch's mean over the micro-batch's items), never typed in; the verdict's recovered weights must equal
them within 1 % and name the normaliser, and the failure kind must say the same name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jsonschema
import pytest
import torch

import equiv
import equiv.checking.check as check_module
from equiv.cases.distributed import DistributedCase
from equiv.cases.standard import STANDARD_CASES
from equiv.checking.distributed import check_distributed
from equiv.checking.pipeline import PipelineSetting, check_pipeline
from equiv.checking.pipeline import _batches as _pipeline_batches
from equiv.results.protocol import SCHEMA, schema
from equiv.results.witness import Witness
from equiv.zoo import bugs
from equiv.zoo.correct import scales_by_inverse_item_count
from equiv.zoo.distributed_bugs import global_item_count, local_token_mean_per_rank
from equiv.zoo.kinds import KINDS, NORMALISERS

UNEVEN = equiv.Case(batch_size=10, micro_batch_sizes=(2, 3, 5), steps=2)
TOKENS = equiv.Case(
    batch_size=8,
    micro_batch_sizes=(1, 3, 4),
    steps=2,
    model="token_mlp",
    loss="token_cross_entropy",
    optimizer="Adam",
    optimizer_kwargs={"lr": 1e-2},
)


def _dividing(divisor: Callable[[int], float], applied: list[list[float]]) -> Callable[..., None]:
    """A step that weights each micro-batch's mean by 1/divisor(k), recording the weight of its loss sum."""

    def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, micro_batches: Any, loss_fn: Any) -> None:
        optimizer.zero_grad(set_to_none=True)
        window = []
        for inputs, targets in micro_batches:
            weight = 1.0 / divisor(len(micro_batches))
            (loss_fn(model(inputs), targets) * weight).backward()
            window.append(weight / float(loss_fn.count(targets)))  # a mean is its sum / n_i
        applied.append(window)
        optimizer.step()

    return step


@pytest.mark.parametrize(
    ("divisor", "normaliser"),
    [
        (lambda k: k, "mean of means"),
        (lambda k: 1.0, "sum without division"),
        (lambda k: 4.0, "tail divided by N"),  # N = 4 configured, windows of k = 3 micro-batches
    ],
    ids=["mean of means", "sum of means", "tail divided by N"],
)
@pytest.mark.parametrize("case", [UNEVEN, TOKENS], ids=["samples", "tokens"])
def test_failing_check_recovers_the_applied_weights(
    divisor: Callable[[int], float], normaliser: str, case: equiv.Case
) -> None:
    applied: list[list[float]] = []
    verdict = equiv.check(_dividing(divisor, applied), case)
    assert not verdict
    witness = verdict.witness
    assert isinstance(witness, Witness)
    assert witness.run is not None
    first = min(d.step for d in verdict.mismatches if d.tier == "exact")
    truth = applied[first - 1]  # that step of the first run: a step's weights are its divisors, in every run
    assert witness.run == pytest.approx(truth, rel=0.01)
    assert witness.normaliser == normaliser
    assert verdict.failure_kind is not None and verdict.failure_kind.name == normaliser  # one classifier
    assert verdict.to_dict()["weights"] == witness.to_dict()
    assert witness.clause() in verdict.line()
    assert f"What the loop did: {witness.clause()}" in verdict.message()


def test_correct_step_carries_no_witness_and_runs_nothing_more(monkeypatch: pytest.MonkeyPatch) -> None:
    def never(*args: object, **kwargs: object) -> object:
        raise AssertionError("the witness ran on a passing check")

    monkeypatch.setattr(check_module, "step_witness", never)
    verdict = equiv.check(scales_by_inverse_item_count, UNEVEN)
    assert verdict
    assert verdict.witness is None
    assert "weights" not in verdict.to_dict()
    assert "weights" not in verdict.line() and "What the loop did" not in verdict.message()


@pytest.mark.parametrize(
    ("bug", "case_name"),
    [
        (bug, case_name)
        for bug in (bugs.mean_of_means, bugs.unscaled_sum)
        for case_name in ("SGD, active clipping 3+5", "AdamW, head at its own lr, clipped 1+4", "Adam, uneven 1+2")
    ]
    + [(bugs.divides_twice, "Adam, uneven 1+2"), (bugs.clip_per_micro_batch, "SGD, active clipping 3+5")],
    ids=lambda value: getattr(value, "__name__", value),
)
def test_zoo_failure_kind_and_witness_agree(bug: Callable[..., None], case_name: str) -> None:
    """Where the witness names one of equiv check's kinds, the failure kind is that kind, first: never two
    answers (under clipping a sum of means and a mean of means fit one window's weights: the same order)."""
    verdict = equiv.check(bug, STANDARD_CASES[case_name])
    assert not verdict and verdict.witness is not None and verdict.failure_kind is not None
    named = [name for name in verdict.witness.normaliser.split(" or ") if name in {k.name for k in KINDS}]
    if named:
        assert verdict.failure_kind.name == named[0]
        assert verdict.witness.means.startswith(next(n.means for n in NORMALISERS if n.name == named[0]))
    else:  # a kind the weights cannot show (clipping per micro-batch, a uniform scale): never one of KINDS
        assert verdict.failure_kind.name not in {k.name for k in KINDS}


def test_witness_in_json_schema_and_github_annotation() -> None:
    """The weights travel in the versioned JSON (equiv.result/2 validates them) and in --format github."""
    from equiv.results.annotations import escape_data, github_annotations

    verdicts = equiv.checking.check.check_cases(bugs.mean_of_means, {"uneven": UNEVEN})
    verdict = verdicts.failed["uneven"]
    assert verdict.witness is not None
    written = verdicts.to_dict()
    assert written["schema"] == SCHEMA == "equiv.result/2"
    jsonschema.validate(written, schema())
    assert written["cases"][0]["weights"]["normaliser"] == "mean of means"
    (line,) = github_annotations(verdicts, None, command="equiv check")
    assert "(mean of means)" in line and escape_data(verdict.witness.clause()) in line


TOKEN_CASE = equiv.Case(
    batch_size=7,
    micro_batch_sizes=(7,),
    steps=2,
    model="token_mlp",
    loss="token_cross_entropy",
    optimizer="SGD",
    optimizer_kwargs={"lr": 0.1},
)


def _per_rank_mean_weights(dcase: DistributedCase, step: int) -> list[float]:
    """Each micro-batch's loss-sum weight under a per-rank token mean averaged by DDP, counted from the case's own
    batch: 1 / (ranks x the rank's tokens)."""
    case = dcase.case
    loss_fn = case.build_loss()
    _, targets = case.batches(case.build_model())[step]
    weights = []
    for rank in range(dcase.world_size):
        shard = targets[dcase.rank_slice(rank)]
        rank_items = float(loss_fn.count(shard))
        weights += [1.0 / (dcase.world_size * rank_items)] * len(dcase.rank_micro_batches(rank))
    return weights


@pytest.mark.distributed
@pytest.mark.parametrize("sizes", [((1, 2), (4,)), ((1,), (2, 1), (3,))], ids=["2 ranks", "3 ranks"])
def test_check_distributed_names_a_per_rank_token_mean(sizes: tuple[tuple[int, ...], ...]) -> None:
    dcase = DistributedCase.of(TOKEN_CASE, sizes)
    verdict = check_distributed(local_token_mean_per_rank, dcase)
    assert not verdict
    first = min(d.step for v in verdict.ranks for d in v.mismatches if d.tier == "exact")
    applied = _per_rank_mean_weights(dcase, first - 1)
    for rank in verdict.ranks:
        assert rank.witness is not None and rank.witness.run is not None
        assert rank.witness.run == pytest.approx(applied, rel=0.01)
        assert rank.witness.normaliser == "per-rank mean"
        assert rank.failure_kind is not None and rank.failure_kind.name == "per-rank mean"  # one name
        assert rank.to_dict()["weights"]["normaliser"] == "per-rank mean"
    assert verdict.ranks[0].witness is not None and verdict.ranks[0].witness.clause() in verdict.line()
    assert "Kind of failure: per-rank mean" in verdict.message()
    jsonschema.validate(verdict.to_dict(), schema())


@pytest.mark.distributed
def test_check_distributed_correct_step_carries_no_witness() -> None:
    verdict = check_distributed(global_item_count, DistributedCase.of(TOKEN_CASE, ((1, 2), (4,))))
    assert verdict
    assert all(rank.witness is None and "weights" not in rank.to_dict() for rank in verdict.ranks)


def _chunk_weights(setting: PipelineSetting, divisor: Callable[[float, int], float]) -> list[float]:
    """Each chunk's loss-sum weight when its mean over its real items is divided by divisor(items, chunks): counted
    from the setting's own first batch (NaN targets are padding)."""
    _, targets = _pipeline_batches(setting)[0][0]
    chunks = targets.tensor_split(setting.n_microbatches)
    return [1.0 / (float((~c.isnan()).sum()) * divisor(float((~c.isnan()).sum()), len(chunks))) for c in chunks]


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("scale_grads", "normaliser", "divisor"),
    [(True, "mean of means", lambda items, k: k), (False, "sum without division", lambda items, k: 1.0)],
    ids=["scaled: mean of means", "unscaled: sum of means"],
)
def test_pipeline_check_names_its_chunk_weights(
    scale_grads: bool, normaliser: str, divisor: Callable[[float, int], float]
) -> None:
    setting = PipelineSetting(schedule="GPipe", scale_grads=scale_grads, loss="mean")
    verdict = check_pipeline(setting)
    assert not verdict and verdict.witness is not None and verdict.witness.run is not None
    assert verdict.witness.run == pytest.approx(_chunk_weights(setting, divisor), rel=0.01)
    assert verdict.witness.normaliser == normaliser
    assert verdict.failure_kind is not None and verdict.failure_kind.name == normaliser
    assert verdict.to_dict()["weights"]["normaliser"] == normaliser
    jsonschema.validate(verdict.to_dict(), schema())
    assert verdict.witness.clause() in verdict.line() and f"Kind of failure: {normaliser}" in verdict.message()


@pytest.mark.distributed
def test_pipeline_check_correct_setting_carries_no_witness() -> None:
    verdict = check_pipeline(PipelineSetting(schedule="GPipe", scale_grads=False, loss="window_sum"))
    assert verdict and verdict.witness is None and verdict.failure_kind is None
    assert "weights" not in verdict.to_dict() and "failure_kind" not in verdict.to_dict()


@pytest.mark.distributed
def test_check_distributed_kind_in_github_annotation() -> None:
    """check-distributed names the kind as equiv check does: in the annotation's title, the same FailureKind."""
    from equiv.results.annotations import github_annotations
    from equiv.results.verdict import CaseVerdicts

    verdict = check_distributed(local_token_mean_per_rank, DistributedCase.of(TOKEN_CASE, ((1, 2), (4,))))
    assert verdict.failure_kind is not None and verdict.failure_kind == verdict.ranks[0].failure_kind
    results = CaseVerdicts(verdict.candidate, {"2 ranks": verdict}, {}, ("2 ranks",))
    (line,) = github_annotations(results, None, command="equiv check-distributed")
    assert "title=equiv check-distributed%3A not equivalent (per-rank mean)%3A 2 ranks::" in line

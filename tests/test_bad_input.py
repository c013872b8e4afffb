"""Bad input gets a clear error that names the bad value."""

import math
import re

import pytest
import torch
from torch import nn

import equiv
from equiv.judging.runs import NonFiniteLossError

MLP = {"hidden": (8,)}


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"batch_size": 8, "micro_batch_sizes": (3, 4)}, "add up to 7, but batch_size is 8"),
        ({"batch_size": 8, "micro_batch_sizes": (4, 0, 4)}, "micro-batch 1 has size 0"),
        ({"batch_size": 8, "micro_batch_sizes": ()}, "at least one micro-batch"),
        ({"batch_size": 0, "micro_batch_sizes": (1,)}, "batch_size must be a positive int, got 0"),
        ({"batch_size": 2, "micro_batch_sizes": (2,), "steps": 0}, "steps must be a positive int, got 0"),
        ({"batch_size": 2, "micro_batch_sizes": (2,), "optimizer": "Adamm"}, "unknown optimizer 'Adamm'"),
        ({"batch_size": 2, "micro_batch_sizes": (2,), "loss": "hinge"}, "unknown loss 'hinge'"),
        ({"batch_size": 2, "micro_batch_sizes": (2,), "model": "resnet"}, "unknown model 'resnet'"),
        ({"batch_size": 2, "micro_batch_sizes": (2,), "dtype": "float8"}, "unknown dtype 'float8'"),
        ({"batch_size": 2, "micro_batch_sizes": (2,), "max_grad_norm": -1.0}, "max_grad_norm must be positive"),
        ({"batch_size": 2, "micro_batch_sizes": (2,), "scheduler": "Nope"}, "unknown scheduler 'Nope'"),
        # Issue 36: LBFGS got past the case and failed inside the full-batch reference (exit 4).
        (
            {"batch_size": 2, "micro_batch_sizes": (2,), "optimizer": "LBFGS"},
            "optimizer 'LBFGS' is not supported: its step(closure) re-evaluates the loss",
        ),
        ({"batch_size": 2, "micro_batch_sizes": (2,), "optimizer": "lbfgs"}, "optimizer 'LBFGS' is not supported"),
        (
            {"batch_size": 2, "micro_batch_sizes": (2,), "optimizer": torch.optim.SparseAdam},
            "optimizer 'SparseAdam' is not supported: it takes sparse gradients only",
        ),
    ],
    ids=[
        "sizes_do_not_add_up",
        "empty_micro_batch",
        "no_micro_batch",
        "zero_batch",
        "zero_steps",
        "unknown_optimizer",
        "unknown_loss",
        "unknown_model",
        "unknown_dtype",
        "negative_clip",
        "unknown_scheduler",
        "lbfgs",
        "lbfgs_lowercase",
        "sparse_adam",
    ],
)
def test_invalid_case_names_the_value(fields: dict[str, object], message: str) -> None:
    with pytest.raises(equiv.InvalidCase, match=re.escape(message)):
        equiv.Case(**fields)  # type: ignore[arg-type]


def test_an_unsupported_optimizer_lists_the_supported_ones() -> None:
    with pytest.raises(equiv.InvalidCase) as refused:
        equiv.Case(batch_size=2, micro_batch_sizes=(2,), optimizer="LBFGS")
    supported = str(refused.value).rpartition("; supported: ")[2].split(", ")
    assert {"SGD", "Adam", "AdamW", *equiv.strategies.OPTIMIZERS} <= set(supported)
    assert "LBFGS" not in supported and "SparseAdam" not in supported


def test_non_finite_reference_loss_is_an_error_naming_the_case() -> None:
    # lr 1e300 sends the weights to ~1e299 in one step: the second loss overflows.
    case = equiv.Case(batch_size=4, micro_batch_sizes=(2, 2), model_kwargs=MLP, optimizer_kwargs={"lr": 1e300})
    with pytest.raises(NonFiniteLossError, match=r"reference loss is (inf|nan) at step 1") as info:
        equiv.check(equiv.accumulator_step, case)
    assert "lr" in str(info.value) and "1e+300" in str(info.value)


def test_candidate_that_raises_names_the_case() -> None:
    def broken(model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: list, loss_fn: object) -> None:
        raise KeyError("no such batch")

    case = equiv.Case(batch_size=4, micro_batch_sizes=(1, 3), model_kwargs=MLP)
    with pytest.raises(equiv.CandidateError) as info:
        equiv.check(broken, case)
    text = str(info.value)
    assert "broken raised KeyError" in text and "'no such batch'" in text
    assert "at step 0 in float32" in text  # the working dtype's run comes first (the cheaper)
    assert "Case(batch_size=4, micro_batch_sizes=(1, 3)" in text
    assert info.value.case == case
    assert isinstance(info.value.__cause__, KeyError)


def test_case_with_scheduler_is_not_applicable_to_a_candidate_without_one() -> None:
    def no_scheduler(model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: list, loss_fn: object) -> None:
        raise AssertionError("a case that does not apply must not run the candidate")

    case = equiv.Case(batch_size=2, micro_batch_sizes=(2,), scheduler="StepLR", scheduler_kwargs={"step_size": 1})
    verdict = equiv.check(no_scheduler, case)
    assert verdict.status == "not_applicable" and not verdict
    assert verdict.not_applicable == (
        "test_case_with_scheduler_is_not_applicable_to_a_candidate_without_one.<locals>.no_scheduler takes no "
        "scheduler (the case sets scheduler='StepLR')",
    )
    assert verdict.message().startswith("Not applicable (candidate ")
    with pytest.raises(equiv.EquivalenceError, match="Not applicable"):
        verdict.assert_ok()


def test_clipping_case_is_not_applicable_to_a_step_that_takes_no_max_grad_norm() -> None:
    def no_clip(model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: list, loss_fn: object) -> None:
        equiv.accumulator_step(model, optimizer, micro_batches, loss_fn)  # type: ignore[arg-type]

    case = equiv.Case(batch_size=8, micro_batch_sizes=(3, 5), model_kwargs=MLP, max_grad_norm=0.05)
    verdict = equiv.check(no_clip, case)
    assert verdict.status == "not_applicable"
    assert "takes no max_grad_norm (the case sets max_grad_norm=0.05)" in verdict.not_applicable[0]
    # Without the clipping the same step is checked, and equivalent.
    equiv.check(no_clip, case.replace(max_grad_norm=None)).assert_ok()


@pytest.mark.parametrize(
    "candidate",
    [lambda model, optimizer: None, lambda model, optimizer, micro_batches, loss_fn, extra: None, 42],
    ids=["too-few-parameters", "extra-required-parameter", "not-callable"],
)
def test_a_candidate_that_cannot_take_the_contract_is_a_contract_error(candidate: object) -> None:
    case = equiv.Case(batch_size=2, micro_batch_sizes=(2,))
    with pytest.raises(equiv.ContractError, match=r"step\(model, optimizer, micro_batches, loss_fn\)"):
        equiv.check(candidate, case)  # type: ignore[arg-type]


def test_check_rejects_non_case_and_bad_tiers() -> None:
    with pytest.raises(TypeError, match=r"case must be an equiv\.Case, got dict"):
        equiv.check(equiv.accumulator_step, {"batch_size": 2})  # type: ignore[arg-type]
    case = equiv.Case(batch_size=2, micro_batch_sizes=(2,))
    with pytest.raises(ValueError, match=r"tiers must be a non-empty subset of \('exact', 'noise'\), got \('fast',\)"):
        equiv.check(equiv.accumulator_step, case, tiers=("fast",))  # type: ignore[arg-type]


def test_case_round_trips_through_dict_and_repr() -> None:
    case = equiv.Case(
        batch_size=5,
        micro_batch_sizes=(2, 3),
        optimizer="Adam",
        optimizer_kwargs={"lr": 1e-3},
        loss="cross_entropy",
        max_grad_norm=1.0,
        seed=7,
    )
    assert equiv.Case.from_dict(case.to_dict()) == case
    assert eval(repr(case), {"Case": equiv.Case}) == case
    assert case.to_dict()["micro_batch_sizes"] == [2, 3]
    assert not math.isnan(case.to_dict()["max_grad_norm"])

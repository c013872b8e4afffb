"""The Accelerate guide's toy case: x = 1..8, y = 2x, w = 0, MSE, SGD lr 0.02.

Full batch and accumulation must give exactly 2.04 (the same float32 value,
compared with ==), however the 8 samples are split.
"""

import pytest
import torch
from torch import nn

import equiv
from equiv.cases.standard import TOY_CASE

X = torch.arange(1.0, 9.0).view(-1, 1)
Y = 2 * X
EXPECTED_W = torch.tensor(2.04, dtype=torch.float32).item()  # float32 nearest to 2.04


def fresh(device: str) -> tuple[nn.Linear, torch.optim.SGD]:
    model = nn.Linear(1, 1, bias=False).to(device)
    nn.init.zeros_(model.weight)
    return model, torch.optim.SGD(model.parameters(), lr=0.02)


def full_batch_w(device: str) -> float:
    model, optimizer = fresh(device)
    nn.MSELoss()(model(X.to(device)), Y.to(device)).backward()
    optimizer.step()
    return model.weight.item()


def accumulated_w(sizes: list[int], device: str) -> float:
    model, optimizer = fresh(device)
    accumulator = equiv.Accumulator(model, optimizer)
    for x, y in zip(X.to(device).split(sizes), Y.to(device).split(sizes), strict=True):
        accumulator.backward(nn.MSELoss(reduction="sum")(model(x), y), items=len(x))
    accumulator.step()
    return model.weight.item()


def test_full_batch_gives_2_04(device: str) -> None:
    assert full_batch_w(device) == EXPECTED_W


@pytest.mark.parametrize(
    "sizes",
    [[2, 2, 2, 2], [8], [1] * 8, [1, 7], [7, 1], [3, 5], [1, 3, 4], [2, 1, 5], [4, 4]],
    ids=lambda s: "+".join(map(str, s)),
)
def test_accumulator_gives_exactly_2_04_for_any_split(sizes: list[int], device: str) -> None:
    assert accumulated_w(sizes, device) == full_batch_w(device) == EXPECTED_W


def test_textbook_loss_over_n_misses_2_04_on_uneven_split() -> None:
    # The contrast: mean of means with sizes 1+7 weights x=1 as much as x=2..8.
    model, optimizer = fresh("cpu")
    sizes = [1, 7]
    for x, y in zip(X.split(sizes), Y.split(sizes), strict=True):
        (nn.MSELoss()(model(x), y) / len(sizes)).backward()
    optimizer.step()
    assert model.weight.item() != EXPECTED_W


def test_toy_case_checks_equivalent_in_both_tiers() -> None:
    verdict = equiv.check(equiv.accumulator_step, TOY_CASE)
    assert verdict, verdict.message()
    # Integer arithmetic all the way: the exact tier shows no difference at all.
    assert verdict.worst["exact"].max_abs_diff == 0.0

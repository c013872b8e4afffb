"""Claims about the reference accumulator, searched by Hypothesis."""

import torch
from hypothesis import given, note, target
from hypothesis import strategies as st
from torch import nn

import equiv


@st.composite
def splits(draw: st.DrawFn, batch_size: int) -> tuple[int, ...]:
    """An ordered composition of ``batch_size``: cut points drawn anywhere."""
    cuts = draw(st.sets(st.integers(1, batch_size - 1), max_size=batch_size - 1)) if batch_size > 1 else set()
    bounds = [0, *sorted(cuts), batch_size]
    return tuple(b - a for a, b in zip(bounds, bounds[1:], strict=False))


OPTIMIZERS = st.sampled_from([
    ("SGD", {"lr": 0.1}),
    ("SGD", {"lr": 0.1, "momentum": 0.9, "nesterov": True}),
    ("Adam", {"lr": 1e-2}),
    ("Adam", {"lr": 1e-2, "eps": 1e-2}),
    ("AdamW", {"lr": 1e-3, "weight_decay": 0.1, "amsgrad": True}),
    ("RMSprop", {"lr": 1e-2, "centered": True}),
    ("Adagrad", {"lr": 0.1}),
])


@st.composite
def cases(draw: st.DrawFn) -> equiv.Case:
    batch_size = draw(st.integers(1, 16))
    optimizer, optimizer_kwargs = draw(OPTIMIZERS)
    loss = draw(st.sampled_from(["mse", "cross_entropy", "token_cross_entropy"]))
    model, model_kwargs = ("token_mlp", {}) if loss == "token_cross_entropy" else (
        "mlp",
        {
            "hidden": tuple(draw(st.lists(st.sampled_from([4, 8, 16]), min_size=1, max_size=3))),
            "activation": draw(st.sampled_from(["tanh", "relu", "gelu"])),
            "norm": draw(st.sampled_from(["none", "layer"])),
        },
    )
    return equiv.Case(
        batch_size=batch_size,
        micro_batch_sizes=draw(splits(batch_size)),
        model=model,
        model_kwargs=model_kwargs,
        optimizer=optimizer,
        optimizer_kwargs=optimizer_kwargs,
        loss=loss,
        steps=draw(st.integers(2, 3)),
        max_grad_norm=draw(st.sampled_from([None, 1e-2, 1e3])),
        seed=draw(st.integers(0, 2**16)),
    )


@given(cases())
def test_reference_matches_full_batch_for_any_split(case: equiv.Case) -> None:
    verdict = equiv.check(equiv.accumulator_step, case)
    for tier, worst in verdict.worst.items():
        target(worst.ratio, label=f"worst {tier} ratio")
    note(verdict.message())
    verdict.assert_ok()


@given(st.data())
def test_reference_update_does_not_depend_on_the_split(data: st.DataObject) -> None:
    case = data.draw(cases())
    other = case.replace(micro_batch_sizes=list(data.draw(splits(case.batch_size))))
    one = equiv.check(equiv.accumulator_step, case)
    two = equiv.check(equiv.accumulator_step, other)
    one.assert_ok()
    two.assert_ok()


X = torch.arange(1.0, 9.0).view(-1, 1)
EXPECTED_W = torch.tensor(2.04).item()


@given(splits(8))
def test_toy_case_gives_2_04_for_any_split_of_its_8_samples(sizes: tuple[int, ...]) -> None:
    model = nn.Linear(1, 1, bias=False)
    nn.init.zeros_(model.weight)
    accumulator = equiv.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.02))
    for x in X.split(list(sizes)):
        accumulator.backward(nn.functional.mse_loss(model(x), 2 * x, reduction="sum"), items=len(x))
    accumulator.step()
    assert model.weight.item() == EXPECTED_W

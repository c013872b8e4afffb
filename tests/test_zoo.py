"""Each bug of the zoo is wrong in exactly the way its name says: exact where
its mistake cannot show, caught where it must."""

import inspect

import pytest

import equiv
from equiv.zoo import bugs
from equiv.zoo.bugs import BUGS, ITEM_WEIGHTED_BUGS

MLP = {"hidden": (8,)}


def case(**changes) -> equiv.Case:
    base = {"batch_size": 6, "micro_batch_sizes": (2, 4), "model_kwargs": MLP, "steps": 2}
    return equiv.Case(**{**base, **changes})


ONE_PIECE = case(micro_batch_sizes=(6,))
TOKENS = {"model": "token_mlp", "model_kwargs": {}, "loss": "token_cross_entropy"}
SCHEDULED = {"scheduler": "StepLR", "scheduler_kwargs": {"step_size": 1, "gamma": 0.5}}

#: bug -> (a case it gets right, a case that exposes it)
CLAIMS = {
    "zero_grad_inside_loop": (ONE_PIECE, case()),
    "step_per_micro_batch": (ONE_PIECE, case()),
    "drops_last_micro_batch": (ONE_PIECE, case()),
    "divides_twice": (ONE_PIECE, case()),
    "scheduler_per_micro_batch": (case(micro_batch_sizes=(6,), **SCHEDULED), case(**SCHEDULED)),
    "sample_weighted_token_loss": (case(), case(**TOKENS)),
    "counts_padding_tokens": (case(loss="cross_entropy"), case(micro_batch_sizes=(6,), **TOKENS)),
    # bfloat16 rounding shows in the float64 tier even in float32 cases; a
    # bfloat16 run cannot tell it from its own noise.
    "low_precision_buffer": (None, case()),
}


@pytest.mark.parametrize("name", sorted(CLAIMS))
def test_bug_is_exact_where_its_mistake_cannot_show_and_caught_where_it_must(name: str) -> None:
    good, bad = CLAIMS[name]
    if good is not None:
        equiv.check(BUGS[name], good).assert_ok()
    verdict = equiv.check(BUGS[name], bad)
    assert verdict.status == "not_equivalent", verdict.message()


def test_item_weighted_bugs_are_exact_for_sample_losses() -> None:
    for name in sorted(ITEM_WEIGHTED_BUGS):
        for loss in ("mse", "cross_entropy"):
            equiv.check(BUGS[name], case(loss=loss)).assert_ok()


def test_every_step_in_the_zoo_module_is_registered_under_its_name() -> None:
    """A bug written but left out of BUGS would never be searched by the quality suite."""
    steps = {
        name: value
        for name, value in vars(bugs).items()
        if inspect.isfunction(value) and value.__module__ == bugs.__name__ and not name.startswith("_")
        and list(inspect.signature(value).parameters)[:4] == ["model", "optimizer", "micro_batches", "loss_fn"]
    }
    assert steps == BUGS
    assert set(ITEM_WEIGHTED_BUGS) <= set(BUGS)

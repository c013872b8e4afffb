"""Each bug of the zoo is wrong in exactly the way its name says: exact where
its mistake cannot show, caught where it must."""

import inspect

import pytest

import equiv
from equiv.zoo import bugs
from equiv.zoo.bugs import BLIND_SPOT_BUGS, BUGS, ITEM_WEIGHTED_BUGS, STATE_ACROSS_CALLS_BUGS

MLP = {"hidden": (8,)}


def case(**changes) -> equiv.Case:
    base = {"batch_size": 6, "micro_batch_sizes": (2, 4), "model_kwargs": MLP, "steps": 2}
    return equiv.Case(**{**base, **changes})


ONE_PIECE = case(micro_batch_sizes=(6,))
TOKENS = {"model": "token_mlp", "model_kwargs": {}, "loss": "token_cross_entropy"}
SCHEDULED = {"scheduler": "StepLR", "scheduler_kwargs": {"step_size": 1, "gamma": 0.5}}
#: 8 micro-batches (the most a fixed buffer of 8 holds) and 9, with an odd tail.
EIGHT = {"batch_size": 17, "micro_batch_sizes": (2,) * 7 + (3,)}
NINE = {"batch_size": 19, "micro_batch_sizes": (2,) * 8 + (3,)}
CLIPPED = {"max_grad_norm": 1e-2}
DECAY = {"optimizer_kwargs": {"lr": 0.1, "weight_decay": 0.1}}

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
    # The blind spots: each exact without its setting, caught with it.
    "eight_slot_buffer": (case(**EIGHT), case(**NINE)),
    "clips_first_group_only": (case(**CLIPPED), case(param_groups="no_decay", **CLIPPED)),
    "zero_grads_for_frozen": (case(**DECAY), case(frozen_layers=1, **DECAY)),
    "decay_per_micro_batch": (case(micro_batch_sizes=(6,), **DECAY), case(**DECAY)),
    "clips_only_trained_groups": (case(param_groups="parked"), case(param_groups="parked", **CLIPPED)),
    # A frozen bottom is right to run without grad; a frozen middle layer cuts the one below off.
    "no_grad_through_frozen": (case(frozen_layers=1), case(frozen_layers=(1,))),
}

#: More cases each blind-spot bug gets right: its mistake needs its setting and nothing else.
ALSO_EXACT = [
    pytest.param("eight_slot_buffer", case(**EIGHT, **TOKENS), id="eight-slots-token-loss"),
    pytest.param("eight_slot_buffer", case(**EIGHT, **CLIPPED, **SCHEDULED), id="eight-slots-clipped-scheduled"),
    pytest.param("clips_first_group_only", case(param_groups="head_lr"), id="groups-without-clipping"),
    pytest.param("clips_first_group_only", case(**TOKENS, **CLIPPED), id="one-group-token-loss"),
    pytest.param(
        "zero_grads_for_frozen",
        case(**EIGHT, **TOKENS, optimizer="Adam", optimizer_kwargs={"lr": 1e-2}),
        id="nothing-frozen-adam-token-loss",
    ),
    # SGD momentum without decay: a zero gradient leaves a zero momentum buffer
    # and the weights where they were, so here frozen zeros are harmless.
    pytest.param(
        "zero_grads_for_frozen",
        case(frozen_layers=1, optimizer_kwargs={"lr": 0.1, "momentum": 0.9}),
        id="frozen-sgd-momentum-no-decay",
    ),
    pytest.param(
        "decay_per_micro_batch",
        case(optimizer="AdamW", optimizer_kwargs={"lr": 1e-2, "weight_decay": 0.1}),
        id="decoupled-decay-left-to-the-optimizer",
    ),
    pytest.param("decay_per_micro_batch", case(**EIGHT, **SCHEDULED), id="no-decay-many-pieces"),
    pytest.param(
        "clips_only_trained_groups", case(param_groups="no_decay", **CLIPPED), id="every-group-trains-clipped"
    ),
    pytest.param("no_grad_through_frozen", case(frozen_layers=-1, **CLIPPED), id="frozen-base-trainable-head"),
    pytest.param(
        "decay_per_micro_batch",
        case(
            micro_batch_sizes=(6,),
            optimizer="Adam",
            param_groups="no_decay",
            optimizer_kwargs={"lr": 1e-2, "weight_decay": 0.1},
        ),
        id="one-piece-adam-two-groups",
    ),
]


@pytest.mark.parametrize("name", sorted(CLAIMS))
def test_bug_is_exact_where_its_mistake_cannot_show_and_caught_where_it_must(name: str) -> None:
    good, bad = CLAIMS[name]
    if good is not None:
        equiv.check(BUGS[name], good).assert_ok()
    verdict = equiv.check(BUGS[name], bad)
    assert verdict.status == "not_equivalent", verdict.message()


@pytest.mark.parametrize(("name", "good"), ALSO_EXACT)
def test_blind_spot_bug_is_exact_without_its_setting(name: str, good: equiv.Case) -> None:
    equiv.check(BUGS[name], good).assert_ok()


@pytest.mark.parametrize(
    ("name", "bad"),
    [
        pytest.param(
            "eight_slot_buffer",
            case(batch_size=32, micro_batch_sizes=(1,) * 32, optimizer="Adam", optimizer_kwargs={"lr": 1e-2}),
            id="eight-slots-32-pieces-adam",
        ),
        pytest.param(
            "clips_first_group_only",
            case(param_groups="head_lr", optimizer="AdamW", optimizer_kwargs={"lr": 1e-2}, **CLIPPED),
            id="head-lr-adamw",
        ),
        # Adam without decay: the all-zero gradient still starts state (step, moments) for frozen weights.
        pytest.param(
            "zero_grads_for_frozen",
            case(frozen_layers=1, optimizer="Adam", optimizer_kwargs={"lr": 1e-2}),
            id="frozen-adam-state",
        ),
        pytest.param(
            "decay_per_micro_batch",
            case(optimizer="Adam", optimizer_kwargs={"lr": 1e-2, "weight_decay": 0.01}),
            id="adam-coupled-decay",
        ),
    ],
)
def test_blind_spot_bug_is_caught_in_other_settings_with_its_feature(name: str, bad: equiv.Case) -> None:
    verdict = equiv.check(BUGS[name], bad)
    assert verdict.status == "not_equivalent", verdict.message()


def test_every_blind_spot_bug_is_registered_with_a_claim() -> None:
    assert BLIND_SPOT_BUGS <= set(CLAIMS)
    assert BLIND_SPOT_BUGS <= set(BUGS)
    assert not BLIND_SPOT_BUGS & ITEM_WEIGHTED_BUGS


def test_item_weighted_bugs_are_exact_for_sample_losses() -> None:
    for name in sorted(ITEM_WEIGHTED_BUGS):
        for loss in ("mse", "cross_entropy"):
            equiv.check(BUGS[name], case(loss=loss)).assert_ok()


def test_every_step_in_the_zoo_module_is_registered_under_its_name() -> None:
    """A bug written but left out of BUGS would never be searched by the quality suite."""
    steps = {
        name: value
        for name, value in vars(bugs).items()
        if inspect.isfunction(value)
        and value.__module__ == bugs.__name__
        and not name.startswith("_")
        and list(inspect.signature(value).parameters)[:4] == ["model", "optimizer", "micro_batches", "loss_fn"]
    }
    assert steps == {**BUGS, **STATE_ACROSS_CALLS_BUGS}
    assert not set(STATE_ACROSS_CALLS_BUGS) & set(BUGS)
    assert set(ITEM_WEIGHTED_BUGS) <= set(BUGS)


def test_caches_item_count_is_exact_alone_and_wrong_after_a_window_of_another_size() -> None:
    bugs.forget_item_count()
    try:
        equiv.check(bugs.caches_item_count, case()).assert_ok()  # a batch of 6: its first window
        equiv.check(bugs.caches_item_count, case(micro_batch_sizes=(1, 5))).assert_ok()  # as large: exact
        verdict = equiv.check(bugs.caches_item_count, case(batch_size=4, micro_batch_sizes=(1, 3)))
        assert verdict.status == "not_equivalent", verdict.message()
        bugs.forget_item_count()  # as a fresh process: the same case alone is exact
        equiv.check(bugs.caches_item_count, case(batch_size=4, micro_batch_sizes=(1, 3))).assert_ok()
    finally:
        bugs.forget_item_count()

"""LR schedulers a case may name: every kind the search draws builds and moves
the lr at every step; composites (warm-up then cosine) are plain values,
validated with the bad entry named, and round-trip through JSON."""

import itertools
import json
import re

import pytest
from hypothesis import find

import equiv
from equiv import strategies as eqst
from equiv.cases.case import COMPOSITE_SCHEDULERS, Case, InvalidCase

BASE = Case(batch_size=4, micro_batch_sizes=(1, 3), model_kwargs={"hidden": (8,)}, steps=3)
DRAWN = [name for name in eqst.SCHEDULERS if name is not None]


def lrs(case: Case, steps: int = 3) -> list[float]:
    """The lr of the first group before each of ``steps`` optimizer steps."""
    optimizer = case.build_optimizer(case.build_model().module)
    scheduler = case.build_scheduler(optimizer)
    out = []
    for _ in range(steps):
        out.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return out


@pytest.mark.parametrize("name", DRAWN)
@pytest.mark.parametrize(
    ("optimizer", "kwargs"), [("SGD", {"lr": 0.1, "momentum": 0.9}), ("Adam", {"lr": 1e-2}), ("Adagrad", {"lr": 1e-2})]
)
def test_every_drawn_scheduler_moves_the_lr_at_each_step_of_a_case(name: str, optimizer: str, kwargs: dict) -> None:
    # A step that steps its scheduler too often, too early or on a skipped
    # window shows only if the lr differs from one step to the next.
    case = BASE.replace(
        optimizer=optimizer, optimizer_kwargs=kwargs, scheduler=name, scheduler_kwargs=eqst.SCHEDULERS[name]
    )
    seen = lrs(case)
    assert all(a != b for a, b in itertools.pairwise(seen)), (name, seen)


def test_composites_build_their_parts_on_the_case_optimizer() -> None:
    warm_then_cosine = BASE.replace(scheduler="SequentialLR", scheduler_kwargs=eqst.SCHEDULERS["SequentialLR"])
    # LinearLR from a quarter of lr 0.1 for one step, then cosine over two.
    assert lrs(warm_then_cosine) == pytest.approx([0.025, 0.1, 0.05])
    chained = BASE.replace(scheduler="ChainedScheduler", scheduler_kwargs=eqst.SCHEDULERS["ChainedScheduler"])
    assert lrs(chained) == pytest.approx([0.025, 0.0625 * 0.7, 0.1 * 0.49])


def test_composites_round_trip_through_json_and_accept_tuples_and_classes() -> None:
    import torch

    spelled = BASE.replace(
        scheduler="sequentiallr",
        scheduler_kwargs={
            "schedulers": (
                (torch.optim.lr_scheduler.LinearLR, {"total_iters": 1}),
                ("CosineAnnealingLR", {"T_max": 2}),
            ),
            "milestones": [1],
        },
    )
    assert spelled.scheduler == "SequentialLR"
    assert spelled.scheduler_kwargs["schedulers"] == [
        ["LinearLR", {"total_iters": 1}],
        ["CosineAnnealingLR", {"T_max": 2}],
    ]
    read_back = Case.from_dict(json.loads(json.dumps(spelled.to_dict())))
    assert read_back.scheduler_kwargs == spelled.scheduler_kwargs
    assert lrs(read_back) == lrs(spelled)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "scheduler SequentialLR needs scheduler_kwargs['schedulers']: a non-empty list of [name, kwargs] pairs"),
        ({"schedulers": []}, "needs scheduler_kwargs['schedulers']"),
        ({"schedulers": "LinearLR"}, "got 'LinearLR'"),
        (
            {"schedulers": [["LinearLR"]]},
            "part 0 of scheduler_kwargs['schedulers'] must be a [name, kwargs] pair, got ['LinearLR']",
        ),
        (
            {"schedulers": [["LinearLR", {}], ["CosineAnealingLR", {}]]},
            "part 1 names 'CosineAnealingLR'; expected a scheduler class of torch.optim.lr_scheduler other than "
            "ChainedScheduler or SequentialLR (did you mean 'CosineAnnealingLR'?)",
        ),
        ({"schedulers": [["ChainedScheduler", {"schedulers": []}]]}, "part 0 names 'ChainedScheduler'"),
    ],
    ids=["missing", "empty", "a-string", "no-kwargs", "misspelt", "nested-composite"],
)
def test_a_malformed_composite_is_rejected_naming_the_entry(kwargs: dict, message: str) -> None:
    with pytest.raises(InvalidCase, match=re.escape(message)):
        BASE.replace(scheduler="SequentialLR", scheduler_kwargs=kwargs)


def test_a_part_torch_rejects_is_reported_with_its_own_arguments() -> None:
    case = BASE.replace(scheduler="ChainedScheduler", scheduler_kwargs={"schedulers": [["StepLR", {"gamma": 0.5}]]})
    with pytest.raises(InvalidCase, match=re.escape("scheduler StepLR(**{'gamma': 0.5}) rejected")):
        case.build_scheduler(case.build_optimizer(case.build_model().module))


@pytest.mark.slow
def test_the_search_draws_every_kind_and_shrinks_to_none_then_to_step_lr() -> None:
    everything = eqst.cases(schedulers=list(eqst.SCHEDULERS))
    assert find(everything, lambda c: True).scheduler is None
    assert find(eqst.cases(schedulers=DRAWN), lambda c: True).scheduler == "StepLR"
    for name in COMPOSITE_SCHEDULERS:
        drawn = find(everything, lambda c, name=name: c.scheduler == name)
        assert drawn.scheduler_kwargs == Case.from_dict(drawn.to_dict()).scheduler_kwargs
    assert set(DRAWN) >= {"StepLR", "MultiStepLR", "CosineAnnealingLR", *COMPOSITE_SCHEDULERS}


@pytest.mark.slow
def test_a_step_that_takes_a_scheduler_is_searched_with_every_kind() -> None:
    def scheduled(model, optimizer, micro_batches, loss_fn, *, scheduler=None):  # type: ignore[no-untyped-def]
        pass

    for name in DRAWN:
        assert find(equiv.strategies.cases_for(scheduled), lambda c, name=name: c.scheduler == name).scheduler == name

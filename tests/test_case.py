"""Case fields for parameter groups and frozen layers: validated, serialised,
and built into the optimizer and model that training recipes build."""

import json

import pytest
import torch

import equiv
from equiv.cases.case import HEAD_LR_BODY_FACTOR, PARAM_GROUPS, Case, InvalidCase

MLP_LN = {"hidden": (8,), "norm": "layer"}


def case(**changes) -> Case:
    base = {"batch_size": 4, "micro_batch_sizes": (1, 3), "model_kwargs": MLP_LN}
    return Case(**{**base, **changes})


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"frozen_layers": (1, 1)}, "non-empty tuple of distinct layer indices, got (1, 1)"),
        (
            {"frozen_layers": True},
            "frozen_layers must be an int (k: the first k layers, -k: all but the last k) "
            "or a non-empty tuple of distinct layer indices, got True",
        ),
        (
            {"frozen_layers": 1.0},
            "frozen_layers must be an int (k: the first k layers, -k: all but the last k) "
            "or a non-empty tuple of distinct layer indices, got 1.0",
        ),
        (
            {"param_groups": "layerwise"},
            "unknown param_groups 'layerwise'; expected None or one of ['head_lr', 'no_decay', 'parked']",
        ),
        ({"param_groups": ""}, "unknown param_groups ''"),
    ],
    ids=["frozen-repeated", "frozen-bool", "frozen-float", "groups-unknown", "groups-empty-name"],
)
def test_bad_new_fields_are_rejected_naming_the_value(changes: dict, message: str) -> None:
    with pytest.raises(InvalidCase) as raised:
        case(**changes)
    assert message in str(raised.value)


def test_new_fields_round_trip_through_dict_json_and_repr() -> None:
    original = case(
        frozen_layers=1, param_groups="head_lr", optimizer="AdamW", optimizer_kwargs={"lr": 1e-3, "weight_decay": 0.1}
    )
    data = original.to_dict()
    assert data["frozen_layers"] == 1 and data["param_groups"] == "head_lr"
    assert Case.from_dict(data) == original
    # Plain JSON values (JSON turns the tuples of model_kwargs into lists, so compare the new fields).
    from_json = Case.from_dict(json.loads(json.dumps(data)))
    assert (from_json.frozen_layers, from_json.param_groups) == (1, "head_lr")
    shown = repr(original)
    assert "frozen_layers=1" in shown and "param_groups='head_lr'" in shown
    assert eval(shown, {"Case": Case}) == original
    # Defaults stay out of the repr, so existing reproductions read as before.
    assert "frozen_layers" not in repr(case()) and "param_groups" not in repr(case())


def test_frozen_layers_freeze_the_first_layers_that_own_parameters_only() -> None:
    module = case(frozen_layers=1).build_model().module  # Linear, LayerNorm, Tanh, Linear
    frozen = [name for name, p in module.named_parameters() if not p.requires_grad]
    assert frozen == ["0.weight", "0.bias"]
    two = case(frozen_layers=2).build_model().module
    assert [name for name, p in two.named_parameters() if not p.requires_grad] == [
        "0.weight",
        "0.bias",
        "1.weight",
        "1.bias",
    ]
    assert all(p.requires_grad for p in case().build_model().module.parameters())


def test_freezing_counts_attention_projections_as_their_own_layers() -> None:
    # MultiheadAttention owns in_proj_weight; its out_proj is a layer of its own.
    module = case(model="attention", model_kwargs={}, frozen_layers=3).build_model().module
    frozen = [name for name, p in module.named_parameters() if not p.requires_grad]
    assert frozen == ["embed.weight", "norm.weight", "norm.bias", "attention.in_proj_weight"]
    assert module.attention.out_proj.weight.requires_grad and module.head.weight.requires_grad


def test_freezing_every_layer_is_rejected_when_the_model_is_built() -> None:
    with pytest.raises(InvalidCase, match=r"frozen_layers=3 would freeze every layer of model 'mlp' \(3 with"):
        case(frozen_layers=3).build_model()


def test_the_optimizer_holds_frozen_parameters_and_the_full_batch_never_moves_them() -> None:
    frozen = case(frozen_layers=1, optimizer="AdamW", optimizer_kwargs={"lr": 1e-2, "weight_decay": 0.5})
    module = frozen.build_model().module
    optimizer = frozen.build_optimizer(module)
    assert sum(len(g["params"]) for g in optimizer.param_groups) == len(list(module.parameters()))
    before = module[0].weight.detach().clone()
    bundle = frozen.build_model()
    inputs, targets = frozen.batches(bundle)[0]
    optimizer.zero_grad()
    frozen.build_loss()(module(inputs), targets).backward()
    assert module[0].weight.grad is None  # what the trajectory's snapshots and floors rely on
    optimizer.step()
    assert torch.equal(module[0].weight, before)
    assert not torch.equal(module[3].weight, bundle.module[3].weight)  # the rest trains
    equiv.check(equiv.accumulator_step, frozen).assert_ok()


def test_no_decay_groups_split_biases_and_norm_weights_from_the_rest() -> None:
    recipe = case(param_groups="no_decay", optimizer="AdamW", optimizer_kwargs={"lr": 1e-3, "weight_decay": 0.1})
    module = recipe.build_model().module
    decay, no_decay = recipe.build_optimizer(module).param_groups
    names = {id(p): name for name, p in module.named_parameters()}
    assert [names[id(p)] for p in decay["params"]] == ["0.weight", "3.weight"]
    assert [names[id(p)] for p in no_decay["params"]] == ["0.bias", "1.weight", "1.bias", "3.bias"]
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.1, 0.0)
    assert decay["lr"] == no_decay["lr"] == 1e-3


def test_no_decay_gives_an_optimizer_without_weight_decay_two_plain_groups() -> None:
    recipe = case(param_groups="no_decay", optimizer="Rprop", optimizer_kwargs={"lr": 1e-3})
    groups = recipe.build_optimizer(recipe.build_model().module).param_groups
    assert len(groups) == 2 and all("weight_decay" not in group for group in groups)


def test_head_lr_trains_the_last_layer_at_lr_and_the_body_at_a_tenth() -> None:
    recipe = case(param_groups="head_lr", optimizer_kwargs={"lr": 0.2, "weight_decay": 0.01})
    module = recipe.build_model().module
    body, head = recipe.build_optimizer(module).param_groups
    assert [p is q for p, q in zip(head["params"], [module[3].weight, module[3].bias], strict=True)] == [True, True]
    assert len(body["params"]) == 4
    assert head["lr"] == 0.2 and body["lr"] == pytest.approx(HEAD_LR_BODY_FACTOR * 0.2)
    assert body["weight_decay"] == head["weight_decay"] == 0.01
    # Without an lr in the kwargs, the optimizer's default lr is the head's.
    default = case(param_groups="head_lr", optimizer="Adam", optimizer_kwargs={})
    body, head = default.build_optimizer(default.build_model().module).param_groups
    assert head["lr"] == 1e-3 and body["lr"] == pytest.approx(1e-4)


@pytest.mark.parametrize("recipe", sorted(PARAM_GROUPS))
def test_a_recipe_that_leaves_a_group_empty_is_rejected_naming_the_model(recipe: str) -> None:
    toy = Case(batch_size=2, micro_batch_sizes=(1, 1), model="scalar_linear", param_groups=recipe)
    with pytest.raises(InvalidCase, match=rf"param_groups '{recipe}' .* empty for model 'scalar_linear'"):
        toy.build_optimizer(toy.build_model().module)


@pytest.mark.parametrize("recipe", sorted(PARAM_GROUPS))
def test_schedulers_step_every_group(recipe: str) -> None:
    scheduled = case(param_groups=recipe, scheduler="StepLR", scheduler_kwargs={"step_size": 1, "gamma": 0.5})
    optimizer = scheduled.build_optimizer(scheduled.build_model().module)
    before = [group["lr"] for group in optimizer.param_groups]
    scheduler = scheduled.build_scheduler(optimizer)
    optimizer.step()
    scheduler.step()
    assert [group["lr"] for group in optimizer.param_groups] == [lr / 2 for lr in before]


def test_torch_objects_and_any_capitalisation_are_accepted_as_the_canonical_names() -> None:
    case = Case(
        batch_size=2,
        micro_batch_sizes=(1, 1),
        dtype=torch.float64,
        optimizer=torch.optim.AdamW,
        optimizer_kwargs={"lr": 1e-3},
        scheduler=torch.optim.lr_scheduler.StepLR,
        scheduler_kwargs={"step_size": 1},
        autocast=torch.bfloat16,
    )
    assert (case.dtype, case.optimizer, case.scheduler, case.autocast) == ("float64", "AdamW", "StepLR", "bfloat16")
    assert Case(batch_size=2, micro_batch_sizes=(1, 1), optimizer="adamw", loss="MSE", model="MLP") == Case(
        batch_size=2, micro_batch_sizes=(1, 1), optimizer="AdamW", loss="mse", model="mlp"
    )
    assert Case.from_dict(case.to_dict()) == case


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"optimizer": "AdamX"},
            "unknown optimizer 'AdamX'; expected a class in torch.optim or one of ['DeepSpeedMuon'] "
            "(did you mean 'Adamax'?)",
        ),
        ({"loss": "crossentropy"}, "(did you mean 'cross_entropy'?)"),
        ({"model": "mpl"}, "(did you mean 'mlp'?)"),
        ({"optimizer_kwargs": {"lr": -1}}, "optimizer SGD(**{'lr': -1}) rejected: Invalid learning rate: -1"),
        ({"optimizer_kwargs": {"lrr": 0.1}}, "unexpected keyword argument 'lrr'"),
    ],
    ids=["did-you-mean-optimizer", "did-you-mean-loss", "did-you-mean-model", "negative-lr", "misspelt-kwarg"],
)
def test_names_and_optimizer_keywords_are_checked_when_the_case_is_made(changes: dict, message: str) -> None:
    with pytest.raises(InvalidCase) as raised:
        Case(batch_size=2, micro_batch_sizes=(1, 1), **changes)
    assert message in str(raised.value)


def test_frozen_layers_anywhere_and_their_bad_values() -> None:
    three = {"batch_size": 2, "micro_batch_sizes": (1, 1), "model_kwargs": {"hidden": (8, 8)}}
    trains = {
        spec: [
            p.requires_grad
            for n, p in Case(**three, frozen_layers=spec).build_model().module.named_parameters()
            if n.endswith("weight")
        ]
        for spec in (1, -1, (1,), (-1,), (0, 2))
    }
    assert trains == {
        1: [False, True, True],
        -1: [False, False, True],
        (1,): [True, False, True],
        (-1,): [True, True, False],
        (0, 2): [False, True, False],
    }
    assert Case.from_dict(Case(**three, frozen_layers=(1,)).to_dict()).frozen_layers == (1,)
    with pytest.raises(InvalidCase, match=r"names layer\(s\) \[5\] of model 'mlp', which has 3 layers"):
        Case(**three, frozen_layers=(5,)).build_model()
    with pytest.raises(InvalidCase, match="would freeze every layer"):
        Case(**three, frozen_layers=(0, 1, 2)).build_model()
    with pytest.raises(InvalidCase, match=r"all but the last 3.* freezes nothing"):
        Case(**three, frozen_layers=-3).build_model()

"""How equiv reads DeepSpeed without running it (equiv.distributed.deepspeed): its Adams' torch equivalents, their
state in torch's form, the hyperparameters as their kernels take them, and the refusals, on stand-in classes that
live where DeepSpeed's do (so DeepSpeed need not be installed)."""

from __future__ import annotations

import pytest
import torch

import equiv
from equiv.distributed.deepspeed import kernel_hyperparameters, torch_equivalent, torch_state, torch_state_dict


def _deepspeed_class(name: str, **attributes: object) -> type[torch.optim.Optimizer]:
    """A torch optimizer class named and placed as DeepSpeed's (``deepspeed.ops.adam``), stepping nothing."""

    def __init__(self: torch.optim.Optimizer, params: object, lr: float = 1e-3, **defaults: object) -> None:
        torch.optim.Optimizer.__init__(self, params, {"lr": lr, **defaults})
        for key, value in attributes.items():
            setattr(self, key, value)

    return type(name, (torch.optim.Optimizer,), {"__init__": __init__, "__module__": "deepspeed.ops.adam.fused_adam"})


def test_fused_adam_is_replayed_as_adamw_or_adam_with_its_kernels_float32_hyperparameters() -> None:
    params = [torch.nn.Parameter(torch.ones(3))]
    fused = _deepspeed_class("FusedAdam", adam_w_mode=1)(
        params, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, bias_correction=True
    )
    cls, keywords = torch_equivalent(fused)  # type: ignore[misc]
    assert cls is torch.optim.AdamW
    # beta2 as the C++ kernel holds it: float32(0.999), whose 1 - beta2 is 1.3e-5 off 0.001
    assert keywords["betas"][1] == float(torch.tensor(0.999, dtype=torch.float32)) != 0.999
    assert abs((1 - keywords["betas"][1]) / 0.001 - 1) > 1e-5
    plain = _deepspeed_class("FusedAdam", adam_w_mode=0)(params, lr=1e-2, betas=(0.9, 0.999), eps=1e-8)
    assert torch_equivalent(plain)[0] is torch.optim.Adam  # type: ignore[index]
    assert torch_equivalent(torch.optim.SGD(params, lr=0.1)) is None  # a torch optimizer replays as itself
    assert kernel_hyperparameters({"lr": 0.1, "momentum": 0.9}) == {"lr": float(torch.tensor(0.1, dtype=torch.float32))}


def test_deepspeed_optimizers_without_a_torch_equivalent_are_refused_by_name() -> None:
    params = [torch.nn.Parameter(torch.ones(3))]
    with pytest.raises(ValueError, match="FusedLamb has no torch equivalent"):
        torch_equivalent(_deepspeed_class("FusedLamb")(params))
    uncorrected = _deepspeed_class("FusedAdam", adam_w_mode=1)(params, bias_correction=False, betas=(0.9, 0.99))
    with pytest.raises(ValueError, match="bias_correction=False"):
        torch_equivalent(uncorrected)
    # DeepSpeed's Muon updates whole matrices: pointed at the check that judges it, by its case's optimizer name.
    with pytest.raises(ValueError, match=r"MuonWithAuxAdam.*check_distributed.*optimizer='DeepSpeedMuon'"):
        torch_equivalent(_deepspeed_class("MuonWithAuxAdam")(params))


def test_fused_adams_per_group_step_count_is_every_parameters_in_torchs_form() -> None:
    first, second = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))
    fused = _deepspeed_class("FusedAdam", adam_w_mode=1)([first, second], lr=1e-2, betas=(0.9, 0.999), eps=1e-8)
    # FusedAdam advances only the group's last parameter's step, and steps every parameter with it
    fused.state[first] = {"step": 0, "exp_avg": torch.zeros(2), "exp_avg_sq": torch.zeros(2)}
    fused.state[second] = {"step": 4, "exp_avg": torch.zeros(3), "exp_avg_sq": torch.zeros(3)}
    assert [float(state["step"]) for state in torch_state(fused).values()] == [4.0, 4.0]
    replica = torch.optim.AdamW([first.detach().clone(), second.detach().clone()], lr=1.0)
    loaded = torch_state_dict(fused.state_dict(), replica)
    replica.load_state_dict(loaded)
    assert replica.param_groups[0]["decoupled_weight_decay"] is True  # torch's own group settings kept
    assert replica.param_groups[0]["lr"] == float(torch.tensor(1e-2, dtype=torch.float32))  # DeepSpeed's, as taken
    assert [float(state["step"]) for state in replica.state.values()] == [4.0, 4.0]


def test_the_audit_needs_an_optimizer_unless_handed_a_deepspeed_engine() -> None:
    model = torch.nn.Linear(2, 1)
    with pytest.raises(TypeError, match="needs the run's optimizer"):
        equiv.audit(model, loss=equiv.MSE())

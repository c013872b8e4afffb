"""Randomness no module names: a forward that draws random numbers reaching its output (functional dropout, as a
transformers attention's ``attention_dropout``; a router's jitter noise) cannot be replayed, and judged anyway its
floor samples' own draws widen the allowance past a weighting bug (a mean of means passed at 0.43 of it).  The
audit sees the draws in the recorded forward, asks once whether they reach the output (the same micro-batch under
two seeds) and reports every such window inherently not equivalent, with what to turn off."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import equiv
from equiv.judging.inherent import SEED_DEPENDENT, seed_dependence
from equiv.outcomes import Outcome

LOADER = [(torch.randn(n, 4, generator=torch.Generator().manual_seed(n)), torch.randn(n, 1)) for n in (3, 5, 2, 6)]


class Random(nn.Module):
    """A router-style jitter (Mixtral, Phimoe: ``hidden *= U(1 - eps, 1 + eps)`` in training), functional dropout,
    or a layer-drop probability drawn and compared with 0 (Bart's, Whisper's: a draw that reaches nothing)."""

    def __init__(self, *, jitter: float = 0.0, dropout: float = 0.0, layerdrop_draw: bool = False) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 1)
        self.jitter, self.dropout, self.layerdrop_draw = jitter, dropout, layerdrop_draw

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and self.jitter > 0:
            x = x * torch.empty_like(x).uniform_(1.0 - self.jitter, 1.0 + self.jitter)
        hidden = torch.tanh(self.a(x))
        if self.training and self.layerdrop_draw and torch.rand([]) < 0.0:
            hidden = torch.zeros_like(hidden)
        return self.b(F.dropout(hidden, p=self.dropout, training=self.training))  # type: ignore[no-any-return]


def _audited(model: nn.Module, *, mean_of_means: bool = False) -> equiv.Audit:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    criterion = nn.MSELoss(reduction="mean" if mean_of_means else "sum")
    with equiv.audit(model, optimizer, loss=equiv.MSE(), criterion=criterion, every=1) as audit:
        for start in (0, 2):
            window = LOADER[start : start + 2]
            total = sum(len(x) for x, _ in window)
            for x, y in window:
                loss = criterion(model(x), y)
                (loss / len(window) if mean_of_means else loss / total).backward()
            optimizer.step()
            optimizer.zero_grad()
    return audit


@pytest.mark.parametrize("random", [{"dropout": 0.1}, {"jitter": 0.01}], ids=["functional dropout", "jitter"])
def test_a_forward_whose_random_numbers_reach_its_output_is_inherent_not_a_silent_pass(random: dict) -> None:
    torch.manual_seed(0)
    for mean_of_means in (False, True):  # a correct loop and a mean of means alike: neither judged
        audit = _audited(Random(**random), mean_of_means=mean_of_means)
        assert [window.status for window in audit.windows] == [Outcome.INHERENTLY_NON_EQUIVALENT] * 2, audit.summary()
        assert "draws random numbers that reach its output" in audit.summary()
        assert "attention_dropout and router_jitter_noise, at 0.0" in audit.summary()


def test_a_draw_that_reaches_nothing_is_judged_and_a_mean_of_means_still_fails() -> None:
    torch.manual_seed(0)
    assert _audited(Random(layerdrop_draw=True)), "a layer-drop probability of 0, drawn: judged, equivalent"
    torch.manual_seed(0)
    failing = _audited(Random(layerdrop_draw=True), mean_of_means=True)
    assert [window.status for window in failing.windows] == [Outcome.NOT_EQUIVALENT] * 2, failing.summary()


def test_the_audit_leaves_the_runs_random_numbers_as_they_were() -> None:
    # The probe runs under its own seeds and puts torch's generator back: the audited run trains as it would.
    def trained(audit: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = Random(jitter=0.01)
        if audit:
            _audited(model)
        else:
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            for start in (0, 2):
                window = LOADER[start : start + 2]
                total = sum(len(x) for x, _ in window)
                for x, y in window:
                    (F.mse_loss(model(x), y, reduction="sum") / total).backward()
                optimizer.step()
                optimizer.zero_grad()
        return [p.detach().clone() for p in model.parameters()] + [torch.rand(3)]

    assert all(torch.equal(a, b) for a, b in zip(trained(True), trained(False), strict=True))


def test_the_seed_probe_runs_once_per_audit(monkeypatch: pytest.MonkeyPatch) -> None:
    from equiv.auditing.replay import WindowReplay

    probes = []
    probe = WindowReplay.seed_dependence
    monkeypatch.setattr(WindowReplay, "seed_dependence", lambda self, window: probes.append(1) or probe(self, window))
    torch.manual_seed(0)
    assert len(_audited(Random(dropout=0.1)).windows) == 2 and len(probes) == 1
    probes.clear()
    _audited(Random())  # no random draw recorded: never probed
    assert probes == []


def test_seed_dependence_measures_how_far_the_seed_moves_the_output() -> None:
    x, cpu = torch.randn(16, 4, dtype=torch.float64), torch.device("cpu")
    deterministic, dropping = Random().double(), Random(dropout=0.5).double()
    state = torch.get_rng_state()
    assert seed_dependence(lambda: deterministic(x), cpu) is None
    assert seed_dependence(lambda: Random(layerdrop_draw=True).double()(x), cpu) is not None
    moved = seed_dependence(lambda: dropping(x), cpu)
    assert moved is not None and moved > SEED_DEPENDENT
    assert torch.equal(state, torch.get_rng_state())


@pytest.mark.peers("transformers", "accelerate")
def test_the_trainer_on_a_llama_with_attention_dropout_is_not_judged() -> None:
    # Measured before: with attention_dropout=0.1 a head ignoring num_items_in_batch (not equivalent on windows
    # 1 and 3) read "equivalent" on window 1 and a confused witness on window 3.
    from equiv.auditing.runs import trainer_run

    for loss_kwargs in (True, False):
        audited = trainer_run(loss_kwargs=loss_kwargs, attention_dropout=0.1)
        assert audited.judged == 0 and len(audited.windows) == 4, audited.summary()
        assert "attention_dropout" in audited.summary()

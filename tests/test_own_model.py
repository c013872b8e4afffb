"""Bring your own model, data and loss in one call: no registry entry.

The user's model here is a small GPT-style causal LM built from a config
object (the shape of ``transformers``' ``GPT2Config`` + ``GPT2LMHeadModel``,
in plain torch so the test needs nothing beyond torch), its data padded token
batches of uneven length, and its loss a token cross-entropy written against
the sum + count protocol.  docs/check.md shows the same with transformers itself.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import equiv
from equiv.cases.case import InvalidCase
from equiv.zoo.bugs import BUGS

IGNORE = -100


@dataclass(frozen=True)
class TinyGPTConfig:
    vocab_size: int = 23
    n_positions: int = 6
    n_embd: int = 16
    n_head: int = 2


class TinyGPT(nn.Module):
    """Token + position embeddings, one pre-norm block, an LM head: GPT-2's layout, scaled down."""

    def __init__(self, config: TinyGPTConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.n_positions, config.n_embd)
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = nn.MultiheadAttention(config.n_embd, config.n_head, dropout=0.0, bias=False, batch_first=True)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(config.n_embd, 4 * config.n_embd), nn.GELU(), nn.Linear(4 * config.n_embd, config.n_embd)
        )
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(self, input_ids: Tensor) -> Tensor:
        length = input_ids.shape[1]
        hidden = self.wte(input_ids) + self.wpe(torch.arange(length, device=input_ids.device))
        mask = torch.triu(torch.ones(length, length, dtype=torch.bool, device=input_ids.device), 1)
        normed = self.ln_1(hidden)
        hidden = hidden + self.attn(normed, normed, normed, attn_mask=mask, need_weights=False)[0]
        hidden = hidden + self.mlp(self.ln_2(hidden))
        logits: Tensor = self.lm_head(self.ln_f(hidden))
        return logits


def make_tiny_gpt(**overrides: int) -> nn.Module:
    """The user's factory: a model from a config, no download, no registry entry."""
    return TinyGPT(TinyGPTConfig(**overrides))


def padded_token_batches(step: int, batch_size: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """The user's data: sequences of 2..6 tokens, right-padded; labels are the
    next tokens, IGNORE where there is none."""
    config = TinyGPTConfig()
    tokens = torch.randint(0, config.vocab_size, (batch_size, config.n_positions + 1), generator=generator)
    lengths = torch.randint(2, config.n_positions + 2, (batch_size, 1), generator=generator)
    padding = torch.arange(config.n_positions + 1).expand_as(tokens) >= lengths
    input_ids = tokens[:, :-1].masked_fill(padding[:, :-1], 0)
    labels = tokens[:, 1:].masked_fill(padding[:, 1:], IGNORE)
    return input_ids, labels


class NextTokenLoss:
    """The user's loss, written against the sum + count protocol (no equiv base class)."""

    def __call__(self, logits: Tensor, labels: Tensor) -> Tensor:
        return self.sum(logits, labels) / self.count(labels)

    def sum(self, logits: Tensor, labels: Tensor) -> Tensor:
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE, reduction="sum")

    def count(self, labels: Tensor) -> Tensor:
        return (labels != IGNORE).sum()

    def __repr__(self) -> str:
        return "NextTokenLoss()"


def own_case(**changes: object) -> equiv.Case:
    fields = dict(
        batch_size=7,
        micro_batch_sizes=(2, 5),
        model=make_tiny_gpt,
        data=padded_token_batches,
        loss=NextTokenLoss(),
        optimizer="AdamW",
        optimizer_kwargs={"lr": 1e-3},
        max_grad_norm=0.5,
    )
    return equiv.Case(**{**fields, **changes})  # type: ignore[arg-type]


def test_own_causal_lm_with_own_data_and_loss_passes_the_reference() -> None:
    verdict = equiv.check(equiv.accumulator_step, own_case())
    assert verdict, verdict.message()
    assert set(verdict.worst) == {"exact", "noise"}


@pytest.mark.parametrize("bug", ["sample_weighted_token_loss", "mean_of_means", "clip_per_micro_batch"])
def test_own_causal_lm_finds_token_bugs(bug: str) -> None:
    verdict = equiv.check(BUGS[bug], own_case())
    assert not verdict, f"{bug} passed on a user's token-level case"
    assert verdict.mismatches[0].step == 1


def test_own_factory_replays_through_its_import_path() -> None:
    case = own_case()
    as_dict = case.to_dict()
    assert as_dict["model"].endswith(":make_tiny_gpt")
    assert as_dict["data"].endswith(":padded_token_batches")
    assert as_dict["loss"].endswith(":NextTokenLoss")
    # The replay line a verdict prints imports the same factory and rebuilds the same weights.
    own_module = as_dict["model"].partition(":")[0]
    replayed = equiv.Case.from_dict(json.loads(json.dumps(as_dict)), allow_imports=[own_module])
    assert f"model={as_dict['model']!r}" in repr(case)
    first = dict(case.build_model().module.named_parameters())
    again = dict(replayed.build_model().module.named_parameters())
    assert all(torch.equal(first[name], again[name]) for name in first)
    batches, replayed_batches = case.batches(case.build_model()), replayed.batches(replayed.build_model())
    assert all(
        torch.equal(a, b) for x, y in zip(batches, replayed_batches, strict=True) for a, b in zip(x, y, strict=True)
    )


def test_model_kwargs_reach_the_factory() -> None:
    module = own_case(model_kwargs={"n_embd": 8}).build_model().module
    assert module.wte.weight.shape == (23, 8)


def test_a_local_factory_checks_but_says_its_replay_needs_an_import_path() -> None:
    case = own_case(model=lambda: make_tiny_gpt())
    assert equiv.check(equiv.accumulator_step, case)
    assert "not importable" in repr(case)
    with pytest.raises(InvalidCase, match="not importable"):
        equiv.Case.from_dict(case.to_dict(), allow_imports=True)


def test_a_bare_module_without_data_is_a_clear_error() -> None:
    case = own_case(data="random", loss="token_cross_entropy")
    with pytest.raises(InvalidCase, match=r"bare nn\.Module.*pass data="):
        equiv.check(equiv.accumulator_step, case)


def test_data_with_the_wrong_batch_size_is_a_clear_error() -> None:
    case = own_case(data=lambda step, batch_size, generator: padded_token_batches(step, batch_size + 1, generator))
    with pytest.raises(InvalidCase, match=r"shape \(8, 6\).*batch_size=7"):
        equiv.check(equiv.accumulator_step, case)


@pytest.mark.parametrize("loss", [object(), F.cross_entropy])
def test_a_loss_without_sum_and_count_is_a_clear_error(loss: object) -> None:
    with pytest.raises(InvalidCase, match="sum \\+ count protocol"):
        own_case(loss=loss)


def test_bad_import_paths_are_clear_errors() -> None:
    with pytest.raises(InvalidCase, match="could not import 'no_such_module'"):
        own_case(model="no_such_module:factory")
    with pytest.raises(InvalidCase, match="not callable"):
        own_case(model="math:pi")
    assert math.pi  # the module imported above is a real one


def test_registered_models_are_unchanged() -> None:
    case = equiv.Case(batch_size=3, micro_batch_sizes=(1, 2))
    assert case.to_dict()["model"] == "mlp" and repr(case) == "Case(batch_size=3, micro_batch_sizes=(1, 2))"


def test_the_replay_line_pastes_as_a_case() -> None:
    case = own_case()
    pasted = eval(repr(case), {"Case": equiv.Case})  # what a user does with a printed replay line
    assert pasted.to_dict() == case.to_dict()
    assert isinstance(pasted.loss, NextTokenLoss)

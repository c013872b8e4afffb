"""Packed sequences and RL policy losses: the losses compute what their docstrings say, a packed row
keeps its sequences apart, the reference accumulator reproduces the full batch, and each zoo step is
wrong exactly where its report says (an unaccumulated or evenly weighted case is exact)."""

import pytest
import torch
import torch.nn.functional as F

import equiv
from equiv.cases.packed import PackedLM, draw_packing
from equiv.losses.packed import PackedDPO, PackedRowCrossEntropy, PackedSequenceCrossEntropy, segments
from equiv.losses.policy import GRPOObjective, PolicyLoss
from equiv.zoo.sequence_bugs import PACKED_BUGS, POLICY_BUGS


def packed_case(loss: str, sizes: tuple[int, ...] = (1, 3), **changes: object) -> equiv.Case:
    model = "policy" if loss.startswith("policy") else "packed_lm"
    kwargs = {"pairs": True} if loss == "packed_dpo" else {}
    return equiv.Case(
        batch_size=sum(sizes), micro_batch_sizes=sizes, model=model, model_kwargs=kwargs, loss=loss, steps=2, **changes
    )  # type: ignore[arg-type]


def test_segments_follow_position_ids() -> None:
    positions = torch.tensor([[0, 1, 2, 0, 1, -1], [0, 1, 0, 1, 0, 1]])
    assert segments(positions).tolist() == [[0, 0, 0, 1, 1, -1], [0, 0, 1, 1, 2, 2]]


def test_packings_fill_rows_with_sequences_of_two_tokens_or_more() -> None:
    positions = draw_packing(50, 8, torch.Generator().manual_seed(0), pairs=True)
    for row in positions:
        starts = (row == 0).nonzero().flatten().tolist()
        assert starts[0] == 0 and len(starts) % 2 == 0
        lengths = [b - a for a, b in zip(starts, [*starts[1:], int((row >= 0).sum())], strict=True)]
        assert min(lengths) >= 2
    with pytest.raises(ValueError, match="seq_len=3 cannot hold a pair"):
        draw_packing(1, 3, torch.Generator(), pairs=True)


def test_a_packed_row_keeps_its_sequences_apart() -> None:
    torch.manual_seed(0)
    model = PackedLM(7, 8, 6)
    row = torch.tensor([[[3, 4, 5, 1, 2, 6], [0, 1, 2, 0, 1, 2]]])
    alone = torch.tensor([[[1, 2, 6], [0, 1, 2]]])
    changed = row.clone()
    changed[0, 0, :3] = torch.tensor([6, 6, 6])  # the first sequence's tokens
    # The second sequence's logits are its own whatever the first one holds (positions restart).
    assert torch.allclose(model(row)[0, 3:], model(changed)[0, 3:], atol=1e-6)
    assert torch.allclose(model(row)[0, 3:], model(alone)[0], atol=1e-6)


def test_sequence_and_row_means_average_over_their_own_items() -> None:
    logits = torch.randn(2, 6, 5, generator=torch.Generator().manual_seed(1))
    labels = torch.tensor([[1, 2, -100, 3, -100, -100], [4, 0, 1, 2, 3, -100]])
    positions = torch.tensor([[0, 1, 2, 0, 1, -1], [0, 1, 2, 3, 4, 5]])
    target = torch.stack([labels.float(), positions.float(), torch.zeros(2, 6)], dim=1)
    ce = F.cross_entropy(logits.flatten(0, 1), labels.clamp(min=0).flatten(), reduction="none").view(2, 6)
    by_sequence = [ce[0, :2].mean(), ce[0, 3:4].mean(), ce[1, :5].mean()]
    assert torch.allclose(PackedSequenceCrossEntropy()(logits, target), torch.stack(by_sequence).mean())
    by_row = [ce[0, [0, 1, 3]].mean(), ce[1, :5].mean()]
    assert torch.allclose(PackedRowCrossEntropy()(logits, target), torch.stack(by_row).mean())


def test_dpo_is_the_sigmoid_loss_of_each_pair() -> None:
    logits = torch.randn(1, 6, 4, generator=torch.Generator().manual_seed(2))
    labels = torch.tensor([[1, 2, -100, 3, 0, -100]])
    positions = torch.tensor([[0, 1, 2, 0, 1, 2]])
    reference = torch.full((1, 6), -1.0)
    target = torch.stack([labels.float(), positions.float(), reference], dim=1)
    logp = -F.cross_entropy(logits[0], labels[0].clamp(min=0), reduction="none")
    chosen, rejected = logp[:2].sum() + 2.0, logp[3:5].sum() + 2.0  # minus the reference's -1 per token
    expected = -F.logsigmoid(PackedDPO.beta * (chosen - rejected))
    assert torch.allclose(PackedDPO()(logits, target), expected)
    odd = target.clone()
    odd[0, 1, 3:] = torch.tensor([3.0, 4.0, 5.0])  # one sequence: no whole pair
    with pytest.raises(ValueError, match="whole chosen/rejected pairs"):
        PackedDPO()(logits, odd)


def test_policy_losses_are_trls_documented_objectives() -> None:
    generator = torch.Generator().manual_seed(3)
    logps = torch.randn(3, 4, generator=generator, requires_grad=True)
    target = PolicyLoss().draw_targets(torch.zeros(3, 4), (4,), generator)
    for loss_type in ("grpo", "dapo", "dr_grpo"):
        loss = equiv.Case(batch_size=1, micro_batch_sizes=(1,), model="policy", loss=f"policy_{loss_type}").build_loss()
        objective = GRPOObjective(loss_type, epsilon_low=0.2, epsilon_high=0.28, max_completion_length=4)
        packed = PolicyLoss.packed(target)
        assert torch.allclose(loss(logps, target), objective.sum(logps, packed) / objective.count(packed))
    # On-policy: the loss is -advantage per kept token, its gradient the policy gradient.
    mask, advantages = target[:, 1], target[:, 2]
    dapo = equiv.Case(batch_size=1, micro_batch_sizes=(1,), model="policy", loss="policy_dapo").build_loss()
    (grad,) = torch.autograd.grad(dapo(logps, target), logps)
    assert torch.allclose(grad, -advantages * mask / mask.sum())


@pytest.mark.parametrize(
    "loss",
    [
        "packed_token_ce",
        "packed_sequence_ce",
        "packed_row_ce",
        "packed_dpo",
        "policy_grpo",
        "policy_dapo",
        "policy_dr_grpo",
    ],
)
def test_the_reference_accumulator_reproduces_the_full_batch(loss: str) -> None:
    equiv.check(equiv.accumulator_step, packed_case(loss, (1, 2, 3))).assert_ok()
    equiv.check(equiv.accumulator_step, packed_case(loss, optimizer="Adam", optimizer_kwargs={"lr": 1e-2})).assert_ok()


@pytest.mark.parametrize("name", sorted({**PACKED_BUGS, **POLICY_BUGS}))
def test_each_zoo_step_is_found_on_an_uneven_split(name: str) -> None:
    step, loss = {**PACKED_BUGS, **POLICY_BUGS}[name]
    assert equiv.check(step, packed_case(loss)).status == "not_equivalent"


@pytest.mark.parametrize(
    "name",
    [
        "sequence_means_weighted_by_rows",
        "token_mean_of_micro_batch_means",
        "token_means_weighted_by_sequences",
        "selected_count_per_micro_batch",
    ],
)
def test_accumulation_bugs_are_exact_without_accumulation(name: str) -> None:
    step, loss = {**PACKED_BUGS, **POLICY_BUGS}[name]
    equiv.check(step, packed_case(loss, (4,))).assert_ok()


def test_sequence_weights_are_right_for_grpo_and_wrong_for_dapo() -> None:
    # Trinity-RFT #336: weighting micro-batches by sequences is GRPO's own normaliser, not DAPO's.
    step, _ = POLICY_BUGS["token_means_weighted_by_sequences"]
    equiv.check(step, packed_case("policy_grpo")).assert_ok()
    equiv.check(step, packed_case("policy_dr_grpo")).assert_ok()
    assert not equiv.check(step, packed_case("policy_dapo"))


def test_steps_refuse_a_loss_they_cannot_read() -> None:
    step, _ = PACKED_BUGS["dpo_pairs_swapped"]
    with pytest.raises(equiv.CandidateError, match="needs loss 'packed_dpo'"):
        equiv.check(step, packed_case("packed_sequence_ce"))
    with pytest.raises(equiv.InvalidCase, match="packed losses need packed inputs"):
        equiv.Case(batch_size=2, micro_batch_sizes=(2,), model="token_mlp", loss="packed_token_ce").batches(
            equiv.Case(batch_size=2, micro_batch_sizes=(2,), model="token_mlp", loss="packed_token_ce").build_model()
        )

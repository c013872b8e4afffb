"""MoE load-balancing losses under accumulation: a sequence-wise aux loss is
equivalent, a batch-wise one inherently is not (reported with its reason), and
an aux loss added at full weight per micro-batch (NeMo Automodel PR #3359) is found."""

import pytest
import torch

import equiv
from equiv.cases.moe import MoEModel
from equiv.losses import MSEWithAux
from equiv.zoo.moe_bugs import aux_divided_by_micro_batches, aux_loss_per_micro_batch


def moe_case(balance: str = "sequence", micro_batch_sizes: tuple[int, ...] = (2, 4), **changes) -> equiv.Case:
    return equiv.Case(
        batch_size=sum(micro_batch_sizes),
        micro_batch_sizes=micro_batch_sizes,
        model="moe",
        model_kwargs={"balance": balance},
        loss="mse_aux",
        steps=2,
        **changes,
    )


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"optimizer": "Adam", "optimizer_kwargs": {"lr": 1e-2}},
        {"max_grad_norm": 1e-2},
    ],
    ids=["sgd", "adam", "clipped"],
)
def test_reference_accumulator_is_equivalent_with_a_sequence_wise_aux_loss(changes: dict) -> None:
    equiv.check(equiv.accumulator_step, moe_case(micro_batch_sizes=(1, 2, 3), **changes)).assert_ok()


def test_batch_wise_aux_loss_is_reported_inherent_with_its_reason() -> None:
    verdict = equiv.check(equiv.accumulator_step, moe_case("batch"))
    assert verdict.status == "inherently_non_equivalent"
    (reason,) = verdict.inherent
    assert "load-balancing loss over the batch" in reason and "torchtitan PR #3000" in reason
    # The reason is real: the accumulated update does differ from the full batch's.
    assert verdict.mismatches


def test_batch_wise_aux_loss_is_not_linear_in_the_samples() -> None:
    model = MoEModel(3, 4, 4, 2, 2, "batch", 1.0)
    inputs = torch.randn(6, 4, 3, generator=torch.Generator().manual_seed(0))
    whole = model(inputs)[:, -1].mean()
    pieces = torch.cat([model(inputs[:2])[:, -1], model(inputs[2:])[:, -1]]).mean()
    assert not torch.allclose(whole, pieces)
    sequence_wise = MoEModel(3, 4, 4, 2, 2, "sequence", 1.0)
    sequence_wise.load_state_dict(model.state_dict())
    assert torch.allclose(sequence_wise(inputs), torch.cat([sequence_wise(inputs[:2]), sequence_wise(inputs[2:])]))


def test_aux_loss_at_full_weight_per_micro_batch_is_found() -> None:
    assert equiv.check(aux_loss_per_micro_batch, moe_case(micro_batch_sizes=(6,))), (
        "one micro-batch: nothing to over-weight"
    )
    verdict = equiv.check(aux_loss_per_micro_batch, moe_case(micro_batch_sizes=(3, 3)))
    assert verdict.status == "not_equivalent"


def test_aux_divided_by_micro_batch_count_is_exact_for_equal_micro_batches_only() -> None:
    equiv.check(aux_divided_by_micro_batches, moe_case(micro_batch_sizes=(3, 3))).assert_ok()
    assert equiv.check(aux_divided_by_micro_batches, moe_case(micro_batch_sizes=(2, 4))).status == "not_equivalent"


def test_moe_bugs_refuse_a_loss_without_an_aux_part() -> None:
    case = equiv.Case(batch_size=4, micro_batch_sizes=(2, 2))
    with pytest.raises(equiv.CandidateError, match="needs loss 'mse_aux'"):
        equiv.check(aux_loss_per_micro_batch, case)


def test_bad_moe_arguments_are_named() -> None:
    with pytest.raises(equiv.InvalidCase, match="unknown balance 'tokens'"):
        moe_case("tokens").build_model()
    with pytest.raises(equiv.InvalidCase, match=r"top_k must be in 1\.\.experts"):
        equiv.Case(
            batch_size=2, micro_batch_sizes=(2,), model="moe", model_kwargs={"top_k": 5}, loss="mse_aux"
        ).build_model()
    with pytest.raises(ValueError, match="one column fewer"):
        MSEWithAux()(torch.zeros(2, 3), torch.zeros(2, 3))


def test_report_section_names_the_upstream_issue_of_each_not() -> None:
    from equiv.findings.moe import measure_moe
    from equiv.reporting.markdown import read_markdown_table
    from equiv.reporting.moe import moe_section

    rows = read_markdown_table(moe_section(measure_moe()).split("\n\n", 3)[3])
    for row in rows:
        assert (row["verdict"] == "equivalent") == (row["NOT because"] == "-")
    sequence_wise = {(row["step"], row["split"]): row["verdict"] for row in rows if row["aux loss"] == "sequence-wise"}
    assert sequence_wise[("`accumulator_step`", "2 + 4")] == "equivalent"
    assert sequence_wise[("`aux_loss_per_micro_batch`", "3 + 3")] == "not equivalent"
    assert {row["verdict"] for row in rows if row["aux loss"] == "batch-wise"} == {"inherently non equivalent"}

"""Context parallelism ("cp", "fsdp2+cp"), micro-batches with no real token, and
router aux / z-losses under data and context parallelism: the engine, the search's draws, the zoos."""

from pathlib import Path

import pytest
import torch
from hypothesis import find, settings

import equiv
from equiv.cases.case import Case, InvalidCase
from equiv.checking.distributed import DistributedCase, check_distributed
from equiv.checking.distributed_search import DistributedSearchSpace, distributed_cases, verify_distributed
from equiv.distributed.context_parallel import layout, position_slice, sequence_group
from equiv.losses import TokenMSEWithAux
from equiv.outcomes import Fault, Outcome
from equiv.zoo.aux_loss_bugs import AUX_SEARCH_ZOO
from equiv.zoo.context_parallel_bugs import CP_SEARCH_ZOO, token_count_over_data_ranks_only
from equiv.zoo.distributed_bugs import SEARCH_ZOO

TOKENS = Case(batch_size=1, micro_batch_sizes=(1,), model="token_mlp", loss="token_cross_entropy", steps=2)
MOE = Case(batch_size=1, micro_batch_sizes=(1,), model="moe", model_kwargs={"z_weight": 0.01}, loss="mse_aux", steps=2)
TOKEN_MOE = Case(
    batch_size=1,
    micro_batch_sizes=(1,),
    model="token_moe",
    model_kwargs={"z_weight": 0.01},
    loss="token_mse_aux",
    steps=2,
)
SETTINGS = settings(database=None, max_examples=2000)


def _real_tokens(dcase: DistributedCase, rank: int) -> list[int]:
    """Real tokens per sample that ``rank`` holds at step 0."""
    _, targets = dcase.case.batches(dcase.case.build_model())[0]
    return (targets[dcase.rank_slice(rank)] != -100).sum(1).tolist()


def test_a_cp_rank_holds_its_slice_of_every_sequence_of_its_data_rank() -> None:
    dcase = DistributedCase.of(TOKENS, [[1, 2], [3]], context_parallel=2)
    assert (dcase.world_size, dcase.data_ranks) == (4, 2)
    assert dcase.rank_slice(0) == (slice(0, 3), slice(0, 3)) and dcase.rank_slice(1) == (slice(0, 3), slice(3, 6))
    assert dcase.rank_slice(3) == (slice(3, 6), slice(3, 6)) and dcase.rank_micro_batches(2) == (3,)
    assert DistributedCase.of(TOKENS, [[1, 2], [3]]).rank_slice(1) == slice(3, 6)  # no CP: samples only
    assert dcase.to_dict()["context_parallel"] == 2
    assert eval(dcase.source("equiv."), {"equiv": equiv}) == dcase  # the Reproduce line rebuilds it
    assert position_slice(6, 3, 2) == slice(4, 6)


def test_context_parallelism_refuses_what_it_cannot_split() -> None:
    with pytest.raises(InvalidCase, match="position-wise token model"):
        DistributedCase.of(
            TOKENS.replace(model="attention", model_kwargs={"head": "tokens"}), [[1]], context_parallel=2
        )
    with pytest.raises(InvalidCase, match="divisible"):
        DistributedCase.of(TOKENS.replace(model_kwargs={"seq_len": 5}), [[1]], context_parallel=2)
    with pytest.raises(InvalidCase, match="one way, not both"):
        DistributedCase.of(TOKENS, [[1]], tensor_parallel=2, context_parallel=2)
    with pytest.raises(InvalidCase, match="context_parallel must be a positive int"):
        DistributedCase.of(TOKENS, [[1]], context_parallel=0)
    with pytest.raises(InvalidCase, match=r"needs DistributedCase\.of\(\.\.\., context_parallel=C\)"):
        check_distributed(equiv.accumulator_step, DistributedCase.of(TOKENS, [[1], [1]]), engine="cp")
    with pytest.raises(InvalidCase, match="needs engine 'cp' or 'fsdp2\\+cp'"):
        check_distributed(equiv.accumulator_step, DistributedCase.of(TOKENS, [[1]], context_parallel=2))
    with pytest.raises(RuntimeError, match="no context-parallel layout"):
        layout()


def test_empty_samples_pad_whole_samples_and_leave_the_others_as_drawn() -> None:
    case = TOKENS.replace(batch_size=3, micro_batch_sizes=(3,))
    padded = case.replace(empty_samples=(1,))
    plain, empty = case.batches(case.build_model())[0][1], padded.batches(padded.build_model())[0][1]
    assert (empty[1] == -100).all() and torch.equal(empty[[0, 2]], plain[[0, 2]])
    assert "empty_samples" not in case.to_dict() and Case.from_dict(padded.to_dict()) == padded
    for bad, match in (((3,), "distinct sample indices"), ((0, 0), "distinct"), ((0, 1, 2), "no real token")):
        with pytest.raises(InvalidCase, match=match):
            case.replace(empty_samples=bad)
    with pytest.raises(InvalidCase, match="token_cross_entropy"):
        Case(batch_size=2, micro_batch_sizes=(2,), empty_samples=(0,))


def test_the_search_draws_a_micro_batch_with_no_real_token_on_one_rank_only() -> None:
    def one_rank_empty(dcase: DistributedCase) -> bool:
        held = [sum(_real_tokens(dcase, rank)) for rank in range(dcase.world_size)]
        return 0 in held and any(held)

    for engine in ("ddp", "fsdp2"):
        drawn = find(distributed_cases(models=("tokens",), engine=engine), one_rank_empty, settings=SETTINGS)
        assert drawn.case.empty_samples, drawn


def test_the_cp_search_draws_ragged_slices_including_one_with_none() -> None:
    def ragged_with_empty_slice(dcase: DistributedCase) -> bool:
        held = [sum(_real_tokens(dcase, rank)) for rank in range(dcase.world_size)]
        return dcase.context_parallel == 2 and 0 in held and len(set(held)) > 1 and dcase.data_ranks == 2

    drawn = find(
        distributed_cases(models=("tokens",), engine="cp", max_world_size=4), ragged_with_empty_slice, settings=SETTINGS
    )
    assert drawn.case.model == "token_mlp"
    with pytest.raises(ValueError, match="models must be a subset of \\('tokens', 'moe'\\)"):
        DistributedSearchSpace(engines=("cp",), models=("mlp",))


def test_the_search_draws_the_moe_model_with_its_z_loss() -> None:
    drawn = find(distributed_cases(engine="ddp"), lambda d: d.case.model == "moe", settings=SETTINGS)
    assert drawn.case.loss == "mse_aux" and drawn.case.model_kwargs["z_weight"] > 0


def test_the_cp_search_draws_the_moe_as_the_token_level_moe() -> None:
    drawn = find(distributed_cases(models=("moe",), engine="cp"), lambda d: d.context_parallel == 2, settings=SETTINGS)
    assert (drawn.case.model, drawn.case.loss) == ("token_moe", "token_mse_aux")
    assert drawn.case.model_kwargs["z_weight"] > 0 and drawn.rank_slice(1) == (slice(0, 1), slice(2, 4))


def test_the_token_moe_carries_each_sequences_router_losses_per_token() -> None:
    """Outside context parallelism (no group) each token's shares average to the
    sequence-wise balance loss and z-loss of the pooled MoE with the same weights."""
    assert sequence_group() is None
    bundle = TOKEN_MOE.build_model()
    inputs, targets = TOKEN_MOE.batches(bundle)[0]
    output = bundle.module(inputs)
    pooled = MOE.replace(model_kwargs={"z_weight": 0.01, "aux_weight": 0.1}).build_model().module
    pooled.load_state_dict(bundle.module.state_dict())
    _, aux, z_loss = pooled.moe(torch.tanh(pooled.project(inputs)), with_z=True)
    torch.testing.assert_close(output[..., -2].mean(1), 0.1 * aux)
    torch.testing.assert_close(output[..., -1].mean(1), 0.01 * z_loss)
    loss = TokenMSEWithAux()
    torch.testing.assert_close(loss(output, targets) * loss.count(targets), loss.sum(output, targets))
    with pytest.raises(ValueError, match="two router columns"):
        loss.task_sum(output, targets[..., :1])
    with pytest.raises(InvalidCase, match="position-wise token model"):
        DistributedCase.of(TOKEN_MOE.replace(loss="mse_aux"), [[1]], context_parallel=2)


def test_the_router_z_loss_is_added_only_when_weighted() -> None:
    without, with_z = MOE.replace(model_kwargs={}), MOE
    inputs = without.batches(without.build_model())[0][0]
    plain, weighted = without.build_model().module(inputs), with_z.build_model().module(inputs)
    assert torch.equal(plain[:, :-1], weighted[:, :-1]) and (weighted[:, -1] > plain[:, -1]).all()


@pytest.mark.distributed
@pytest.mark.parametrize("name", sorted(CP_SEARCH_ZOO))
def test_each_cp_step_gets_its_verdict_on_ragged_slices(name: str) -> None:
    entry = CP_SEARCH_ZOO[name]
    split = [[1, 2], [2, 1]]  # 2 data ranks x 2 slices; the slices hold ragged real-token counts
    verdict = check_distributed(entry.step, DistributedCase.of(TOKENS, split, context_parallel=2), engine=entry.engine)
    assert verdict.status is entry.expected, verdict.message()


@pytest.mark.distributed
# The TP (sequence-parallel) rows: tests/test_sequence_parallel.py.
@pytest.mark.parametrize("name", sorted(name for name, entry in AUX_SEARCH_ZOO.items() if entry.engine != "tp"))
def test_each_router_loss_weighting_gets_its_verdict(name: str) -> None:
    entry = AUX_SEARCH_ZOO[name]
    dcase = (
        DistributedCase.of(TOKEN_MOE, [[1, 2]], context_parallel=2)
        if entry.engine == "cp"
        else DistributedCase.of(MOE, [[1, 2], [2, 1]])
    )
    verdict = check_distributed(entry.step, dcase, engine=entry.engine)
    assert verdict.status is entry.expected, verdict.message()


@pytest.mark.distributed
def test_the_accumulator_is_the_token_moes_full_batch_step_under_context_parallelism() -> None:
    """About 3 s: 2 data ranks x 2 slices, the routing counts summed over each sequence's slices."""
    verdict = check_distributed(
        equiv.accumulator_step, DistributedCase.of(TOKEN_MOE, [[1, 2], [2, 1]], context_parallel=2), engine="cp"
    )
    assert verdict.status is Outcome.EQUIVALENT, verdict.message()


@pytest.mark.distributed
def test_a_cp_undercount_is_found_by_the_search_and_shrunk() -> None:
    result = verify_distributed(
        token_count_over_data_ranks_only, engines=("cp",), models=("tokens",), max_examples=10, seed=0
    )
    assert result.found and result.outcome is Outcome.NOT_EQUIVALENT and result.engine == "cp", result.message()
    dcase = result.counterexample
    assert dcase is not None and dcase.context_parallel == 2 and dcase.data_ranks == 1, result.message()
    assert "context_parallel=2), engine='cp')" in result.message()
    assert not check_distributed(token_count_over_data_ranks_only, dcase, engine="cp")


REPORT = Path(__file__).resolve().parent.parent / "reports" / "equivalence.md"
SHRUNK = "shrunk split (samples per micro-batch, per rank)"


def committed_section_rows(heading: str) -> dict[str, dict[str, str]]:
    """The table of the committed report's section whose heading starts with ``heading``: step -> column -> cell.

    ``equiv report equivalence`` runs these zoo searches itself, at the report's seed, and CI regenerates the
    report and fails on any difference from the committed one: what the committed report says is what the
    code concludes, so the searches are read here rather than run a second time (about 5 minutes)."""
    text = REPORT.read_text()
    start = text.index(f"\n## {heading}")
    end = text.find("\n## ", start + 1)
    lines = [line for line in text[start : end if end > 0 else None].splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    rows = {}
    for line in lines[2:]:  # past the header and its rule
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        rows[cells[0]] = dict(zip(header, cells, strict=True))
    return rows


def test_the_committed_report_concludes_every_cp_and_router_loss_entry_as_expected() -> None:
    cp = committed_section_rows("Context parallelism")
    assert set(cp) == set(CP_SEARCH_ZOO), "regenerate reports/equivalence.md (tox -e equivalence)"
    assert [name for name, row in cp.items() if row["as expected"] != "yes"] == [], cp
    aux = committed_section_rows("Router aux and z-losses")
    assert set(aux) == set(AUX_SEARCH_ZOO), "regenerate reports/equivalence.md (tox -e equivalence)"
    assert [name for name, row in aux.items() if row["as expected"] != "yes"] == [], aux
    found = [row for row in aux.values() if row["found"] != "nothing"]
    # Under CP: Megatron-LM #1652, PR #5047 and commit cac8d1a, each shrunk to one data rank of one 1-sample
    # micro-batch cut into 2 sequence slices; under TP's sequence parallelism PR #5047 and cac8d1a, likewise.
    assert (
        sorted(row[SHRUNK] for row in found if "sequence slices" in row[SHRUNK])
        == ["[1] (2 sequence slices per data rank)"] * 3
    ), aux
    assert (
        sorted(row[SHRUNK] for row in found if "TP slices" in row[SHRUNK])
        == ["[1] (sequence parallel: 2 TP slices per data rank)"] * 2
    ), aux
    text = REPORT.read_text()
    assert "verl #5983" in text and "Megatron-LM #3672" in text and "Megatron-LM PR #5047; #1652" in text


@pytest.mark.slow
@pytest.mark.distributed
def test_a_backward_skipped_for_a_micro_batch_with_no_real_token_is_named_and_shrunk() -> None:
    entry = SEARCH_ZOO["skip_backward_without_real_tokens"]
    result = verify_distributed(entry.step, engines=("fsdp2",), models=("tokens",), max_examples=25, seed=0)
    assert result.fault is Fault.COLLECTIVE_MISMATCH, result.message()
    dcase = result.counterexample
    assert dcase is not None and dcase.world_size == 2 and dcase.case.empty_samples, result.message()


@pytest.mark.slow
@pytest.mark.distributed
def test_under_ddp_a_skipped_synced_backward_is_named_and_shrunk_and_the_global_count_passes_there() -> None:
    entry = SEARCH_ZOO["skip_backward_without_real_tokens (DDP)"]
    result = verify_distributed(entry.step, engines=("ddp",), models=entry.models, max_examples=25, seed=0)
    message = result.message()
    assert result.fault is Fault.COLLECTIVE_MISMATCH and result.outcome is entry.expected, message
    dcase = result.counterexample
    assert dcase is not None and dcase.rank_micro_batch_sizes == ((1,), (1,)) and dcase.case.empty_samples, message
    # Named by the collective log (one rank's gradient all-reduce against its peer's next step), not a timeout.
    assert "mismatched collectives:" in message and "called all_reduce of shape" in message, message
    assert "did not finish within" not in message, message
    assert check_distributed(SEARCH_ZOO["global_item_count"].step, dcase, engine="ddp")  # the fix, on that split

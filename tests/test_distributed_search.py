"""The distributed search: bugs that need a split found without one picked by hand, shrunk.

Each drawn case spawns its ranks (a warm fork server: about 0.2 s a case), so
the searches here are short and seeded.
"""

import json
from pathlib import Path

import jsonschema
import pytest
from hypothesis import find, settings

import equiv
from equiv.checking.distributed_search import DistributedSearchSpace, verify_distributed
from equiv.cli import main
from equiv.distributed.engines import STEP_ENGINES
from equiv.outcomes import Fault, Outcome
from equiv.results.protocol import schema
from equiv.zoo.bugs import mean_of_means
from equiv.zoo.distributed_bugs import RAGGED_TOKEN_STEPS, local_mean_per_rank, local_mean_per_rank_fsdp2


@pytest.mark.distributed
def test_a_per_rank_mean_is_found_and_shrunk_to_two_ranks_holding_different_counts() -> None:
    # transformers #34242: each rank back-propagates its own mean and DDP averages the
    # ranks; exact only when every rank holds as many items as the others.
    result = verify_distributed(local_mean_per_rank, models=("mlp",), max_examples=25, seed=0)
    assert result.found and result.outcome is Outcome.NOT_EQUIVALENT, result.message()
    dcase = result.counterexample
    assert dcase is not None and dcase.world_size == 2
    held = [sum(sizes) for sizes in dcase.rank_micro_batch_sizes]
    assert held[0] != held[1], result.message()  # equal counts would hide it
    assert "Not equivalent to full-batch training" in result.message()
    assert (
        "Reproduce: equiv.check_distributed(local_mean_per_rank, equiv.DistributedCase.of(equiv.Case("
        in result.message()
    )
    assert not equiv.check_distributed(local_mean_per_rank, dcase)  # the shrunk case fails on its own


@pytest.mark.distributed
def test_ragged_real_tokens_show_a_per_rank_token_mean_with_equal_sample_counts() -> None:
    # torchtune PR #2980: the GA=1 shortcut is exact only when every rank contributed
    # the same number of tokens; padded sequences make them differ at equal sample counts.
    result = verify_distributed(local_mean_per_rank, models=("tokens",), max_examples=25, seed=0)
    assert result.found and result.outcome is Outcome.NOT_EQUIVALENT, result.message()
    assert result.counterexample is not None and result.counterexample.world_size == 2


@pytest.mark.distributed
def test_the_reference_accumulator_passes_every_drawn_split() -> None:
    # Both engines, sample-mean and padded-token models (ragged real tokens across ranks).
    result = verify_distributed(equiv.accumulator_step, engines=("ddp", "fsdp2"), max_examples=14, seed=0)
    assert not result.found and result.examples == 14, result.message()
    assert "no counterexample" in result.message()


@pytest.mark.distributed
def test_fsdp2_draws_are_searched_too() -> None:
    result = verify_distributed(local_mean_per_rank_fsdp2, engines=("fsdp2",), max_examples=15, seed=0)
    assert result.found and result.engine == "fsdp2", result.message()


@pytest.mark.slow
@pytest.mark.distributed
def test_a_hang_on_unequal_micro_batch_counts_does_not_hide_the_mismatch_equal_counts_show() -> None:
    # The textbook loop under DDP syncs every micro-batch: ranks holding different numbers
    # of micro-batches would wait on each other (the collective log names them at once,
    # DDP's gradient syncs and bucket rebuild included). Equal counts run, and show its real bug.
    result = verify_distributed(mean_of_means, models=("mlp",), max_examples=10, seed=0, timeout_s=5)
    assert result.found and result.outcome is Outcome.NOT_EQUIVALENT, result.message()
    dcase = result.counterexample
    assert dcase is not None and len({len(sizes) for sizes in dcase.rank_micro_batch_sizes}) == 1
    assert result.verdict is not None and not result.verdict and result.error is None
    also = result.also
    assert also is not None and also.fault is Fault.COLLECTIVE_MISMATCH, result.message()
    assert len({len(sizes) for sizes in also.counterexample.rank_micro_batch_sizes}) > 1
    message = result.message()
    assert "Not equivalent to full-batch training" in message
    assert "Also: ranks holding different numbers of micro-batches" in message
    written = result.to_dict()
    jsonschema.validate(written, schema())
    assert written["outcome"] == "not_equivalent" and written["also"]["fault"] == also.fault.value
    assert result.equal_counts_examples is not None and result.examples > result.equal_counts_examples


def test_equal_micro_batch_counts_draw_only_equal_counts() -> None:
    space = DistributedSearchSpace(engines=("ddp",), equal_micro_batch_counts=True)
    drawn = find(
        space.strategy(clipping=False),
        lambda case: len(case[0].rank_micro_batch_sizes[0]) > 1,
        settings=settings(database=None),
    )
    assert len({len(sizes) for sizes in drawn[0].rank_micro_batch_sizes}) == 1
    assert space.to_dict()["equal_micro_batch_counts"] is True


def test_bad_search_input_is_refused() -> None:
    with pytest.raises(ValueError, match="engines must be a non-empty subset"):
        verify_distributed(equiv.accumulator_step, engines=("pp",))
    with pytest.raises(ValueError, match="max_examples must be a positive integer, got 0"):
        verify_distributed(equiv.accumulator_step, max_examples=0)
    with pytest.raises(ValueError, match="max_world_size must be an integer of at least 2, got 1"):
        verify_distributed(equiv.accumulator_step, max_world_size=1)
    with pytest.raises(ValueError, match="models must be a non-empty subset"):
        verify_distributed(equiv.accumulator_step, models=("resnet",))


@pytest.mark.distributed
def test_the_search_runs_from_the_shell(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "found.json"
    code = main(
        [
            "verify-distributed",
            "equiv.zoo.distributed_bugs:local_mean_per_rank",
            "--models",
            "mlp",
            "--seed",
            "0",
            "--json",
            str(out),
        ]
    )
    assert code == 1  # a counterexample
    assert "counterexample, shrunk to 2 ranks" in capsys.readouterr().out
    found = json.loads(out.read_text())
    assert found["outcome"] == "not_equivalent" and len(found["counterexample"]["rank_micro_batch_sizes"]) == 2


def test_bad_search_flags_are_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify-distributed", "equiv:accumulator_step", "--engines", "pp"]) == 2
    assert f"engines must be a non-empty subset of {STEP_ENGINES}, got ('pp',)" in capsys.readouterr().err
    # The tensor-parallel plan cannot shard the token model's embedding: named, not run.
    assert main(["verify-distributed", "equiv:accumulator_step", "--engines", "tp"]) == 2
    assert "models must be a subset of ('mlp', 'moe')" in capsys.readouterr().err


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(RAGGED_TOKEN_STEPS))
def test_ragged_token_counts_across_ranks_part_the_shortcut_from_the_global_count(name: str) -> None:
    step, expected = RAGGED_TOKEN_STEPS[name]
    result = verify_distributed(step, models=("tokens",), max_examples=12, seed=0)
    if expected is Outcome.EQUIVALENT:
        assert not result.found and result.examples == 12, result.message()
    else:
        assert result.found and result.outcome is expected, result.message()


def _hooked_accumulator_step(model: object, optimizer: object, micro_batches: object, loss_fn: object) -> None:
    """The reference accumulator with the step's own DDP comm hook (the stock all-reduce)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    model.register_comm_hook(None, default_hooks.allreduce_hook)  # type: ignore[attr-defined]
    equiv.accumulator_step(model, optimizer, micro_batches, loss_fn)  # type: ignore[arg-type]


@pytest.mark.distributed
def test_the_steps_own_collectives_are_counted_apart_and_it_may_bring_a_comm_hook() -> None:
    token_case = equiv.Case(
        batch_size=1, micro_batch_sizes=(1,), model="token_mlp", loss="token_cross_entropy", steps=2
    )
    dcase = equiv.DistributedCase.of(token_case, [[1, 2], [3]])
    step, _ = RAGGED_TOKEN_STEPS["global_item_count"]
    verdict = equiv.check_distributed(step, dcase)
    assert verdict, verdict.message()
    # Its token count, all-reduced once per window; DDP's gradient sync once, counted apart.
    assert verdict.step_collectives_per_step() == [{"all_reduce": 1}, {"all_reduce": 1}]
    assert verdict.allreduces_per_step() == {1}
    assert "the step's own collectives (exact tier, most on any rank): step 1: all_reduce x1" in verdict.message()
    hooked = equiv.check_distributed(_hooked_accumulator_step, dcase)
    assert hooked and hooked.allreduces_per_step() == {1}, hooked.message()


@pytest.mark.distributed
def test_the_search_reads_the_witness_once_for_the_example_it_reports(monkeypatch: pytest.MonkeyPatch) -> None:
    # Every failing example a search shrinks through would pay one more launch of its ranks for a witness
    # nobody reads: it is deferred while the search shrinks, and read once for the counterexample reported.
    import equiv.checking.distributed as distributed

    read: list[int] = []
    original = distributed.rank_witnesses

    def counted(*args: object, **kwargs: object) -> object:
        read.append(1)
        return original(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(distributed, "rank_witnesses", counted)
    result = verify_distributed(local_mean_per_rank, models=("mlp",), max_examples=25, seed=0)
    assert result.found and result.verdict is not None, result.message()
    assert read == [1]
    failing = [rank for rank in result.verdict.ranks if not rank]
    assert failing and all(rank.witness is not None for rank in failing), result.message()
    assert result.verdict.failure_kind is not None and result.verdict.failure_kind.name == "per-rank mean"

"""The parallel engines as one table (equiv.distributed.engines): each engine one record,
read by the check, its argument checks, the verdict's wording and the search."""

import re
from pathlib import Path

import pytest

import equiv
from equiv.checking.distributed import DistributedCase, RankTier, check_distributed
from equiv.checking.distributed_search import MODELS, DistributedSearchSpace
from equiv.distributed import engines
from equiv.distributed.engines import DATA_PARALLEL_ENGINES, ENGINES, STEP_ENGINES, Engine, apply_ddp
from equiv.distributed.launcher import run_on_ranks

SOURCE = Path(equiv.__file__).parent
#: An engine name compared with a string, or tested for a substring: what the table replaces.
_STRING_TEST = re.compile(
    r"""engine\s*(==|!=)\s*["']|engine\s+(not\s+)?in\s+\(\s*["']|["'][\w+]+["']\s+in\s+\w*engine\b"""
)


def test_no_module_tests_an_engine_by_its_name() -> None:
    # Every engine-dependent choice is a lookup on its record, not a comparison with a name.
    found = [
        f"{path.relative_to(SOURCE)}:{number}: {line.strip()}"
        for path in sorted(SOURCE.rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), start=1)
        if _STRING_TEST.search(line) and not line.lstrip().startswith("#")
    ]
    assert found == []


def test_every_engine_is_one_record_the_search_can_draw_from() -> None:
    assert list(ENGINES) == [
        "ddp",
        "fsdp2",
        "tp",
        "fsdp2+tp",
        "cp",
        "fsdp2+cp",
        "deepspeed",
        "deepspeed-zero1",
        "pipeline",
    ]
    assert STEP_ENGINES == tuple(name for name in ENGINES if name != "pipeline")
    assert DATA_PARALLEL_ENGINES == ("ddp", "fsdp2", "deepspeed", "deepspeed-zero1")
    for name, record in ENGINES.items():
        assert record.name == name
        assert set(record.search_models or MODELS) <= set(MODELS)
        # A tensor- or context-parallel engine draws groups of at least 2 ranks; the others none.
        assert (record.search_group_ranks >= 2) == (record.group != "data")
        # A step engine wraps the model, alone (apply) or with its optimizer (DeepSpeed's initialize).
        assert record.runs_steps == bool(record.apply or record.wrap_optimizer)
    # The check's and the search's engine lists are the table's, not copies of it.
    assert equiv.checking.distributed.ENGINES is STEP_ENGINES
    assert equiv.checking.distributed_search.ENGINES is STEP_ENGINES


def test_the_search_refuses_models_an_engine_cannot_split_from_its_record() -> None:
    with pytest.raises(ValueError, match=r"engines 'cp' and 'fsdp2\+cp' split every sequence's positions"):
        DistributedSearchSpace(engines=("cp",), models=("mlp",))
    with pytest.raises(ValueError, match=r"engine 'fsdp2\+tp' shards nn.Linear pairs"):
        DistributedSearchSpace(engines=("fsdp2+tp",), models=("moe",))
    with pytest.raises(
        ValueError,
        match=r"engine must be one of \('ddp', 'fsdp2', 'tp', 'fsdp2\+tp', 'cp', "
        r"'fsdp2\+cp', 'deepspeed', 'deepspeed-zero1'\), got 'pipeline'",
    ):
        check_distributed(
            equiv.accumulator_step,
            DistributedCase.of(equiv.Case(batch_size=2, micro_batch_sizes=(2,)), [[1], [1]]),
            engine="pipeline",
        )


def _replicated(split: engines.Split) -> str:
    return f"replicated by a test engine ({split.world_size} ranks)"


@pytest.mark.distributed
def test_a_new_engine_is_one_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    # One record, and the check runs a step under it: its wrap sent to the ranks, its wording, its collective.
    monkeypatch.setitem(engines.ENGINES, "ddp-again", Engine("ddp-again", _replicated, (apply_ddp,), "all-reduce"))
    dcase = DistributedCase.of(
        equiv.Case(batch_size=1, micro_batch_sizes=(1,), model_kwargs={"hidden": (8,)}), [[1, 2], [2]]
    )
    returned: list[object] = []

    def launcher(*args: object, **options: object) -> list[object]:
        ranks = run_on_ranks(*args, **options)  # type: ignore[arg-type]
        returned.extend(ranks)
        return ranks

    verdict = check_distributed(equiv.accumulator_step, dcase, engine="ddp-again", launcher=launcher)
    verdict.assert_ok()
    assert verdict.allreduces_per_step() == {1}
    # Each rank returns a typed record per tier, not a dict with string keys.
    assert len(returned) == 2
    for rank in returned:
        assert isinstance(rank, dict) and set(rank) == {"exact", "noise"}
        for tier in rank.values():
            assert isinstance(tier, RankTier)
            assert tier.calls == (1, 1) and len(tier.bytes) == 2 and tier.units == 0  # two steps, one sync each
            assert len(tier.snapshots) == 3 and len(tier.own_calls) == 2  # before and after each step
    assert "2 ranks under replicated by a test engine (2 ranks)" in verdict.message()
    assert "engine='ddp-again'" in verdict.message()

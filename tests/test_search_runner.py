"""The one search runner (equiv.checking.search): found, hung, flaky, discarded,
decided from decide's answer and its Fault, never from an error's text."""

from __future__ import annotations

import pytest
from hypothesis import strategies as st

import equiv
from equiv.checking.distributed_search import DistributedSearchSpace, verify_distributed
from equiv.checking.search import DISCARD, Failure, SearchRun, run_search
from equiv.distributed.launcher import DistributedCheckError, RankState, fault_of
from equiv.outcomes import Fault


def test_a_failure_is_shrunk_to_the_smallest_example() -> None:
    seen: list[int] = []
    outcome = run_search(
        st.integers(0, 1000),
        lambda n: Failure(verdict=n) if n >= 10 else None,
        SearchRun(max_examples=100, seed=0, progress=lambda examples, _: seen.append(examples)),
    )
    assert outcome.found and outcome.example == 10 and outcome.failure == Failure(verdict=10)
    assert not outcome.hung and not outcome.flaky
    assert outcome.first_failure_at is not None and outcome.examples == len(seen) == seen[-1]


def test_nothing_found_and_discarded_examples_are_never_findings() -> None:
    outcome = run_search(st.integers(0, 10), lambda n: DISCARD if n % 2 else None, SearchRun(max_examples=20, seed=1))
    assert not outcome.found and outcome.example is None and outcome.first_failure_at is None
    everything_discarded = run_search(st.integers(), lambda n: DISCARD, SearchRun(max_examples=5, seed=1))
    assert not everything_discarded.found


@pytest.mark.parametrize("message", ["rank 1 hung (step 0)", "no words about it"])
def test_a_hung_step_ends_the_search_at_once_whatever_its_message(message: str) -> None:
    decided: list[int] = []

    def decide(n: int) -> Failure[None] | None:
        decided.append(n)
        return Failure(error=message, fault=Fault.HUNG) if n >= 10 else None

    outcome = run_search(st.integers(0, 1000), decide, SearchRun(max_examples=100, seed=0))
    assert outcome.hung and outcome.example == decided[-1] and outcome.examples == len(decided)
    assert outcome.failure is not None and outcome.failure.error == message


def test_a_raised_step_is_shrunk_even_when_its_message_says_hung() -> None:
    outcome = run_search(
        st.integers(0, 1000),
        lambda n: Failure(error="rank 0 hung ", fault=Fault.RAISED) if n >= 10 else None,
        SearchRun(max_examples=100, seed=0),
    )
    assert not outcome.hung and outcome.example == 10


def test_a_failure_that_does_not_reproduce_is_flaky() -> None:
    calls = [0]

    def decide(n: int) -> Failure[int] | None:
        calls[0] += 1
        return Failure(verdict=n) if calls[0] == 3 else None

    outcome = run_search(st.integers(0, 1000), decide, SearchRun(max_examples=50, seed=0))
    assert outcome.found and outcome.flaky


def test_a_blob_that_does_not_reproduce_names_the_search() -> None:
    with pytest.raises(ValueError, match="does not reproduce a failure of my step"):
        run_search(
            st.integers(), lambda n: None, SearchRun(max_examples=5, reproduce="AXicY2BgAAAABAAB"), name="my step"
        )


def _state(rank: int, **kw: object) -> RankState:
    return RankState(rank=rank, progress="step 0", **kw)  # type: ignore[arg-type]


def test_the_launcher_says_what_went_wrong_as_a_fault() -> None:
    assert (
        fault_of([_state(0, running=True), _state(1, mismatch="rank 1 called all_reduce")], hung=True)
        is Fault.COLLECTIVE_MISMATCH
    )
    assert fault_of([_state(0, error="Traceback"), _state(1, running=True)], hung=True) is Fault.HUNG
    assert fault_of([_state(0, error="Traceback"), _state(1, running=True)]) is Fault.RAISED
    assert fault_of([_state(0, death="exit code 7"), _state(1)]) is Fault.DIED
    assert (
        fault_of([_state(0, error="Connection closed", death="exit code 1"), _state(1, death="exit code 7")])
        is Fault.DIED
    )
    assert (
        fault_of([_state(0, error="Traceback", death="exit code 1"), _state(1, death="exit code 1", error="Traceback")])
        is Fault.RAISED
    )
    error = DistributedCheckError("rank 1 hung", Fault.HUNG)
    assert error.fault is Fault.HUNG and str(error) == "rank 1 hung"
    assert DistributedCheckError("rank 0 raised").fault is Fault.RAISED


def test_the_distributed_search_space_is_checked_when_made() -> None:
    space = DistributedSearchSpace(engines=["ddp", "fsdp2"], models=["mlp"], max_world_size=4)
    assert space.engines == ("ddp", "fsdp2") and space.models == ("mlp",)
    assert space.to_dict() == {
        "engines": ["ddp", "fsdp2"],
        "models": ["mlp"],
        "max_world_size": 4,
        "max_micro_batches": 3,
        "max_micro_batch_size": 4,
        "equal_micro_batch_counts": False,
        "optimizers": ["SGD", "Adam"],
    }
    with pytest.raises(ValueError, match="engines must be a non-empty subset"):
        DistributedSearchSpace(engines=("pp",))
    with pytest.raises(ValueError, match="models must be a subset of"):
        DistributedSearchSpace(engines=("tp",), models=("tokens",))
    with pytest.raises(TypeError, match="not both"):
        verify_distributed(equiv.accumulator_step, space, max_world_size=3)

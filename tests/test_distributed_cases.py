"""equiv.checking.distributed_cases: the distributed case loop the CLI runs, and the one
case a search judges, a rank fault kept as data (no ranks spawned: the launchers here fail)."""

import pytest

import equiv
from equiv.checking.distributed_cases import CaseLoop, RankFault, check_distributed_case, check_distributed_cases
from equiv.checking.distributed_search import standard_distributed_cases
from equiv.distributed.launcher import DistributedCheckError
from equiv.outcomes import Fault


def _failing(fault: Fault, on_call: int = 1) -> tuple[list[int], object]:
    """A launcher whose ranks fail with ``fault`` at its ``on_call``-th launch and raise before."""
    calls: list[int] = []

    def launch(task: object, world_size: int, **options: object) -> list[object]:
        calls.append(world_size)
        raise DistributedCheckError(f"rank 1 {fault.value} in step 0 (launch {len(calls)})", fault)

    return calls, launch


def test_one_case_returns_the_rank_fault_as_data() -> None:
    _, launch = _failing(Fault.DIED)
    dcase = standard_distributed_cases(2)["uneven shards, SGD"]
    outcome = check_distributed_case(equiv.accumulator_step, dcase, launcher=launch)  # type: ignore[arg-type]
    assert isinstance(outcome, RankFault)
    assert outcome.fault is Fault.DIED and outcome.error.startswith("rank 1 died in step 0")
    assert isinstance(outcome.cause, DistributedCheckError)


@pytest.mark.parametrize(
    ("fault", "stop_on_fault", "run"),
    [
        (Fault.RAISED, False, 6),  # a rank that raised: the next case runs on fresh ranks
        (Fault.RAISED, True, 1),  # under torchrun the process group may be left mid-collective
        (Fault.HUNG, False, 1),  # each case would wait out the timeout again
    ],
)
def test_the_loop_stops_after_a_hang_or_any_fault_when_asked(fault: Fault, stop_on_fault: bool, run: int) -> None:
    calls, launch = _failing(fault)
    cases = standard_distributed_cases(2)
    started: list[str] = []
    shown: list[str] = []
    result = check_distributed_cases(
        equiv.accumulator_step,
        cases,
        "the step",
        CaseLoop(launcher=launch, stop_on_fault=stop_on_fault),  # type: ignore[arg-type]
        starting=lambda index, name, dcase: started.append(name),
        shown=shown.append,
    )
    assert len(cases) == 6 and len(calls) == run and started == list(cases)[:run]
    assert set(result.faults) == set(list(cases)[:run]) and set(result.faults.values()) == {fault}
    assert set(result.not_run) == set(list(cases)[run:])
    assert result.setting == "on 2 ranks (ddp)"
    assert len(shown) == run + (run < len(cases))  # a row per case run, then why the rest were not
    assert not result
    first = next(iter(cases))
    if fault is Fault.HUNG:
        assert shown[-1] == (
            f"      the other 5 case(s) were not run: the step hung on {first!r}, and each would wait 120 s as long"
        )
        assert set(result.not_run.values()) == {f"the step hung on {first!r}"}
    elif stop_on_fault:
        assert (
            shown[-1]
            == "      the other 5 case(s) were not run: after a fault the ranks' process group may be left mid-collective"
        )
        assert set(result.not_run.values()) == {
            f"after the fault on {first!r} the ranks' process group may be left mid-collective"
        }


def test_the_distributed_case_is_a_case_and_its_verdict_a_result_at_their_old_paths_too() -> None:
    # The case sits with the cases (layer cases), the verdict with the results (layer results),
    # below the checker that imports them; the paths the docs name still reach the same classes.
    import equiv.checking.distributed as checking
    from equiv.cases.distributed import DistributedCase
    from equiv.layers import layer_of
    from equiv.results.distributed import DistributedVerdict

    assert DistributedCase.__module__ == "equiv.cases.distributed"
    assert DistributedVerdict.__module__ == "equiv.results.distributed"
    assert layer_of(DistributedCase.__module__) < layer_of(DistributedVerdict.__module__) < layer_of(checking.__name__)
    assert checking.DistributedCase is DistributedCase is equiv.DistributedCase
    assert checking.DistributedVerdict is DistributedVerdict

"""Every distributed verdict's ``Reproduce:`` line replays as printed: pasted where
``import equiv`` and the step are in scope, it calls ``equiv.check_distributed``
with the same case (its tensor-parallel degree included) and the same engine."""

from __future__ import annotations

from typing import Any

import pytest

import equiv
from equiv.checking.distributed import DistributedCase, DistributedVerdict, check_distributed
from equiv.checking.distributed_search import DistributedSearchResult
from equiv.results.verdict import Verdict
from equiv.zoo.tensor_parallel_bugs import clip_tp_shard_with_local_norm

MLP = equiv.Case(
    batch_size=1,
    micro_batch_sizes=(1,),
    model_kwargs={"hidden": (8,), "activation": "tanh"},
    steps=2,
    max_grad_norm=1e-2,
)
#: engine -> a case it runs: tensor parallel with one data rank, FSDP2 over TP with two, DDP / FSDP2 plain.
CASES = {
    "ddp": DistributedCase.of(MLP, [[1, 2], [3]]),
    "fsdp2": DistributedCase.of(MLP, [[1, 2], [3, 1]]),
    "tp": DistributedCase.of(MLP, [[1, 2]], tensor_parallel=2),
    "fsdp2+tp": DistributedCase.of(MLP, [[1, 2], [2, 1]], tensor_parallel=2),
}


def reproduce_line(message: str) -> str:
    return next(line for line in message.splitlines() if line.startswith("Reproduce: ")).removeprefix("Reproduce: ")


def replayed_call(line: str, step: Any, monkeypatch: pytest.MonkeyPatch) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """What the pasted line hands ``equiv.check_distributed`` (recorded, not run)."""
    calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
    monkeypatch.setattr(equiv, "check_distributed", lambda *args, **kwargs: calls.append((args, kwargs)))
    exec(f"import equiv\n{line}", {step.__name__: step})  # pasted after `import equiv` (its own imports too)
    assert len(calls) == 1, line
    return calls[0]


def _failing(dcase: DistributedCase, engine: str) -> DistributedVerdict:
    rank = Verdict(case=dcase.case, candidate="clip_tp_shard_with_local_norm", mismatches=())
    return DistributedVerdict(
        case=dcase, candidate="clip_tp_shard_with_local_norm", ranks=(rank,) * dcase.world_size, engine=engine
    )  # type: ignore[arg-type]


@pytest.mark.parametrize("engine", sorted(CASES))
def test_a_distributed_verdicts_reproduce_line_calls_the_same_case(
    engine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    dcase = CASES[engine]
    line = reproduce_line(_failing(dcase, engine).message())
    (step, replayed), kwargs = replayed_call(line, clip_tp_shard_with_local_norm, monkeypatch)
    assert step is clip_tp_shard_with_local_norm
    assert replayed == dcase and replayed.tensor_parallel == dcase.tensor_parallel, line
    assert kwargs.get("engine", "ddp") == engine


@pytest.mark.parametrize("engine", sorted(CASES))
def test_a_distributed_searchs_reproduce_line_calls_its_counterexample(
    engine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    dcase = CASES[engine]
    result = DistributedSearchResult(
        candidate="clip_tp_shard_with_local_norm",
        engines=(engine,),
        examples=3,
        seed=0,
        elapsed_s=1.0,
        counterexample=dcase,
        engine=engine,
        verdict=_failing(dcase, engine),
    )
    lines = [line for line in result.message().splitlines() if line.startswith("Reproduce: ")]
    assert len(lines) == 1, result.message()  # the search's own, not the verdict's as well
    (step, replayed), kwargs = replayed_call(
        lines[0].removeprefix("Reproduce: "), clip_tp_shard_with_local_norm, monkeypatch
    )
    assert step is clip_tp_shard_with_local_norm and replayed == dcase and kwargs["engine"] == engine


@pytest.mark.distributed
def test_a_failing_tensor_parallel_verdict_replays_to_the_same_verdict() -> None:
    verdict = check_distributed(clip_tp_shard_with_local_norm, CASES["tp"], engine="tp")
    assert not verdict, verdict.message()
    line = reproduce_line(verdict.message())
    assert "tensor_parallel=2" in line and "engine='tp'" in line, line
    namespace: dict[str, Any] = {"clip_tp_shard_with_local_norm": clip_tp_shard_with_local_norm, "equiv": equiv}
    exec(f"replayed = {line.split('; ')[-1]}" if "; " in line else f"replayed = {line}", namespace)
    replayed = namespace["replayed"]
    assert replayed.case == verdict.case and replayed.engine == "tp"
    assert replayed.status is verdict.status and replayed.outcome is verdict.outcome

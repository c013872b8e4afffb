"""Every front door's result is one :class:`equiv.Result`: an Outcome status that
agrees with its truth value, a message, one line, a ``to_dict()`` under the
versioned schema (equiv/results/schema.json, checked with jsonschema) and an
``assert_ok()`` that raises on a failure.  A class named like a result that is
not listed here fails :func:`test_every_result_class_is_listed`."""

from __future__ import annotations

import ast
import json
import re
import typing
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch

import equiv
from equiv.auditing.replay import AuditFailure, WindowAudit
from equiv.auditing.runs import nanogpt_run
from equiv.auditing.watch import Audit
from equiv.cases.pipeline import PipelineSetting
from equiv.checking.distributed import DistributedCase, DistributedVerdict
from equiv.checking.distributed_search import DistributedSearchResult
from equiv.checking.pipeline import PipelineVerdict
from equiv.checking.verify import VerifyResult
from equiv.cli import EXIT_CODES
from equiv.judging.trajectories import RunVerdict
from equiv.losses import LossOptions
from equiv.outcomes import Fault
from equiv.peers.results import Cell
from equiv.results.facts import VerdictFacts
from equiv.results.protocol import SCHEMA, EquivalenceError, Result, ResultBase, schema
from equiv.results.verdict import CaseVerdicts, TensorDiff, Verdict
from equiv.zoo.distributed_bugs import local_mean_per_rank

#: Every result kind a front door returns, and the kind's name in JSON.
KINDS: dict[type, str] = {
    Verdict: "verdict",
    CaseVerdicts: "case_verdicts",
    VerifyResult: "verify",
    DistributedVerdict: "distributed_verdict",
    DistributedSearchResult: "distributed_search",
    PipelineVerdict: "pipeline_verdict",
    WindowAudit: "window_audit",
    Audit: "audit",
    RunVerdict: "run_verdict",
}
#: Classes named like a result that are not one, and why.
NOT_RESULTS = {
    "WindowResult": "what Accumulator.step() did to one window (items, grad norm, stepped): no judgement",
    "PeersResults": "the peers survey's table as plain data for reports/peers.md; its cells map to Outcome (Cell.status)",
    "Result": "the protocol itself",
    "RankVerdict": "one rank's part of a WindowAudit in a multi-process run (WindowAudit.ranks), in its JSON",
    "AuditResult": "the result half of Audit (windows, counts, summary, to_dict): equiv.audit returns the Audit, "
    "its hooks on top, whose kind is 'audit'",
}

TOY = equiv.Case(
    batch_size=8,
    micro_batch_sizes=(1, 3, 4),
    model="scalar_linear",
    data="toy_2x",
    optimizer_kwargs={"lr": 0.02},
    steps=1,
)


def textbook(model: torch.nn.Module, optimizer: torch.optim.Optimizer, micro_batches: Any, loss_fn: Any) -> None:
    optimizer.zero_grad()
    for x, y in micro_batches:
        (loss_fn(model(x), y) / len(micro_batches)).backward()
    optimizer.step()


@pytest.fixture(scope="module")
def verdicts() -> dict[str, Verdict]:
    passing = equiv.check(equiv.accumulator_step, TOY)
    failing = equiv.check(textbook, TOY)
    # A clip norm the step cannot be told about: not applicable, nothing runs.
    not_applicable = equiv.check(textbook, TOY.replace(max_grad_norm=1.0))
    inherent = Verdict(TOY, "step", (), inherent=("Dropout layer '1' (p=0.5)",))
    return {"passing": passing, "failing": failing, "not_applicable": not_applicable, "inherent": inherent}


def _diff(ok: bool = True) -> TensorDiff:
    return TensorDiff(
        step=1,
        name="0.weight",
        quantity="update",
        tier="exact",
        dtype="torch.float64",
        max_abs_diff=1e-17 if ok else 0.5,
        index=(0, 1),
        max_rel_diff=0.1,
        rel_index=(0, 1),
        allowed=1e-15,
        explanation="32 x floor",
        mismatched=0 if ok else 3,
        numel=8,
        scale=1.0,
    )


def _results(verdicts: dict[str, Verdict]) -> list[tuple[str, Any]]:
    """(name, result) for every kind, passing and failing, built cheaply."""
    passing, failing = verdicts["passing"], verdicts["failing"]
    dcase = DistributedCase.of(TOY, [[1, 3], [4]])
    dpass = DistributedVerdict(dcase, "step", (passing, passing))
    dfail = DistributedVerdict(dcase, "step", (passing, failing))
    search: dict[str, Any] = dict(
        candidate="step", examples=3, seed=0, profile="dev", max_examples=5, blob=None, elapsed_s=1.0
    )
    setting = PipelineSetting(schedule="GPipe", scale_grads=False, loss="window_sum")
    window: dict[str, Any] = dict(step=0, micro_batches=2, items=(3, 5), tier="noise")
    return [
        *verdicts.items(),
        ("cases passing", CaseVerdicts("step", {"a": passing, "n/a": verdicts["not_applicable"]})),
        ("cases failing", CaseVerdicts("step", {"a": passing, "b": failing}, order=("a", "b"))),
        ("cases raised", CaseVerdicts("step", {"a": passing}, {"b": "ValueError: boom"}, ("a", "b"))),
        ("distributed cases", CaseVerdicts("step", {"a": dpass, "b": dfail}, setting="on 2 ranks (ddp)")),
        (
            "verify passing",
            VerifyResult(first_failure_at=None, counterexample=None, verdict=None, error=None, **search),
        ),
        ("verify failing", VerifyResult(first_failure_at=2, counterexample=TOY, verdict=failing, error=None, **search)),
        (
            "verify raised",
            VerifyResult(
                first_failure_at=1, counterexample=TOY, verdict=None, error="ValueError: boom\nmore", **search
            ),
        ),
        ("distributed passing", dpass),
        ("distributed failing", dfail),
        ("distributed search passing", DistributedSearchResult("step", ("ddp",), 4, 0, 1.0)),
        ("distributed search failing", DistributedSearchResult("step", ("ddp",), 4, 0, 1.0, dcase, "ddp", dfail)),
        (
            "distributed search raised",
            DistributedSearchResult(
                "step", ("ddp",), 4, 0, 1.0, dcase, "ddp", error="rank 1 raised", fault=Fault.RAISED
            ),
        ),
        (
            "distributed search hung",
            DistributedSearchResult(
                "step", ("ddp",), 4, 0, 1.0, dcase, "ddp", error="rank 0 hung at step 1", fault=Fault.HUNG
            ),
        ),
        ("pipeline passing", PipelineVerdict(setting, equiv.Outcome.EQUIVALENT, 0.25, "stage 0 'weight'")),
        ("pipeline failing", PipelineVerdict(setting, equiv.Outcome.NOT_EQUIVALENT, 1e6, "stage 0 'weight'")),
        ("pipeline raised", PipelineVerdict(setting, equiv.Outcome.STEP_ERROR, error="uneven chunks")),
        ("window passing", WindowAudit(mismatches=(), worst=_diff(), **window)),
        ("window failing", WindowAudit(mismatches=(_diff(ok=False),), worst=_diff(ok=False), **window)),
        ("window inherent", WindowAudit(mismatches=(), worst=None, inherent=("Dropout",), **window)),
        ("run passing", RunVerdict((_diff(),), (2, 2))),
        ("run failing", RunVerdict((_diff(ok=False),), (2, 2))),
    ]


def _check_protocol(result: Any) -> dict[str, Any]:
    assert isinstance(result, Result)
    assert isinstance(result.status, equiv.Outcome)
    assert bool(result) is (result.status is equiv.Outcome.EQUIVALENT)
    assert result.status in EXIT_CODES
    line = result.line()
    assert line and "\n" not in line
    assert result.message()
    data = result.to_dict()
    assert data["schema"] == SCHEMA and data["kind"] == KINDS[type(result)]
    assert data["status"] == result.status.value and data["line"] == line
    loaded = json.loads(json.dumps(data))
    jsonschema.validate(loaded, schema())
    if result:
        result.assert_ok()
    else:
        with pytest.raises(AssertionError) as raised:
            result.assert_ok()
        assert str(raised.value) == (result.failures[0] if isinstance(result, Audit) else result).message()
    return loaded


def test_every_kind_satisfies_the_protocol_and_its_json_the_schema(verdicts: dict[str, Verdict]) -> None:
    seen = set()
    for name, result in _results(verdicts):
        try:
            _check_protocol(result)
        except Exception as exc:
            raise AssertionError(f"{name}: {result.line()}") from exc
        seen.add(type(result))
    assert seen == set(KINDS) - {Audit}  # the audit is run for real below


def test_the_lines_start_with_the_outcome_and_say_how_far(verdicts: dict[str, Verdict]) -> None:
    passing, failing = verdicts["passing"].line(), verdicts["failing"].line()
    assert re.fullmatch(r"equivalent: accumulator_step on Case\(.*\), worst [0-9.e+-]+ of its allowance", passing), (
        passing
    )
    assert failing.startswith("not equivalent: textbook on Case(") and "of its scale" in failing, failing
    assert verdicts["not_applicable"].line().startswith("not applicable: textbook on Case(")
    assert verdicts["inherent"].line() == f"inherently non-equivalent: step on {TOY!r}: Dropout layer '1' (p=0.5)"


def test_a_failing_verdict_raises_equivalence_error_with_its_message(verdicts: dict[str, Verdict]) -> None:
    failing = verdicts["failing"]
    with pytest.raises(EquivalenceError) as raised:
        failing.assert_ok()
    assert str(raised.value) == failing.message() and raised.value.verdict is failing
    data = failing.to_dict()
    assert data["status"] == data["outcome"] == "not_equivalent" and data["mismatches"]


def test_a_real_audit_is_a_result_and_its_windows_too() -> None:
    watched = nanogpt_run(normalise_by_window_tokens=False)
    data = _check_protocol(watched)
    assert data["status"] == "not_equivalent" and len(data["windows"]) == len(watched.windows)
    assert [window["status"] for window in data["windows"]] == [w.status.value for w in watched.windows]
    with pytest.raises(AuditFailure) as raised:
        watched.assert_ok()
    assert raised.value.window is watched.failures[0]
    for window in watched.windows:
        _check_protocol(window)


@pytest.mark.distributed
def test_a_real_distributed_check_is_a_result() -> None:
    dcase = DistributedCase.of(equiv.Case(batch_size=4, micro_batch_sizes=(2, 2)), [[1], [3]])
    passing = equiv.check_distributed(equiv.accumulator_step, dcase)
    failing = equiv.check_distributed(local_mean_per_rank, dcase)
    assert _check_protocol(passing)["status"] == "equivalent"
    data = _check_protocol(failing)
    assert data["status"] == "not_equivalent" and len(data["ranks"]) == 2
    assert failing.line().startswith("not equivalent: local_mean_per_rank on 2 ranks (ddp), DistributedCase.of(")


def test_the_schema_names_every_kind_and_outcome() -> None:
    loaded = schema()
    assert loaded["version"] == SCHEMA == loaded["properties"]["schema"]["const"]
    assert set(loaded["properties"]["kind"]["enum"]) == set(KINDS.values())
    assert loaded["$defs"]["outcome"]["enum"] == [outcome.value for outcome in equiv.Outcome]
    jsonschema.Draft202012Validator.check_schema(loaded)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"schema": SCHEMA, "kind": "verdict", "status": "fine", "line": ""}, loaded)
    # Shipped as package data beside the module that reads it.
    assert (Path(equiv.__file__).parent / "results" / "schema.json").is_file()


def test_every_outcome_has_a_label_a_description_and_an_exit_code() -> None:
    for outcome in equiv.Outcome:
        assert outcome.label and outcome.description and outcome in EXIT_CODES
    assert equiv.Outcome.NOT_EQUIVALENT.label == "not equivalent"


def _result_like_classes() -> set[str]:
    """Every public class in equiv named like a result (…Verdict(s), …Result(s), …Audit(s))."""
    names = set()
    for path in Path(equiv.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.ClassDef)
                and not node.name.startswith("_")
                and re.search(r"(Verdicts?|Results?|Audits?)$", node.name)
            ):
                names.add(node.name)
    return names


def test_every_result_class_is_listed() -> None:
    # A new result kind must be added to KINDS (and so to the protocol and the schema), or said not to be one.
    listed = {kind.__name__ for kind in KINDS} | set(NOT_RESULTS)
    assert _result_like_classes() == listed
    for kind, name in KINDS.items():
        assert issubclass(kind, ResultBase) and kind.KIND == name


def _classes(annotation: Any) -> set[type]:
    """The classes a return annotation names (a union's members)."""
    if isinstance(annotation, type):
        return {annotation}
    return {cls for arg in typing.get_args(annotation) for cls in _classes(arg)}


@pytest.mark.parametrize(
    "front_door",
    [equiv.check, equiv.verify, equiv.check_distributed, equiv.verify_distributed, equiv.check_pipeline, equiv.audit],
    ids=lambda f: f.__name__,
)
def test_every_front_door_returns_a_listed_kind(front_door: Any) -> None:
    returned = _classes(typing.get_type_hints(front_door)["return"])
    assert returned and returned <= set(KINDS), returned


def test_the_old_kind_reads_as_each_new_name(verdicts: dict[str, Verdict]) -> None:
    # issue 43, item 4: .outcome, .quantity, .family and .failure are the names; .kind, kept for code
    # written before them, reads the same on every result, and the JSON keys are unchanged.
    with_outcome = [(name, r) for name, r in _results(verdicts) if hasattr(type(r), "outcome")]
    assert {name for name, _ in with_outcome} >= {"failing", "verify failing", "distributed failing"}
    for name, result in with_outcome:
        assert result.kind is result.outcome, name
    assert verdicts["failing"].outcome is equiv.Outcome.NOT_EQUIVALENT
    facts = VerdictFacts.of(verdicts["failing"])
    assert facts.kind is facts.outcome and facts.to_dict()["kind"] is facts.outcome
    diff = _diff(ok=False)
    assert diff.kind == diff.quantity == "update" and diff.to_dict()["kind"] == "update"
    options = LossOptions("mse", "MSELoss()")
    assert options.kind == options.family == "mse"
    cell = Cell("not equivalent", failure="mean of means")
    assert cell.kind == cell.failure and cell.to_dict()["kind"] == "mean of means" and "failure" not in cell.to_dict()
    assert Cell.from_dict(cell.to_dict()) == cell

"""`equiv check`: exit codes 0 (equivalent), 1 (mismatch), 2 (usage or import error)."""

import json
from pathlib import Path

import jsonschema
import pytest

from equiv.cases.standard import STANDARD_CASES
from equiv.cli import main
from equiv.results.protocol import schema

STEPS = '''
import equiv

def reference(model, optimizer, micro_batches, loss_fn, max_grad_norm=None, scheduler=None, grad_scaler=None):
    equiv.accumulator_step(model, optimizer, micro_batches, loss_fn, max_grad_norm=max_grad_norm, scheduler=scheduler,
                           grad_scaler=grad_scaler)

def weighted(model, optimizer, micro_batches, loss_fn):
    """Correct, and takes no max_grad_norm: the clipping case does not apply to it."""
    optimizer.zero_grad()
    total = sum(loss_fn.count(y) for _, y in micro_batches)
    for x, y in micro_batches:
        (loss_fn.sum(model(x), y) / total).backward()
    optimizer.step()

def two_arguments(model, optimizer):
    pass

def textbook(model, optimizer, micro_batches, loss_fn):
    optimizer.zero_grad()
    for x, y in micro_batches:
        (loss_fn(model(x), y) / len(micro_batches)).backward()
    optimizer.step()

NOT_CALLABLE = 3
'''


def test_reference_passes_all_standard_cases(steps_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", f"{steps_file}:reference"]) == 0
    count = len(STANDARD_CASES)
    assert f"{count} equivalent, 0 not equivalent, of {count} case(s)" in capsys.readouterr().out


def test_textbook_loop_fails_uneven_cases_and_writes_json(
    steps_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "verdicts.json"
    assert main(["check", f"{steps_file}:textbook", "--json", str(out)]) == 1
    text = capsys.readouterr().out
    assert "FAIL  toy 2.04, uneven 1+3+4" in text and "ok    toy 2.04, 4 x 2" in text
    written = json.loads(out.read_text())
    jsonschema.validate(written, schema())  # the result's to_dict(), under the versioned schema
    assert (written["kind"], written["status"]) == ("case_verdicts", "not_equivalent")
    verdicts = {row["case_name"]: row["status"] for row in written["cases"]}
    assert verdicts["SGD momentum, even 4 x 4"] == "equivalent"
    assert verdicts["SGD momentum, uneven 1+5+10"] == "not_equivalent"


def test_a_correct_step_that_does_not_clip_passes_with_clipping_not_applicable(
    steps_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "verdicts.json"
    assert main(["check", f"{steps_file}:weighted", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "n/a   SGD, active clipping 3+5: weighted takes no max_grad_norm (the case sets max_grad_norm=0.05)" in text
    assert "FAIL" not in text
    statuses = {row["case_name"]: row["status"] for row in json.loads(out.read_text())["cases"]}
    not_applicable = sorted(name for name, status in statuses.items() if status == "not_applicable")
    equivalent = sum(status == "equivalent" for status in statuses.values())
    assert "SGD, active clipping 3+5" in not_applicable
    assert (
        f"{equivalent} equivalent, 0 not equivalent, {len(not_applicable)} not applicable, of {len(statuses)} case(s)"
        in text
    )


def test_a_step_that_cannot_take_the_contract_is_a_usage_error(
    steps_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["check", f"{steps_file}:two_arguments"]) == 2
    assert "cannot be called as step(model, optimizer, micro_batches, loss_fn)" in capsys.readouterr().err


def test_one_case_as_json(steps_file: Path) -> None:
    case = '{"batch_size": 4, "micro_batch_sizes": [2, 2]}'
    assert main(["check", f"{steps_file}:textbook", "--case", case]) == 0


@pytest.mark.parametrize(
    ("target", "extra", "message"),
    [
        ("no_such_module_xyz:step", [], "could not import 'no_such_module_xyz'"),
        ("{file}:missing", [], "has no attribute 'missing'"),
        ("{file}:NOT_CALLABLE", [], "is a int, not a callable step"),
        ("{file}", [], "expected MODULE:FUNC or path/to/file.py:FUNC"),
        ("nowhere/steps.py:step", [], "no such file 'nowhere/steps.py'"),
        ("{file}:textbook", ["--case", "{not json"], "--case is not valid JSON"),
        (
            "{file}:textbook",
            ["--case", '{"batch_size": 3, "micro_batch_sizes": [1]}'],
            "add up to 1, but batch_size is 3",
        ),
    ],
    ids=["bad_module", "missing_attr", "not_callable", "no_colon", "no_file", "bad_json", "bad_case"],
)
def test_usage_errors_exit_2_with_a_message(
    steps_file: Path, target: str, extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["check", target.format(file=steps_file), *extra]) == 2
    assert message in capsys.readouterr().err


def test_loading_a_target_leaves_sys_path_as_it_was(
    steps_file: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import sys

    from equiv.cli import load_target

    before = list(sys.path)
    load_target(f"{steps_file}:textbook")
    assert sys.path == before
    (tmp_path / "module_target_xyz.py").write_text(STEPS)
    monkeypatch.chdir(tmp_path)
    load_target("module_target_xyz:textbook")
    assert sys.path == before
    sys.modules.pop("module_target_xyz", None)

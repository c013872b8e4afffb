"""``--format github`` (workflow annotations on the step's definition) and ``--format json`` (issue 36)."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

import equiv
from equiv.cli import EXIT_COUNTEREXAMPLE, EXIT_EQUIVALENT, EXIT_STEP_FAILED, main
from equiv.results.annotations import escape_data, escape_property, step_location
from equiv.results.protocol import schema

STEPS = """import equiv


def textbook(model, optimizer, micro_batches, loss_fn):
    optimizer.zero_grad()
    for x, y in micro_batches:
        (loss_fn(model(x), y) / len(micro_batches)).backward()
    optimizer.step()


def raises(model, optimizer, micro_batches, loss_fn):
    raise RuntimeError("my step is broken")


def reference(model, optimizer, micro_batches, loss_fn):
    equiv.accumulator_step(model, optimizer, micro_batches, loss_fn)
"""
UNEVEN = '{"batch_size": 8, "micro_batch_sizes": [1, 3, 4], "model": "scalar_linear", "data": "toy_2x", "steps": 1}'


@pytest.fixture
def steps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The steps file in a folder that is also the working directory (a repository's root in CI)."""
    (tmp_path / "ci_steps.py").write_text(STEPS)
    monkeypatch.chdir(tmp_path)
    return tmp_path / "ci_steps.py"


def _line_of(name: str) -> int:
    return STEPS.splitlines().index(f"def {name}(model, optimizer, micro_batches, loss_fn):") + 1


def _commands(out: str, kind: str) -> list[tuple[dict[str, str], str]]:
    """The ``::kind prop=v,...::message`` lines of ``out``, properties and message unescaped."""
    found = []
    for line in out.splitlines():
        if line.startswith(f"::{kind} "):
            head, _, message = line[len(kind) + 3 :].partition("::")
            properties = dict(item.split("=", 1) for item in head.split(","))
            unescape = {"%3A": ":", "%2C": ",", "%0A": "\n", "%0D": "\r", "%25": "%"}
            for key, value in [*properties.items(), ("", message)]:
                for code, char in unescape.items():
                    value = value.replace(code, char)
                if key:
                    properties[key] = value
                else:
                    message = value
            found.append((properties, message))
    return found


def test_a_failing_check_annotates_the_steps_definition_line(steps: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "ci_steps.py:textbook", "--format", "github"]) == EXIT_COUNTEREXAMPLE
    out = capsys.readouterr().out
    errors = _commands(out, "error")
    fails = [line for line in out.splitlines() if line.startswith("FAIL  ")]
    assert fails and len(errors) == len(fails)  # one per failing verdict, the text kept above them
    for (properties, message), row in zip(errors, fails, strict=True):
        assert properties["file"] == "ci_steps.py" and properties["line"] == str(_line_of("textbook"))
        # The kind of failure named where the classifier knows it: the textbook loop's mean of means.
        assert properties["title"] == f"equiv check: not equivalent (mean of means): {row.removeprefix('FAIL  ')}"
        assert message.startswith("Not equivalent to full-batch training (candidate textbook).\n")
    assert not _commands(out, "notice")


def test_a_step_that_raises_is_annotated_as_a_step_error(steps: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "ci_steps.py:raises", "--case", UNEVEN, "--format", "github"]) == EXIT_STEP_FAILED
    [(properties, message)] = _commands(capsys.readouterr().out, "error")
    assert properties["title"] == "equiv check: step error (raised): --case"
    assert properties["line"] == str(_line_of("raises")) and "my step is broken" in message


def test_a_pass_is_one_notice(steps: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "ci_steps.py:reference", "--case", UNEVEN, "--format", "github"]) == EXIT_EQUIVALENT
    out = capsys.readouterr().out
    assert not _commands(out, "error")
    [(properties, message)] = _commands(out, "notice")
    assert properties["file"] == "ci_steps.py" and message.startswith("equivalent: reference on 1 case(s)")


def test_a_search_annotates_its_counterexample(steps: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["verify", "ci_steps.py:textbook", "--seed", "0", "--max-examples", "20", "--format", "github"]
    assert main(argv) == EXIT_COUNTEREXAMPLE
    [(properties, message)] = _commands(capsys.readouterr().out, "error")
    assert properties["title"] == "equiv verify: not equivalent" and properties["line"] == str(_line_of("textbook"))
    assert "shrunk to:" in message and "equiv check ci_steps.py:textbook --case" in message


def test_format_json_prints_the_result_alone_on_stdout(steps: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "ci_steps.py:textbook", "--case", UNEVEN, "--format", "json"]) == EXIT_COUNTEREXAMPLE
    captured = capsys.readouterr()
    written = json.loads(captured.out)  # nothing else on stdout
    jsonschema.validate(written, schema())
    assert (written["kind"], written["status"]) == ("case_verdicts", "not_equivalent")
    assert "FAIL  --case" in captured.err  # the progress rows moved to stderr


def test_escaping_follows_the_runners_parser() -> None:
    assert escape_data("50% off\r\nnext: a, b") == "50%25 off%0D%0Anext: a, b"
    assert escape_property("equiv check: a, b\n") == "equiv check%3A a%2C b%0A"


def _plain(model: Any, optimizer: Any, micro_batches: Any, loss_fn: Any) -> None:
    equiv.accumulator_step(model, optimizer, micro_batches, loss_fn)


class _Callable:
    def __call__(self, model: Any, optimizer: Any, micro_batches: Any, loss_fn: Any) -> None:
        _plain(model, optimizer, micro_batches, loss_fn)


def test_step_location_finds_functions_wrapped_steps_and_callable_objects(tmp_path: Path) -> None:
    here = Path(__file__).resolve()
    wrapped = functools.wraps(_plain)(lambda *args: _plain(*args))
    line = (
        here.read_text()
        .splitlines()
        .index("def _plain(model: Any, optimizer: Any, micro_batches: Any, loss_fn: Any) -> None:")
        + 1
    )
    assert step_location(_plain, cwd=str(here.parent)) == (here.name, line)
    assert step_location(wrapped, cwd=str(here.parent)) == (here.name, line)
    assert step_location(_plain, cwd=str(tmp_path)) == (str(here), line)  # outside the folder: absolute
    file, _ = step_location(_Callable(), cwd=str(here.parent.parent)) or ("", 0)
    assert file == f"{here.parent.name}/{here.name}"
    assert step_location(print) is None  # a built-in: no file to point at

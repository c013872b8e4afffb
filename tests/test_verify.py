"""equiv verify: the command line and the Python API, on tiny searches."""

import json
from pathlib import Path

import pytest
from hypothesis.errors import InvalidArgument

import equiv
from equiv.checking.search_space import SearchSpace
from equiv.checking.verify import verify
from equiv.cli import main
from equiv.zoo.bugs import mean_of_means

STEPS = """
from equiv import accumulator_step as good
from equiv.zoo.bugs import mean_of_means as bad

def crashes(model, optimizer, micro_batches, loss_fn):
    raise RuntimeError("boom")

_calls = [0]

def keeps_state(model, optimizer, micro_batches, loss_fn):
    # Correct for its first six calls, then scales every gradient: state kept across calls.
    _calls[0] += 1
    scale = 1.0 if _calls[0] <= 6 else 1.5
    optimizer.zero_grad()
    total = sum(len(y) for _, y in micro_batches)
    for x, y in micro_batches:
        (loss_fn(model(x), y) * (len(y) / total) * scale).backward()
    optimizer.step()

def float32_weights(model, optimizer, micro_batches, loss_fn):
    # Mathematically the full-batch step, but the weights are float32 (int / int tensor division).
    import torch
    optimizer.zero_grad()
    total = torch.tensor(sum(len(y) for _, y in micro_batches))
    for x, y in micro_batches:
        (loss_fn(model(x), y) * (torch.tensor(len(y)) / total)).backward()
    optimizer.step()
"""

#: Few examples, one small family: these test the plumbing, not the search.
FAST = ["--max-examples", "15", "--seed", "1", "--families", "mlp", "--optimizers", "SGD,Adam"]


def test_verify_exits_0_and_says_no_counterexample_for_the_reference(steps_file, capsys) -> None:
    assert main(["verify", f"{steps_file}:good", *FAST]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("no counterexample in 15 cases")
    assert "cases checked" in err  # progress on stderr


def test_verify_exits_1_with_the_shrunk_counterexample_and_how_to_replay(steps_file, tmp_path, capsys) -> None:
    report = tmp_path / "result.json"
    assert main(["verify", f"{steps_file}:bad", *FAST, "--json", str(report)]) == 1
    out = capsys.readouterr().out
    assert "counterexample after" in out
    assert "micro_batch_sizes=(1, 2)" in out  # mean of means needs two uneven pieces
    assert "Diverged at step 1 of 2" in out
    assert "allowed" in out
    assert f"equiv verify {steps_file}:bad --seed 1 --max-examples 15" in out
    assert "--reproduce " in out
    data = json.loads(report.read_text())
    assert data["found"] is True
    assert data["counterexample"]["micro_batch_sizes"] == [1, 2]
    assert data["verdict"]["status"] == "not_equivalent"
    # The printed case replays through `equiv check --case`.
    case_json = json.dumps(data["counterexample"])
    assert main(["check", f"{steps_file}:bad", "--case", case_json]) == 1


@pytest.mark.slow
def test_the_printed_blob_replays_the_shrunk_case(steps_file, capsys) -> None:
    result = verify(mean_of_means, SearchSpace(families=("mlp",), optimizers=("SGD", "Adam")), max_examples=15, seed=1)
    assert result.blob is not None
    replayed = verify(mean_of_means, SearchSpace(families=("mlp",), optimizers=("SGD", "Adam")), reproduce=result.blob)
    assert replayed.counterexample == result.counterexample


@pytest.mark.slow
def test_the_printed_reproduce_line_replays_quietly_and_names_the_original_search(steps_file, capsys) -> None:
    assert main(["verify", f"{steps_file}:bad", *FAST]) == 1
    printed = capsys.readouterr().out
    search = next(line for line in printed.splitlines() if "this search:" in line).split("this search: ")[1]
    draw = next(line for line in printed.splitlines() if "shrunk draw:" in line).split("shrunk draw: ")[1]
    assert "--seed 1 --max-examples 15" in draw
    assert main(draw.split()[1:]) == 1
    replayed = capsys.readouterr().out
    assert "Falsifying example" not in replayed  # Hypothesis's own dump of its internals
    assert f"this search: {search}" in replayed  # the original search, not the profile's defaults


@pytest.mark.slow
def test_verify_reports_a_candidate_that_raises_with_its_own_exit_code(steps_file, capsys) -> None:
    # 3: the step raised (not 1, a counterexample): CI can tell a broken step from a mismatch.
    assert main(["verify", f"{steps_file}:crashes", *FAST]) == 3
    out = capsys.readouterr().out
    assert "The candidate raised: candidate crashes raised RuntimeError: boom" in out


@pytest.mark.parametrize(
    ("target", "extra", "message"),
    [
        pytest.param("no_such_module_xyz:step", [], "could not import 'no_such_module_xyz'", id="bad-import"),
        pytest.param("{file}:missing", [], "has no attribute 'missing'", id="missing-function"),
        pytest.param("{file}:good", ["--families", "resnet"], "families has unknown ['resnet']", id="bad-family"),
        pytest.param("{file}:good", ["--profile", "nightly"], "unknown Hypothesis profile 'nightly'", id="bad-profile"),
    ],
)
def test_verify_exits_2_on_usage_errors(steps_file, capsys, target, extra, message) -> None:
    assert main(["verify", target.format(file=steps_file), *extra]) == 2
    assert message in capsys.readouterr().err


def test_verify_api_is_deterministic_for_a_seed() -> None:
    one = verify(equiv.accumulator_step, SearchSpace(families=("mlp",)), max_examples=5, seed=3)
    two = verify(equiv.accumulator_step, SearchSpace(families=("mlp",)), max_examples=5, seed=3)
    assert one and two
    assert one.examples == two.examples == 5
    assert one.worst_ratio == two.worst_ratio
    assert one.equivalent_cases == two.equivalent_cases
    assert sum(one.equivalent_cases.values()) == 5
    assert all(0 <= ratio < 1 for ratio in one.worst_ratio.values())


def test_verify_counts_inherent_cases_instead_of_failing_them() -> None:
    result = verify(
        equiv.accumulator_step, SearchSpace(families=("mlp",), allow_inherent=True), max_examples=20, seed=0
    )
    assert result
    assert result.inherent_cases > 0
    assert any("BatchNorm" in reason or "Dropout" in reason for reason in result.inherent_reasons)


@pytest.mark.slow
def test_report_tables_of_a_search_are_sorted_and_formatted() -> None:
    from equiv.findings.equivalence import bug_zoo_table, equivalent_cases_table
    from equiv.reporting.markdown import markdown_table, read_markdown_table

    found = verify(mean_of_means, SearchSpace(families=("mlp",), optimizers=("SGD",)), max_examples=15, seed=1)
    rows = read_markdown_table(markdown_table(bug_zoo_table({"mean_of_means": found, "a_bug": found})))
    assert [row["bug"] for row in rows] == ["`a_bug`", "`mean_of_means`"]
    assert all(row["found"] == "yes" and "micro_batch_sizes=(1, 2)" in row["shrunk case"] for row in rows)
    assert all(row["first divergence"].startswith("step 1, exact, the update of") for row in rows)
    assert all(row["first divergence"].endswith("of its scale") and "~1e" in row["first divergence"] for row in rows)
    counts = equivalent_cases_table({"mlp / SGD": 12, "gru / Adam": 3})
    assert list(counts.columns) == ["model family", "Adam", "SGD"]
    assert counts.to_dict("records") == [
        {"model family": "gru", "Adam": "3", "SGD": "-"},
        {"model family": "mlp", "Adam": "-", "SGD": "12"},
    ]


def test_a_step_without_a_clip_keyword_is_not_searched_with_clipping() -> None:
    def no_clip(model, optimizer, micro_batches, loss_fn):
        equiv.accumulator_step(model, optimizer, micro_batches, loss_fn)

    result = verify(no_clip, SearchSpace(families=("mlp",)), max_examples=20, seed=2)
    assert result, result.message()


def test_a_step_that_fails_only_once_is_reported_as_flaky() -> None:
    calls = []

    def fails_on_its_first_step(model, optimizer, micro_batches, loss_fn):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("first call")
        equiv.accumulator_step(model, optimizer, micro_batches, loss_fn)

    result = verify(fails_on_its_first_step, SearchSpace(families=("mlp",)), max_examples=10, seed=0)
    assert result.found and result.flaky
    assert "fails_on_its_first_step raised RuntimeError: first call" in result.error
    assert "not deterministic" in result.message()


@pytest.mark.slow
def test_a_step_that_keeps_state_across_calls_is_told_so_with_a_replay_that_reproduces(
    steps_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["verify", f"{steps_file}:keeps_state", *FAST]) == 1
    out = capsys.readouterr().out
    assert "fails only after earlier calls: your step keeps state across calls" in out
    # The one-case replays would pass in a fresh process: only the search is offered.
    assert "this case:" not in out and "--reproduce" not in out and "Reproduce: equiv.check" not in out
    assert f"this search: equiv verify {steps_file}:keeps_state --seed 1 --max-examples 15" in out


def test_a_float32_computation_inside_the_float64_run_is_a_precision_finding_for_float64_training(
    steps_file: Path,
) -> None:
    from equiv.judging.contract import load_candidate

    step = load_candidate(f"{steps_file}:float32_weights")
    space = SearchSpace(families=("mlp",), optimizers=("SGD", "Adam"))
    passing = verify(step, space, max_examples=20, seed=1, replay_in_fresh_process=False)
    assert passing and passing.precision_notes > 0, passing.message()
    result = verify(step, space, max_examples=20, seed=1, replay_in_fresh_process=False, train_dtype="float64")
    assert result.outcome == "precision", result.message()
    assert result.verdict is not None and {d.tier for d in result.verdict.mismatches} == {"exact"}
    assert result.message().startswith("precision finding after")
    assert "float32-sized differences inside the float64 run" in result.message()


def test_a_mathematical_difference_below_float32_rounding_is_a_note_not_blamed_on_the_default_dtype() -> None:
    from equiv.zoo.bugs import unscaled_sum

    # An unscaled sum under Adam with active clipping: the clip normalises the sum away but for its
    # epsilon, a difference float32 training cannot see (the float32 tier matched).  It stays in
    # float64 with the default dtype set to float64, so it is not blamed on a default-dtype tensor.
    case = equiv.Case(
        batch_size=4,
        micro_batch_sizes=(2, 2),
        model_kwargs={"hidden": (8,)},
        optimizer="Adam",
        optimizer_kwargs={"lr": 1e-2},
        max_grad_norm=1e-3,
    )
    verdict = equiv.check(unscaled_sum, case)
    assert verdict.status == "equivalent" and verdict.precision is not None
    assert verdict.precision.cause == "float32_sized"
    assert "or a difference smaller than float32 rounding can show" in (verdict.precision_note or "")
    assert equiv.check(unscaled_sum, case, strict=True).outcome == "precision"
    # Without the clip it is N x the gradient, far past float32 rounding: a mismatch.
    assert equiv.check(unscaled_sum, case.replace(optimizer="SGD", max_grad_norm=None)).outcome == "not_equivalent"


@pytest.mark.parametrize("blob", ["notablob", "AXicY2BgZGBkAAAAJgAF"], ids=["garbage", "truncated"])
def test_a_blob_that_does_not_reproduce_is_a_usage_error_without_a_traceback(
    steps_file: Path, blob: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["verify", f"{steps_file}:good", "--reproduce", blob]) == 2
    err = capsys.readouterr().err
    assert f"the blob {blob[:24]}... does not reproduce a failure of accumulator_step" in err
    assert "Traceback" not in err


def test_a_valid_blob_of_another_step_does_not_reproduce(steps_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    found = verify(
        mean_of_means,
        SearchSpace(families=("mlp",), optimizers=("SGD", "Adam")),
        max_examples=15,
        seed=1,
        replay_in_fresh_process=False,
    )
    assert found.blob is not None
    assert (
        main(
            ["verify", f"{steps_file}:good", "--reproduce", found.blob, "--families", "mlp", "--optimizers", "SGD,Adam"]
        )
        == 2
    )
    assert "DidNotReproduce" in capsys.readouterr().err


def test_torch_warnings_are_shown_once_per_search() -> None:
    import warnings

    def warns(model, optimizer, micro_batches, loss_fn):  # type: ignore[no-untyped-def]
        warnings.warn("the same warning every call", UserWarning, stacklevel=1)
        equiv.accumulator_step(model, optimizer, micro_batches, loss_fn)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = verify(warns, SearchSpace(families=("mlp",)), max_examples=5, seed=0)
    assert result.examples >= 5
    mine = [w for w in caught if "the same warning every call" in str(w.message)]
    assert len(mine) == 1 and "shown once" in str(mine[0].message)


def test_the_search_bounds_come_from_the_command_line(steps_file: Path, tmp_path: Path) -> None:
    report = tmp_path / "result.json"
    assert (
        main(
            [
                "verify",
                f"{steps_file}:good",
                "--max-examples",
                "10",
                "--seed",
                "3",
                "--families",
                "mlp",
                "--max-batch-size",
                "6",
                "--max-micro-batches",
                "3",
                "--json",
                str(report),
            ]
        )
        == 0
    )
    search = json.loads(report.read_text())["search"]
    assert (search["max_batch_size"], search["max_micro_batches"]) == (6, 3)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        # Refused by argparse, naming the flag (exit 2 as SystemExit); the bound check below by the search.
        (["--max-micro-batches", "0"], "argument --max-micro-batches: expected a whole number >= 1, got 0"),
        (["--max-batch-size", "-3"], "argument --max-batch-size: expected a whole number >= 1, got -3"),
        (
            ["--max-batch-size", "4", "--max-micro-batches", "6"],
            "max_micro_batches=6 is more than max_batch_size=4: every micro-batch needs a sample",
        ),
    ],
    ids=["zero", "negative", "more-pieces-than-samples"],
)
def test_a_bad_search_bound_is_a_usage_error(
    steps_file: Path, capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    try:
        code = main(["verify", f"{steps_file}:good", *flags])
    except SystemExit as exited:
        code = int(exited.code or 0)
    assert code == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err


def test_a_search_bound_alone_keeps_the_other_default() -> None:
    # A batch bound below the default 32 micro-batches caps the count; no error.
    result = verify(equiv.accumulator_step, SearchSpace(families=("mlp",), max_batch_size=6), max_examples=5, seed=0)
    assert result, result.message()
    assert result.search.max_batch_size == 6 and result.search.max_micro_batches is None


def test_a_search_space_is_its_own_flags_and_json() -> None:
    from dataclasses import fields

    from equiv.cli import build_parser

    space = SearchSpace(
        families=("mlp", "gru"),
        optimizers=("AdamW",),
        losses=("token_cross_entropy",),
        item_weighted=True,
        allow_inherent=True,
        max_batch_size=9,
        max_micro_batches=4,
    )
    flags = " ".join(space.flags()).split()
    args = build_parser().parse_args(["verify", "x.py:step", *flags])
    assert SearchSpace(**{item.name: getattr(args, item.name) for item in fields(SearchSpace)}) == space
    assert SearchSpace.from_dict(space.to_dict()) == space
    assert SearchSpace().flags() == []
    with pytest.raises(InvalidArgument, match="families must be a sequence of names, got the string 'mlp'"):
        SearchSpace(families="mlp")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match=r"unknown search settings \['family'\]"):
        SearchSpace.from_dict({"family": ["mlp"]})

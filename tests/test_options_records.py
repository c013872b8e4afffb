"""The options records (issue 43): ``check_cases`` takes ``check``'s keywords as one typed record, a
rank's run its keywords as another; both carry every keyword through to the run."""

from __future__ import annotations

import importlib

import pytest
import torch

from equiv.cases.case import Case


def test_check_cases_passes_checks_keywords_on_with_the_thread_count_chosen_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from equiv.cases.standard import STANDARD_CASES

    check_module = importlib.import_module("equiv.checking.check")  # (equiv.checking.check is also the function)

    def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, micro_batches: object, loss_fn: object) -> None:
        raise AssertionError("not run: check is replaced")

    seen: list[dict[str, object]] = []

    def recording_check(candidate: object, case: Case, **options: object) -> object:
        seen.append(options)
        raise check_module.CandidateError("recorded, not run", case=case, step=0, dtype="float64")

    monkeypatch.setattr(check_module, "check", recording_check)
    cases = dict(list(STANDARD_CASES.items())[:2])
    check_module.check_cases(
        step, cases, tiers=("exact",), timeout=7.0, train_dtype="float64", strict=True, details=False, threads=3
    )
    expected = {"tiers": ("exact",), "timeout": 7.0, "train_dtype": "float64", "strict": True, "details": False}
    assert seen == [{**expected, "threads": 3}] * len(cases)


def test_a_ranks_options_reach_the_run() -> None:
    from equiv.cases.standard import TOY_CASE
    from equiv.judging.runs import run_candidate

    started: list[int] = []
    cut: list[list[int]] = []
    wrapped: list[torch.nn.Module] = []

    def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, micro_batches: object, loss_fn: object) -> None:
        cut.append([len(inputs) for inputs, _ in micro_batches])  # type: ignore[attr-defined]

    def wrap(model: torch.nn.Module) -> torch.nn.Module:
        wrapped.append(model)
        return model

    snapshots = run_candidate(
        TOY_CASE.replace(steps=2),
        step,
        torch.float64,
        wrap_model=wrap,
        batch_slice=slice(0, 4),
        micro_batch_sizes=(1, 3),
        on_step=started.append,
    )
    assert len(snapshots) == 3 and len(wrapped) == 1
    assert started == [0, 1] and cut == [[1, 3], [1, 3]]

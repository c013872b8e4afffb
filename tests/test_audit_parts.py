"""The audit's parts apart (issue 43): its options written once (:class:`AuditSettings`, the
keywords ``equiv.audit`` takes and shows), what a window saw as a typed record
(:class:`~equiv.auditing.recording.WindowRecord`), and the result (the windows, the counts, the
summary, the JSON) in ``equiv.results``, below the hooks that fill it."""

from __future__ import annotations

import dataclasses
import inspect
import json
import pydoc
import re

import pytest
import torch
from torch import nn

import equiv
from equiv.auditing.recording import WindowRecord
from equiv.auditing.settings import AuditSettings
from equiv.auditing.watch import Audit
from equiv.results.audit import AuditResult, WindowAudit


def _run(**options: object) -> Audit:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    criterion = nn.CrossEntropyLoss(reduction="sum")
    generator = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(n, 4, generator=generator), torch.randint(0, 3, (n,), generator=generator)) for n in (2, 3, 4, 4)
    ]
    with equiv.audit(model, optimizer, criterion=criterion, **options) as watched:  # type: ignore[arg-type]
        for first in (0, 2):
            window = batches[first : first + 2]
            items = sum(len(y) for _, y in window)
            for x, y in window:
                (criterion(model(x), y) / items).backward()
                assert isinstance(watched._window, WindowRecord) and len(watched._window.calls) >= 1
            optimizer.step()
            optimizer.zero_grad()
    return watched


def test_the_keywords_audit_takes_are_the_settings_fields_written_once() -> None:
    fields = [field.name for field in dataclasses.fields(AuditSettings)]
    shown = inspect.signature(equiv.audit).parameters
    assert list(shown) == ["model", "optimizer", *fields]
    for field in dataclasses.fields(AuditSettings):
        assert shown[field.name].kind is inspect.Parameter.KEYWORD_ONLY
        assert shown[field.name].default is field.default
    # help(equiv.audit) shows every keyword with its default, and the docstring's Args for each.
    text = pydoc.render_doc(equiv.audit, renderer=pydoc.plaintext)
    shown_line, args = text.split("\n")[2], text.split("Args:")[1].split("Returns:")[0]
    for name in fields:
        assert f" {name}: " in shown_line and re.search(rf"\n        ([a-z_]+, )?{name}(, [a-z_]+)?:", args), name


def test_an_unknown_keyword_is_one_line_naming_it() -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(TypeError, match="evry"):
        equiv.audit(model, torch.optim.SGD(model.parameters(), lr=0.1), loss=equiv.MSE(), evry=2)  # type: ignore[call-arg]


def test_bad_settings_are_refused_when_the_settings_are_made() -> None:
    with pytest.raises(ValueError, match="every must be a positive int"):
        AuditSettings(loss=equiv.MSE(), every=0)
    with pytest.raises(ValueError, match="max_grad_norm must be a positive number"):
        AuditSettings(loss=equiv.MSE(), max_grad_norm=-1.0)
    assert AuditSettings(loss=equiv.MSE(), max_grad_norm=0.0).max_grad_norm is None  # 0: no clipping


def test_the_result_lives_below_the_hooks_and_is_what_the_audit_is() -> None:
    watched = _run(every=1)
    assert isinstance(watched, AuditResult) and watched.steps == 2 and len(watched.windows) == 2
    assert all(isinstance(window, WindowAudit) for window in watched.windows)
    assert watched.settings.every == 1 and watched.every == 1
    # The result alone carries what it says: a copy without the hooks reads the same.
    alone = AuditResult(every=watched.every, allow_nothing_judged=False)
    alone.windows, alone.steps, alone.skipped = list(watched.windows), watched.steps, watched.skipped
    assert json.dumps(alone.to_dict()) == json.dumps(watched.to_dict())
    assert alone.summary() == watched.summary() and alone.line() == watched.line()
    assert equiv.auditing.replay.WindowAudit is WindowAudit  # the old import path still names it

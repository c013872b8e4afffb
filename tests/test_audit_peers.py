"""The audit on the trainers people run, unmodified but for a callback (or a
``with``): the transformers Trainer, Lightning, Accelerate's accumulate().
Each is marked ``peers`` with the packages it needs (``pip install equiv[peers]``; ``tox -e peers``
runs them, and fails where one is missing) and skips with the reason without them."""

from __future__ import annotations

from pathlib import Path

import pytest

from equiv.auditing.runs import accelerate_tail_run, lightning_tail_run, trainer_run
from tests.test_audit_torchrun import audits_under_torchrun


@pytest.mark.peers("transformers", "accelerate")
def test_the_trainer_on_a_model_taking_kwargs_is_clean() -> None:
    audited = trainer_run(loss_kwargs=True)
    assert len(audited.windows) == 4 and audited, audited.summary()


@pytest.mark.peers("transformers", "accelerate")
def test_the_trainer_on_a_model_without_kwargs_is_flagged_where_token_counts_differ() -> None:
    # TRAINER_LENGTHS: windows 1 and 3 hold micro-batches of different real-token counts (transformers #37766).
    audited = trainer_run(loss_kwargs=False)
    assert [w.equivalent for w in audited.windows] == [True, False, True, False], audited.summary()
    assert [w.position for w in audited.windows] == ["epoch 0.00", "epoch 0.25", "epoch 0.50", "epoch 0.75"]


@pytest.mark.peers("pytorch_lightning")
def test_lightning_divides_the_epochs_short_tail_window_by_n_and_the_audit_flags_it() -> None:
    audited = lightning_tail_run()  # 7 batches, accumulate_grad_batches=3 (Lightning #19987)
    assert [w.micro_batches for w in audited.windows] == [3, 3, 1]
    assert [w.equivalent for w in audited.windows] == [True, True, False], audited.summary()
    assert "a window of 1 where the run's others have 3" in audited.windows[-1].line()
    assert audited.windows[-1].line().startswith("step 2 (epoch 0, batch 6): 1 micro-batch")
    assert abs(audited.windows[-1].mismatches[0].update_ratio - 1 / 3) < 1e-3


@pytest.mark.peers("pytorch_lightning")
def test_lightning_in_bf16_mixed_precision_is_judged_with_its_autocast() -> None:
    # The callback records each batch before Lightning enters its autocast: it enters the same one, so the
    # floors carry bfloat16's rounding; the full windows stay equivalent and the short tail is still flagged.
    audited = lightning_tail_run(precision="bf16-mixed")
    assert [w.equivalent for w in audited.windows] == [True, True, False], audited.summary()
    assert abs(audited.windows[-1].mismatches[0].update_ratio - 1 / 3) < 1e-2


@pytest.mark.peers("accelerate")
def test_accelerates_accumulate_divides_the_short_tail_by_n_and_the_audit_flags_it() -> None:
    audited = accelerate_tail_run()  # the documented loop, only the with-line added
    assert [w.micro_batches for w in audited.windows] == [3, 3, 1]
    assert [w.equivalent for w in audited.windows] == [True, True, False], audited.summary()
    assert abs(audited.windows[-1].mismatches[0].update_ratio - 1 / 3) < 1e-3


@pytest.mark.peers("transformers", "accelerate")
def test_the_transformers_trainer_under_torchrun_is_audited_with_the_same_two_lines(tmp_path: Path) -> None:
    audits = audits_under_torchrun(2, ("trainer", "trainer_no_loss_kwargs"), tmp_path)
    # DDP on gloo, each rank its shard of the batches, the Trainer's defaults read (max_grad_norm=1.0)
    good = audits["trainer"]
    assert "max_grad_norm=1.0" in good["read"] and "model_accepts_loss_kwargs=True" in good["read"]
    assert good["audit"]["status"] == "equivalent" and good["audit"]["judged"] == 2, good["summary"]
    assert "on rank 0 of 2" in good["summary"]
    # a model without **kwargs: the Trainer's mean of micro-batch means (transformers #37766), flagged
    bad = audits["trainer_no_loss_kwargs"]
    assert [window["status"] for window in bad["audit"]["windows"]] == ["not_equivalent"] * 2, bad["summary"]


@pytest.mark.peers("pytorch_lightning")
def test_lightning_under_torchrun_is_audited_with_the_same_callback(tmp_path: Path) -> None:
    # Lightning's DDP strategy on the 2 ranks torchrun started: each rank 4 of the 7 batches (its sampler pads),
    # windows of 3 then a tail of 1 that Lightning still divides by 3 (Lightning #19987), on every rank
    audits = audits_under_torchrun(2, ("lightning",), tmp_path)
    windows = audits["lightning"]["audit"]["windows"]
    assert [window["status"] for window in windows] == ["equivalent", "not_equivalent"], audits["lightning"]["summary"]
    assert "update 0.3333x the full-batch one" in audits["lightning"]["summary"]
    assert "off on ranks [0, 1] of 2" in audits["lightning"]["summary"]

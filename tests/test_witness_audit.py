"""The witness in the audit (issue 44): on every failing window the weights the run gave each micro-batch's
loss sum, recovered and named, equal the ones the loop applied (within 1 %); a correct run's windows carry
no witness and their lines are as they were; a remedy of the whole run is said once in the summary."""

from __future__ import annotations

import contextlib
import io
import math
import tempfile
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import equiv
from equiv.auditing import audit
from equiv.auditing.runs import tiny_lm_and_optimizer, token_loader, windows
from equiv.losses import NextTokenCrossEntropy, TokenCrossEntropy

TOKENS = NextTokenCrossEntropy()
#: 7 micro-batches of 2 sequences, uneven real-token counts: in windows of 3, the last is a tail of 1
LENGTHS = [8, 8, 8, 3, 3, 8, 2, 5, 7, 6, 8, 2, 4, 4]
Weighting = Callable[[list[float]], list[float]]  # the items of a window's micro-batches -> each sum's weight


def _run(divisor: Callable[[list[float], Tensor], float], window_size: int = 3) -> equiv.auditing.Audit:
    """A tiny LM trained in windows of ``window_size``, each micro-batch's loss SUM divided by ``divisor``
    (the window's items, this micro-batch's target)."""
    model, optimizer = tiny_lm_and_optimizer("SGD")
    with audit(model, optimizer, loss=TOKENS) as watched:
        for window in windows(token_loader(LENGTHS), window_size):
            items = [float(TOKENS.count(labels)) for _, labels in window]
            for ids, labels in window:
                (TOKENS.sum(model(ids, labels), labels) / divisor(items, labels)).backward()
            optimizer.step()
            optimizer.zero_grad()
    return watched


def _assert_witnessed(watched: equiv.auditing.Audit, applied: Weighting, normaliser: str) -> None:
    failing = watched.failures
    assert failing, watched.summary()
    for window in failing:
        assert window.witness is not None and window.witness.run is not None, window.line()
        expected = applied([float(count) for count in window.items])
        for got, want in zip(window.witness.run, expected, strict=True):
            assert math.isclose(got, want, rel_tol=0.01), (window.witness.run, expected)
        assert window.witness.normaliser.split(" or ")[0] == normaliser, window.line()
        assert window.failure_kind is not None and window.failure_kind.name == normaliser
        weights = window.to_dict()["weights"]
        assert weights["normaliser"] == window.witness.normaliser and weights["run"] == list(window.witness.run)
        assert weights["full_batch"] == pytest.approx([1 / sum(window.items)] * len(window.items))
        assert window.witness.clause() in window.line()


def test_a_mean_of_micro_batch_means_is_witnessed_with_its_weights() -> None:
    # each micro-batch's mean divided by the window's micro-batches: 1/(k n_i); the tail of 1 is a plain mean
    watched = _run(lambda items, labels: len(items) * TOKENS.count(labels))
    assert [window.micro_batches for window in watched.failures] == [3, 3], watched.summary()
    _assert_witnessed(watched, lambda items: [1 / (len(items) * n) for n in items], "mean of means")


def test_a_sum_of_micro_batch_means_is_witnessed_with_its_weights() -> None:
    watched = _run(lambda items, labels: TOKENS.count(labels))  # each mean summed, never divided: 1/n_i
    assert [window.micro_batches for window in watched.failures] == [3, 3], watched.summary()  # the tail: a mean
    _assert_witnessed(watched, lambda items: [1 / n for n in items], "sum without division")


def test_a_tail_divided_by_the_configured_n_is_witnessed() -> None:
    # correct windows of 3 (the window's items), the tail of 1 divided as if it had 3 micro-batches
    def divisor(items: list[float], labels: Tensor) -> float:
        return sum(items) if len(items) == 3 else 3 * TOKENS.count(labels)

    watched = _run(divisor, window_size=3)
    assert [w.micro_batches for w in watched.failures] == [1], watched.summary()
    _assert_witnessed(watched, lambda items: [1 / (3 * n) for n in items], "tail divided by N")


def test_a_correct_run_carries_no_witness_and_its_lines_are_unchanged() -> None:
    watched = _run(lambda items, labels: sum(items))
    assert watched and watched.windows, watched.summary()
    for window in watched.windows:
        assert window.witness is None and window.failure_kind is None
        assert "weights" not in window.to_dict() and "failure_kind" not in window.to_dict()
        assert window.line() == window.line(remedies=False)
        assert window.line().endswith(f"equivalent (worst {window.worst.ratio:.2g} of its allowance)")


#: the real-token counts of each sequence (labels -100 past them): micro-batches of 2 rows, windows of 2
_TRAINER_LENGTHS = [[8, 7], [2, 1], [5, 5], [8, 6], [3, 8], [1, 1], [6, 2], [4, 4]]


def _token_classification_trainer_run(*, loss_kwargs: bool, scaled: bool | None = None) -> equiv.auditing.Audit:
    """transformers' own GPT2ForTokenClassification (its loss: nn.CrossEntropyLoss's mean, which ignores the
    num_items_in_batch its forward's **kwargs take) under the Trainer on TrainingArguments' defaults (clipping
    at max_grad_norm=1.0 included), gradient_accumulation_steps=2, the rows in order; dropout off in the
    config (the audit replays no dropout).  ``loss_kwargs=False``: behind a forward without **kwargs;
    ``scaled``: the Trainer subclass's ``loss_is_scaled_for_ga`` (as TRL's DPO, KTO and Reward trainers set it)."""
    from transformers import GPT2Config, GPT2ForTokenClassification, Trainer, TrainingArguments
    from transformers.utils import logging as transformers_logging

    from equiv.adapters.transformers import NoLossKwargs

    transformers_logging.set_verbosity_error()
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=32, n_positions=16, n_embd=16, n_layer=1, n_head=2, num_labels=5,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, classifier_dropout=0.0,
    )  # fmt: skip
    model: nn.Module = GPT2ForTokenClassification(config)
    if not loss_kwargs:
        model = NoLossKwargs(model)
    generator = torch.Generator().manual_seed(1)
    rows = []
    for lengths in _TRAINER_LENGTHS:
        for length in lengths:
            ids = torch.randint(1, 32, (8,), generator=generator)
            labels = torch.randint(0, 5, (8,), generator=generator)
            labels[length:] = -100
            rows.append({"input_ids": ids, "attention_mask": torch.ones(8, dtype=torch.long), "labels": labels})

    class InOrder(Trainer):  # type: ignore[misc,unused-ignore]
        loss_is_scaled_for_ga = scaled

        def _get_train_sampler(self, *args: Any, **kwargs: Any) -> torch.utils.data.Sampler[int]:
            return torch.utils.data.SequentialSampler(rows)

    callback = equiv.auditing.transformers_callback(loss=TokenCrossEntropy(), say=None)
    with tempfile.TemporaryDirectory() as output_dir:
        args = TrainingArguments(
            output_dir=output_dir,
            per_device_train_batch_size=2,
            gradient_accumulation_steps=2,
            use_cpu=True,
            report_to="none",
            save_strategy="no",
            disable_tqdm=True,
            remove_unused_columns=False,
        )
        trainer = InOrder(model=model, args=args, train_dataset=rows, callbacks=[callback])
        with contextlib.redirect_stdout(io.StringIO()):
            trainer.train()
    assert callback.audit is not None
    return callback.audit  # type: ignore[no-any-return]


def _direction(weights: list[float] | tuple[float, ...]) -> list[float]:
    return [weight / sum(weights) for weight in weights]


@pytest.mark.peers("transformers", "accelerate")
def test_a_transformers_head_that_ignores_num_items_in_batch_is_witnessed_under_the_trainer() -> None:
    watched = _token_classification_trainer_run(loss_kwargs=True)
    assert watched.read is not None and "model_accepts_loss_kwargs=True" in watched.read
    uneven = [window for window in watched.windows if len(set(window.items)) > 1]
    assert uneven and watched.failures == uneven, watched.summary()  # [8, 6] + [4, 4] rows: equal counts pass
    for window in watched.failures:
        witness = window.witness
        assert witness is not None and witness.run is not None, window.line()
        applied = [1 / n for n in window.items]  # the model's mean of each micro-batch, summed by the Trainer
        assert _direction(witness.run) == pytest.approx(_direction(applied), rel=0.01), window.line()
        assert "sum without division" in witness.normaliser.split(" or "), window.line()
        scale = witness.run[0] * window.items[0]  # the clip's factor, 1 when it did not act
        assert all(math.isclose(w * n, scale, rel_tol=0.01) for w, n in zip(witness.run, window.items, strict=True))
        assert window.setting is not None and window.setting.startswith(
            "model_accepts_loss_kwargs=True but the model's loss ignored num_items_in_batch"
        )
        assert window.setting in window.line() and window.setting not in window.line(remedies=False)
    assert watched.summary().count("model_accepts_loss_kwargs=True but the model's loss ignored") == 1


def _means_divided_by_the_steps(watched: equiv.auditing.Audit) -> list[Any]:
    """The failing windows, each witnessed as a mean of means: each micro-batch's mean divided by
    gradient_accumulation_steps=2 (the directions of the weights within 1 %)."""
    assert watched.failures, watched.summary()
    for window in watched.failures:
        assert window.witness is not None and window.witness.run is not None, window.line()
        applied = [1 / (2 * n) for n in window.items]  # each mean divided by gradient_accumulation_steps=2
        assert _direction(window.witness.run) == pytest.approx(_direction(applied), rel=0.01), window.line()
        assert "mean of means" in window.witness.normaliser.split(" or "), window.line()
    return watched.failures


@pytest.mark.peers("transformers", "accelerate")
def test_a_forward_without_loss_keywords_under_the_trainer_is_a_mean_of_means_named_as_such() -> None:
    watched = _token_classification_trainer_run(loss_kwargs=False)
    for window in _means_divided_by_the_steps(watched):
        assert window.setting is not None and "model_accepts_loss_kwargs=False" in window.setting


@pytest.mark.peers("transformers", "accelerate")
def test_a_trainer_subclass_whose_loss_is_not_scaled_for_ga_is_named_by_that_setting_not_the_models() -> None:
    """TRL's DPO, KTO and Reward trainers set loss_is_scaled_for_ga=False (trl PR #5710): the Trainer divides each
    micro-batch's mean by the accumulation steps though the model takes num_items_in_batch; the setting at fault is
    the subclass's, read from the Trainer itself (it does not hand itself to callbacks)."""
    watched = _token_classification_trainer_run(loss_kwargs=True, scaled=False)
    assert watched.read is not None and "loss_is_scaled_for_ga=False" in watched.read
    assert "model_accepts_loss_kwargs" not in watched.read  # the subclass's setting replaces that rule
    for window in _means_divided_by_the_steps(watched):
        assert window.setting is not None and window.setting.startswith("InOrder.loss_is_scaled_for_ga=False")


def _torchrun_script() -> Any:
    """tests/data/audit_under_torchrun.py as a module (its data: each rank's windows)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parent / "data" / "audit_under_torchrun.py"
    spec = importlib.util.spec_from_file_location("audit_under_torchrun", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3])
def test_a_per_rank_token_mean_under_ddp_is_witnessed_on_every_rank_count(world: int, tmp_path: Any) -> None:
    from tests.test_audit_torchrun import audits_under_torchrun

    script = _torchrun_script()
    audits = audits_under_torchrun(world, ("ddp_rank_token_mean", "ddp_global_tokens"), tmp_path)
    failing = audits["ddp_rank_token_mean"]["audit"]["windows"]
    assert len(failing) == script.WINDOWS and all(w["status"] == "not_equivalent" for w in failing)
    for index, window in enumerate(failing):
        # each rank's micro-batch sums over its own tokens, DDP's mean over the ranks: 1/(R N_r); a micro-batch
        # with no token has no gradient to weigh (left out)
        applied = []
        for rank in range(world):
            counts = [script.tokens(labels) for _, labels in script.rank_windows(rank, world)[index]]
            applied += [1 / (world * sum(counts)) for count in counts if count]
        weights = window["weights"]
        assert weights["run"] == pytest.approx(applied, rel=0.01), audits["ddp_rank_token_mean"]["summary"]
        # the data's micro-batches hold equal counts within a rank (but one): there a mean of means is the same
        # weights, and both are named
        named = weights["normaliser"].split(" or ")
        assert "per-rank mean" in named, weights
        kind = window["failure_kind"]
        assert [kind["name"], *kind["also"]] == named
        line = window["line"]
        assert "per-rank mean" in line or "each rank's loss divided by its own items" in line, line
    assert all("weights" not in w for w in audits["ddp_global_tokens"]["audit"]["windows"])


def test_a_remedy_for_the_whole_run_is_said_once_in_the_summary() -> None:
    model, optimizer = tiny_lm_and_optimizer("SGD")
    model.dropout = nn.Dropout(0.1)  # dropout on: no window can be replayed
    with audit(model, optimizer, loss=TOKENS, allow_nothing_judged=True) as watched:
        for window in windows(token_loader(LENGTHS[:6]), 1):
            for ids, labels in window:
                TOKENS(model(ids, labels), labels).backward()
            optimizer.step()
            optimizer.zero_grad()
    remedy = watched.windows[0].hint
    assert remedy is not None and "turn dropout off" in remedy and len(watched.windows) == 3
    assert all(window.hint == remedy and remedy in window.line() for window in watched.windows)  # each alone
    assert watched.summary().count(remedy) == 1, watched.summary()


def test_the_writers_carry_the_witness(tmp_path: Any) -> None:
    import json

    scalars: list[tuple[str, float, int | None]] = []
    texts: list[str] = []

    class Writer:
        def add_scalar(self, tag: str, scalar_value: float, global_step: int | None = None) -> None:
            scalars.append((tag, scalar_value, global_step))

        def add_text(self, tag: str, text_string: str, global_step: int | None = None) -> None:
            texts.append(text_string)

    streamed = tmp_path / "windows.jsonl"
    on_window = equiv.auditing.jsonl_writer(streamed, then=equiv.auditing.tensorboard_writer(Writer()))
    model, optimizer = tiny_lm_and_optimizer("SGD")
    with audit(model, optimizer, loss=TOKENS, on_window=on_window) as watched:
        for window in windows(token_loader(LENGTHS), 3):
            for ids, labels in window:
                TOKENS(model(ids, labels), labels).backward()  # each mean summed: x(mean of N / n_i)
            optimizer.step()
            optimizer.zero_grad()
    lines = [json.loads(line) for line in streamed.read_text().splitlines()]
    failing = [window for window in watched.windows if window.witness is not None]
    assert len(failing) == 2 and [line.get("weights") for line in lines] == [
        None if window.witness is None else window.witness.to_dict() for window in watched.windows
    ]
    ratios = {step: value for tag, value, step in scalars if tag == "equiv/audit/weight_ratio"}
    for window in failing:
        assert window.witness is not None
        expected = sum(sum(window.items) / n for n in window.items) / len(window.items)
        assert ratios[window.step] == pytest.approx(expected, rel=0.01)
        assert any(window.witness.clause() in text for text in texts)
    assert set(ratios) == {window.step for window in failing}  # none for the passing tail


def test_a_witnessed_window_fits_the_results_schema() -> None:
    import json
    from pathlib import Path

    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((Path(equiv.__file__).parent / "results" / "schema.json").read_text())
    watched = _run(lambda items, labels: TOKENS.count(labels))
    assert watched.failures
    jsonschema.validate(json.loads(json.dumps(watched.to_dict())), schema)
    broken = watched.failures[0].to_dict()
    broken["weights"]["residual"] = "small"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, schema)


def test_a_witness_that_cannot_be_made_is_said_and_the_verdict_stands(monkeypatch: pytest.MonkeyPatch) -> None:
    # An error inside the witness (in one process) never replaces the window's verdict: it is said in its note.
    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("the loss cannot be replayed per micro-batch")

    monkeypatch.setattr("equiv.auditing.judging.window_witness", broken)
    watched = _run(lambda items, labels: TOKENS.count(labels))
    assert [window.micro_batches for window in watched.failures] == [3, 3], watched.summary()
    for window in watched.failures:
        assert window.witness is None and not window
        assert window.note is not None and "no witness of the weights (RuntimeError: the loss cannot" in window.note

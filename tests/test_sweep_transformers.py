"""``equiv sweep transformers`` (issue 45): the tiny config, the rows, a class's row, the command, and the
float64 check of our own that a NOT row is no false alarm."""

from __future__ import annotations

import json

import pytest
import torch

from equiv.peers.sweep_rows import COULD_NOT_RUN, SweepRow
from equiv.peers.transformers_tiny import SEQUENCE_LENGTH, family_rows, shrunk_fields

pytestmark = pytest.mark.peers("transformers", "accelerate")


def test_shrunk_fields_sets_the_sizes_the_config_has_and_zeroes_every_dropout() -> None:
    defaults = {
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": None,  # derived from the heads by the constructor: left for it to derive
        "vocab_size": 32000,
        "attention_dropout": 0.1,
        "resid_pdrop": 0.1,
        "use_cache": True,
        "layer_types": ["full_attention"] * 32,
        "text_config": {"model_type": "llama", "hidden_size": 4096, "hidden_dropout_prob": 0.1},
        "pad_token_id": 0,
    }
    fields = shrunk_fields(defaults)
    assert fields["hidden_size"] < 100 and fields["num_hidden_layers"] <= 2 and fields["vocab_size"] < 200
    assert fields["hidden_size"] % fields["num_attention_heads"] == 0
    assert "num_key_value_heads" not in fields and "use_cache" not in fields
    assert fields["attention_dropout"] == 0.0 and fields["resid_pdrop"] == 0.0
    assert fields["layer_types"] == ["full_attention"] * fields["num_hidden_layers"]
    assert fields["text_config"]["hidden_size"] < 100 and fields["text_config"]["hidden_dropout_prob"] == 0.0
    assert fields["text_config"]["model_type"] == "llama"
    assert fields["classifier_dropout"] == 0.0  # read by heads with a default of their own, set whatever
    assert "experts_implementation" not in fields and "decoder_start_token_id" not in fields
    assert shrunk_fields({**defaults, "num_local_experts": 8})["experts_implementation"] == "eager"
    # a router's training-time noise (Phimoe, SwitchTransformers) is drawn again by no replay, as dropout
    assert shrunk_fields({**defaults, "router_jitter_noise": 0.01})["router_jitter_noise"] == 0.0
    assert shrunk_fields({**defaults, "is_encoder_decoder": True})["decoder_start_token_id"] == 1


def test_tiny_config_builds_a_tiny_model_without_dropout() -> None:
    from transformers import GPT2Config, GPT2ForTokenClassification

    from equiv.peers.transformers_tiny import tiny_config

    config, fields = tiny_config(GPT2Config)
    model = GPT2ForTokenClassification(config)
    assert sum(p.numel() for p in model.parameters()) < 100_000
    assert fields["n_layer"] == config.n_layer == 2
    assert all(module.p == 0 for module in model.modules() if isinstance(module, torch.nn.Dropout))


@pytest.mark.parametrize("family", ["causal LM", "token classification", "sequence classification"])
def test_family_rows_count_uneven_items(family: str) -> None:
    rows = family_rows(family)
    counts = [int((row["labels"] != -100).sum()) for row in rows]
    assert len(set(counts)) > 1, counts  # the Trainer's micro-batches of 8 rows count different items
    again = family_rows(family)  # drawn from the seed: the same rows every run
    assert all(torch.equal(a["labels"], b["labels"]) for a, b in zip(again, rows, strict=True))


def test_question_answering_rows_keep_every_position_in_range() -> None:
    rows = family_rows("question answering")
    for row in rows:
        assert 0 <= int(row["start_positions"]) <= int(row["end_positions"]) < SEQUENCE_LENGTH


def test_subjects_cover_the_families_and_refuse_an_unknown_class() -> None:
    from equiv.peers.transformers_sweep import subjects

    every = subjects({})
    assert len(every) >= 150 and every == sorted(every)
    assert ("GPT2ForTokenClassification", "token classification") in every
    assert ("LlamaForCausalLM", "causal LM") in every
    with pytest.raises(ValueError, match="NoSuchModel"):
        subjects({"only": ["NoSuchModel"]})


def _window_fields(row: SweepRow) -> list[tuple[str, str | None, str | None]]:
    assert row.audit is not None, row.reason
    return [
        (window["status"], (window.get("weights") or {}).get("normaliser"), window.get("setting"))
        for window in row.audit["windows"]
    ]


def test_a_head_that_ignores_num_items_in_batch_is_not_equivalent_with_the_normaliser_named() -> None:
    from equiv.peers.transformers_sweep import run_subject

    row = run_subject("GPT2ForTokenClassification", {})
    assert row.outcome == "not_equivalent" and row.family == "token classification"
    windows = _window_fields(row)
    assert windows and all(status == "not_equivalent" for status, _, _ in windows)
    assert all("sum without division" in (normaliser or "") for _, normaliser, _ in windows)
    assert all("ignored num_items_in_batch" in (setting or "") for _, _, setting in windows)
    assert row.setup["config"]["n_layer"] == 2 and row.setup["trainer_arguments"]["gradient_accumulation_steps"] == 2
    assert SweepRow.from_dict(json.loads(json.dumps(row.to_dict()))) == row


def test_a_causal_lm_that_passes_num_items_in_batch_is_equivalent() -> None:
    from equiv.peers.transformers_sweep import run_subject

    row = run_subject("LlamaForCausalLM", {})
    assert row.outcome == "equivalent", row.audit
    assert row.setup["model_accepts_loss_kwargs"] is True
    assert [status for status, _, _ in _window_fields(row)] == ["equivalent", "equivalent"]


def test_a_causal_lm_whose_loss_type_the_trainer_does_not_shift_for_is_a_count_off_by_one_per_row() -> None:
    """transformers 5.24 counts num_items_in_batch over labels[..., 1:] only for a loss_type mapped to
    ForCausalLMLoss; GPT2LMHeadModel's is not, so every row's first label is counted though its loss shifts
    it away: each micro-batch's loss sum divided by N + rows (the witness, within 1 %), the setting named."""
    from equiv.peers.transformers_sweep import run_subject

    row = run_subject("GPT2LMHeadModel", {})
    assert row.outcome == "not_equivalent" and row.audit is not None
    for window in row.audit["windows"]:
        weights, items = window["weights"], window["items"]
        assert weights["normaliser"] == "count off by one per row", window["line"]
        rows = 8 * len(items)  # 8 rows a micro-batch (the Trainer's default per_device_train_batch_size)
        assert all(abs(weight * (sum(items) + rows) - 1) < 0.01 for weight in weights["run"]), weights
        assert "loss_type=None is not ForCausalLM" in window["setting"]


def test_a_class_that_cannot_run_is_a_row_naming_the_stage() -> None:
    from equiv.peers.transformers_sweep import run_subject

    # Its forward returns a loss only beside next_sentence_label: no loss from labels alone.
    row = run_subject("BertForPreTraining", {})
    assert row.outcome == COULD_NOT_RUN and row.audit is None
    assert row.reason.startswith("checking the declared loss: ValueError: the forward returned no loss")
    assert "\n" not in row.reason


def test_a_head_computing_another_objective_is_refused_not_judged() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from equiv.peers.transformers_sweep import matching_loss
    from equiv.peers.transformers_tiny import tiny_config

    model = LlamaForCausalLM(tiny_config(LlamaConfig)[0])
    # Declared a token-level head: the family's unshifted loss is checked first, the shifted one then found.
    loss, _ = matching_loss(model, "masked LM", family_rows("causal LM"))
    assert type(loss).__name__ == "NextTokenCrossEntropy"

    class WithAuxLoss(LlamaForCausalLM):  # type: ignore[misc]
        def forward(self, **kwargs: object) -> object:  # an auxiliary term added to the labels' loss
            output = super().forward(**kwargs)
            output.loss = output.loss + 0.01 * output.logits.pow(2).mean()
            return output

    with pytest.raises(ValueError, match=r"the head's own loss \(.*\) is none of NextTokenCrossEntropy"):
        matching_loss(WithAuxLoss(model.config), "causal LM", family_rows("causal LM"))


def _float64_window(subject: str, family: str) -> tuple[float, float, float]:
    """Independent of the audit: a tiny ``subject`` in float64, two micro-batches of the family's rows with
    uneven items.  Returns how far its loss with ``num_items_in_batch=N`` is from its loss without (0: the
    head ignores it), and the gradient the Trainer applies (each micro-batch's loss, never divided, since the
    model takes **kwargs) against the full-batch gradient (the window's loss sum / N): its relative distance,
    and its distance from the weights 1/n_i applied by hand (each micro-batch's mean, summed)."""
    import transformers
    from transformers import default_data_collator

    from equiv.peers.transformers_sweep import _config_class_of, matching_loss
    from equiv.peers.transformers_tiny import tiny_config

    torch.manual_seed(0)
    model = getattr(transformers, subject)(tiny_config(_config_class_of(subject))[0]).double()
    rows = family_rows(family)
    batches = [default_data_collator(rows[0::2]), default_data_collator(rows[1::2])]  # uneven items
    loss, _ = matching_loss(model, family, rows)
    counts = [int(loss.count(batch["labels"])) for batch in batches]
    assert counts[0] != counts[1], counts
    total = sum(counts)

    def gradient(make_loss: object) -> torch.Tensor:
        model.zero_grad()
        for batch in batches:
            make_loss(batch).backward()  # type: ignore[operator]
        return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    with torch.no_grad():
        with_n = float(model(**batches[0], num_items_in_batch=torch.tensor(total)).loss)
        without = float(model(**batches[0]).loss)
    trainer = gradient(lambda batch: model(**batch, num_items_in_batch=torch.tensor(total)).loss)
    full = gradient(lambda batch: loss.sum(model(**batch).logits, batch["labels"]) / total)
    by_hand = gradient(lambda batch: loss.sum(model(**batch).logits, batch["labels"]) / loss.count(batch["labels"]))
    return (
        abs(with_n - without),
        float((trainer - full).norm() / full.norm()),
        float((trainer - by_hand).norm() / by_hand.norm()),
    )


@pytest.mark.parametrize(
    ("subject", "family"),
    [
        ("GPT2ForTokenClassification", "token classification"),
        ("BertForMaskedLM", "masked LM"),
        ("LlamaForSequenceClassification", "sequence classification"),
        ("T5ForConditionalGeneration", "seq2seq LM"),
    ],
)
def test_not_rows_are_confirmed_by_a_float64_computation_of_our_own(subject: str, family: str) -> None:
    ignored, off_full_batch, off_means_summed = _float64_window(subject, family)
    assert ignored == 0.0  # the head's loss is the same with and without num_items_in_batch
    assert off_full_batch > 0.05  # so the Trainer's gradient is not the full batch's ...
    assert off_means_summed < 1e-12  # ... it is each micro-batch's mean, summed: the weights the witness names


def test_a_causal_lm_is_confirmed_right_by_the_same_computation() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from equiv.peers.transformers_tiny import tiny_config

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config(LlamaConfig)[0]).double()
    rows = family_rows("causal LM")
    batch = {key: torch.stack([row[key] for row in rows[:8]]) for key in rows[0]}
    items = int((batch["labels"][:, 1:] != -100).sum())
    with_n = model(**batch, num_items_in_batch=torch.tensor(3 * items)).loss
    assert torch.allclose(with_n * 3, model(**batch).loss, rtol=1e-12)  # it divides by the count it is given


@pytest.mark.slow
def test_the_command_gives_not_equivalent_and_equivalent(capsys: pytest.CaptureFixture[str]) -> None:
    from equiv.cli import main

    code = main(["sweep", "transformers", "--only", "GPT2ForTokenClassification,LlamaForCausalLM", "--format", "json"])
    assert code == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [(row["subject"], row["audit"]["status"]) for row in rows] == [
        ("GPT2ForTokenClassification", "not_equivalent"),
        ("LlamaForCausalLM", "equivalent"),
    ]

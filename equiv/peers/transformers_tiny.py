"""A transformers model class built tiny from its config class, and the training rows its family takes
(issue 45's sweep, :mod:`equiv.peers.transformers_sweep`).

The config is the class's own defaults with its size fields shrunk (hidden size, layers, heads, key/value
heads, feed-forward width, vocabulary, positions, experts) and every dropout field at 0, passed to the
config's constructor so that what it derives from them (a head size, a per-layer list) is derived from the
tiny values.  Only fields the default config has are set: :func:`tiny_config` returns them, the receipt a
maintainer pastes.  Rows are built for the family (the auto mapping the class is in): token-level heads get
labels padded with -100 to uneven counts, per-sequence heads one label a sequence (-100 on some, so their
micro-batches count uneven items too).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "FAMILIES",
    "SEQUENCE_LENGTH",
    "family_rows",
    "shrunk_fields",
    "tiny_config",
]

#: The auto mappings swept, in the order a class found in several is given to the first (its family).
FAMILIES: tuple[tuple[str, str], ...] = (
    ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "causal LM"),
    ("MODEL_FOR_MASKED_LM_MAPPING_NAMES", "masked LM"),
    ("MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "seq2seq LM"),
    ("MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES", "token classification"),
    ("MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES", "sequence classification"),
    ("MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES", "question answering"),
    ("MODEL_FOR_MULTIPLE_CHOICE_MAPPING_NAMES", "multiple choice"),
    ("MODEL_FOR_PRETRAINING_MAPPING_NAMES", "pre-training"),
)

#: Tokens per row: short, so that a class costs little; the positions and vocabulary leave room for it.
SEQUENCE_LENGTH = 12
#: Rows of the training set: two micro-batches of the Trainer's default 8 rows, one optimizer step an epoch.
ROWS = 16
#: Choices per row of a multiple-choice head.
CHOICES = 2

_HIDDEN, _HEADS, _KV_HEADS, _LAYERS, _FFN, _VOCAB, _POSITIONS = 32, 4, 2, 2, 64, 96, 64

#: Size fields by their names across the config classes, and the tiny value each gets.
_SIZES: dict[str, int] = {
    **dict.fromkeys(("hidden_size", "d_model", "n_embd", "dim", "embed_dim", "model_dim", "d_embed"), _HIDDEN),
    **dict.fromkeys(("embedding_size", "word_embed_proj_dim", "projection_dim", "embedding_dim"), _HIDDEN),
    **dict.fromkeys(
        ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "encoder_layers", "decoder_layers"), _LAYERS
    ),
    **dict.fromkeys(("num_decoder_layers", "num_encoder_layers", "decoder_num_layers"), _LAYERS),
    **dict.fromkeys(("num_attention_heads", "n_head", "n_heads", "num_heads", "encoder_attention_heads"), _HEADS),
    **dict.fromkeys(("decoder_attention_heads", "decoder_num_attention_heads"), _HEADS),
    **dict.fromkeys(("num_key_value_heads", "n_kv_heads", "num_kv_heads", "multi_query_group_num"), _KV_HEADS),
    **dict.fromkeys(("head_dim", "d_kv", "attention_head_size", "kv_channels", "qk_rope_head_dim"), _HIDDEN // _HEADS),
    **dict.fromkeys(("intermediate_size", "ffn_dim", "d_ff", "n_inner", "encoder_ffn_dim", "decoder_ffn_dim"), _FFN),
    **dict.fromkeys(("moe_intermediate_size", "shared_expert_intermediate_size", "ffn_hidden_size"), _FFN),
    **dict.fromkeys(("vocab_size", "n_vocab", "input_vocab_size"), _VOCAB),
    **dict.fromkeys(("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "seq_length"), _POSITIONS),
    **dict.fromkeys(("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts"), 4),
    **dict.fromkeys(("num_experts_per_tok", "moe_topk", "top_k"), 2),
    **dict.fromkeys(("pad_token_id",), 0),
    **dict.fromkeys(("bos_token_id", "decoder_start_token_id"), 1),
    **dict.fromkeys(("eos_token_id", "sep_token_id"), 2),
}
#: Fields set whatever the defaults hold: heads read them with ``getattr`` and a default of their own
#: (``GPT2ForTokenClassification``: ``classifier_dropout``, else ``hidden_dropout``, else 0.1), and a
#: sequence-classification head finds each row's last token by ``pad_token_id``.
_ALWAYS: dict[str, Any] = {"classifier_dropout": 0.0, "pad_token_id": 0}
#: An encoder-decoder's decoder starts from ``decoder_start_token_id`` (T5's config has none until set).
_ENCODER_DECODER: dict[str, Any] = {"decoder_start_token_id": 1}
#: A mixture of experts runs its experts one by one: the grouped matrix product of the default implementation
#: takes no float64, and the audit replays in float64.
_EXPERTS: dict[str, Any] = {"experts_implementation": "eager"}
#: Per-layer lists whose length must be the tiny layer count (the first entries kept).
_PER_LAYER = ("layer_types", "block_types", "attention_layers", "mlp_only_layers", "layers_block_type")


def _is_dropout(name: str, value: Any) -> bool:
    """A field of training-time randomness: a dropout probability ("attention_dropout", "resid_pdrop",
    "hidden_dropout_prob", "drop_rate") or a router's jitter noise ("router_jitter_noise": Phimoe and
    SwitchTransformers multiply the router's input by random noise in training), which no replay draws again."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return (
        "dropout" in name
        or "jitter" in name
        or name.endswith("_pdrop")
        or name.endswith("drop_rate")
        or name == "drop_path_rate"
    )


def shrunk_fields(defaults: dict[str, Any]) -> dict[str, Any]:
    """The fields of a config's ``to_dict()`` set for the tiny model: each size field it has, every dropout
    field at 0, per-layer lists cut to the tiny layer count; only fields ``defaults`` holds are set (a config
    class reads its own names, and one it does not know would be stored unread)."""
    fields: dict[str, Any] = {}
    for name, value in defaults.items():
        if isinstance(value, dict) and "model_type" in value:  # a sub-config (text_config, encoder): shrunk too
            fields[name] = {**value, **shrunk_fields(value)}
        elif name in _SIZES and (value is None or isinstance(value, int)) and not isinstance(value, bool):
            # a token id that is None stays None (the class has no such token); a size that is None (derived
            # from another field) is left for the constructor to derive from the tiny ones
            if value is not None:
                fields[name] = _SIZES[name]
        elif _is_dropout(name, value):
            fields[name] = 0.0
        elif name in _PER_LAYER and isinstance(value, list) and len(value) > _LAYERS:
            fields[name] = value[:_LAYERS]
    always = {**_ALWAYS, **(_ENCODER_DECODER if defaults.get("is_encoder_decoder") else {})}
    if any("expert" in name for name in defaults):
        always.update(_EXPERTS)
    return {**fields, **{name: value for name, value in always.items() if defaults.get(name) is None}}


def tiny_config(config_class: type) -> tuple[Any, dict[str, Any]]:
    """The config class's defaults with :func:`shrunk_fields` set through its constructor; returns the config
    and the fields set (what a maintainer pastes)."""
    defaults = config_class().to_dict()
    fields = shrunk_fields(defaults)
    return config_class(**fields), fields


def _token_ids(generator: torch.Generator, *shape: int) -> torch.Tensor:
    """Token ids clear of the special ones (0, 1, 2: padding, start, end in the tiny config)."""
    return torch.randint(3, _VOCAB, shape, generator=generator)


def _real_tokens(row: int) -> int:
    """How many labels row ``row`` counts: very uneven (1 to all of them), so micro-batches of 8 rows the
    Trainer draws at random count different items."""
    return (1, SEQUENCE_LENGTH, 2, SEQUENCE_LENGTH - 1, 3, 5)[row % 6]


def _token_labels(generator: torch.Generator, row: int, classes: int, shift: bool) -> torch.Tensor:
    """One row's labels, the first few real and the rest -100; a causal LM's first label is never a target
    (the loss shifts), so it gets one more."""
    real = min(SEQUENCE_LENGTH, _real_tokens(row) + (1 if shift else 0))
    labels = torch.full((SEQUENCE_LENGTH,), -100)
    labels[:real] = torch.randint(0, classes, (real,), generator=generator)
    return labels


def _sequence_label(generator: torch.Generator, row: int) -> torch.Tensor:
    """One label a row, -100 (ignored, not counted) on every third row: per-sequence items, uneven."""
    if row % 3 == 2:
        return torch.tensor(-100)
    return torch.randint(0, 2, (), generator=generator)


def _row(family: str, generator: torch.Generator, row: int) -> dict[str, torch.Tensor]:
    """One training row for a head of ``family``."""
    ids = _token_ids(generator, SEQUENCE_LENGTH)
    mask = torch.ones(SEQUENCE_LENGTH, dtype=torch.long)
    if family == "multiple choice":
        return {
            "input_ids": _token_ids(generator, CHOICES, SEQUENCE_LENGTH),
            "attention_mask": torch.ones(CHOICES, SEQUENCE_LENGTH, dtype=torch.long),
            "labels": _sequence_label(generator, row),
        }
    if family == "sequence classification":
        return {"input_ids": ids, "attention_mask": mask, "labels": _sequence_label(generator, row)}
    if family == "question answering":
        start = torch.randint(0, SEQUENCE_LENGTH - 1, (), generator=generator)
        end = torch.randint(int(start), SEQUENCE_LENGTH, (), generator=generator)
        return {"input_ids": ids, "attention_mask": mask, "start_positions": start, "end_positions": end}
    classes = 2 if family == "token classification" else _VOCAB
    labels = _token_labels(generator, row, classes, shift=family == "causal LM")
    if family in ("causal LM", "masked LM", "pre-training"):
        labels = torch.where(labels == -100, labels, labels.clamp(min=3))  # no special token as a target
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def family_rows(family: str, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """The training rows of a head of ``family`` (one of :data:`FAMILIES`' names), drawn from ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    return [_row(family, generator, row) for row in range(ROWS)]

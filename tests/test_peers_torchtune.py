"""torchtune's full fine-tune recipe under gradient accumulation, its ``train()`` loop
audited (equiv.peers.torchtune).  Needs torchtune and torchao (``pip install equiv[torchtune]``;
``tox -e peers-torchtune``) and skips with the reason without them."""

from __future__ import annotations

import importlib.util

import pytest

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(package) is None for package in ("torchtune", "torchao")),
    reason="needs torchtune and torchao (pip install equiv[torchtune]; tox -e peers-torchtune)",
)


def test_the_recipe_is_equivalent_when_each_sequences_first_label_is_masked() -> None:
    from equiv.peers.torchtune import full_finetune_run

    audited = full_finetune_run(first_label_masked=True)["documented"]
    assert len(audited.windows) == 3 and audited, audited.summary()
    assert any(len(set(window.items)) > 1 for window in audited.windows)  # unequal token counts: it could fail


def test_the_recipe_counts_the_labels_before_its_shift() -> None:
    from equiv.peers.torchtune import full_finetune_run

    audits = full_finetune_run(first_label_masked=False)
    documented, unshifted = audits["documented"], audits["unshifted count"]
    # Every window's micro-batches hold different numbers of sequences' first labels per token: all flagged ...
    assert [window.equivalent for window in documented.windows] == [False] * 3, documented.summary()
    # ... and the normaliser the recipe used (labels counted before the shift) explains every step.
    assert len(unshifted.windows) == 3 and unshifted, unshifted.summary()

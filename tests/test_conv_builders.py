"""The conv model builders take their shared layer keywords as one spec (``**layers``, issue 43):
a misspelt keyword is refused as a signature would refuse it, and lists read back from JSON build the
same layers as tuples."""

from __future__ import annotations

import pytest

from equiv.cases.models import build_model


@pytest.mark.parametrize("family", ["conv1d", "conv2d"])
def test_a_conv_builder_refuses_an_unknown_keyword_by_its_own_name(family: str) -> None:
    # The layer keywords travel as **layers into a spec: a misspelt one is still refused as a
    # signature would refuse it, naming the builder and the keyword.
    with pytest.raises(ValueError, match=rf"{family}\(\) got an unexpected keyword argument 'chanels'"):
        build_model(family, 0, chanels=(2,))


@pytest.mark.parametrize("family", ["conv1d", "conv2d"])
def test_a_conv_builder_takes_its_channels_as_a_list_too(family: str) -> None:
    # model_kwargs read back from JSON hold lists: the same layers, the same weights.
    from_json = build_model(family, 3, channels=[2, 4], norm="group", dropout=0.25)
    in_code = build_model(family, 3, channels=(2, 4), norm="group", dropout=0.25)
    assert repr(from_json.module) == repr(in_code.module)
    for drawn, written in zip(from_json.module.parameters(), in_code.module.parameters(), strict=True):
        assert drawn.equal(written)
    assert [type(layer).__name__ for layer in in_code.module.children()][:4] == [
        "Conv1d" if family == "conv1d" else "Conv2d",
        "GroupNorm",
        "Tanh",
        "Dropout1d" if family == "conv1d" else "Dropout2d",
    ]

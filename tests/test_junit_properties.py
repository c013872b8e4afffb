"""equiv's pytest plugin writes what equiv.testing.assert_equivalent found into ``pytest --junitxml`` (issue 36).

A fresh pytest in a temporary folder (pytester, in a subprocess), as a user's CI runs it.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest

from equiv.pytest_plugin import PROPERTIES

pytest_plugins = ["pytester"]

TESTS = """
import pytest
import equiv, equiv.testing

UNEVEN = equiv.Case(batch_size=8, micro_batch_sizes=(1, 3, 4), model="scalar_linear", data="toy_2x", steps=1)
CLIPPED = UNEVEN.replace(max_grad_norm=0.05)

def textbook(model, optimizer, micro_batches, loss_fn):
    optimizer.zero_grad()
    for x, y in micro_batches:
        (loss_fn(model(x), y) / len(micro_batches)).backward()
    optimizer.step()

def test_fails():
    equiv.testing.assert_equivalent(textbook, UNEVEN)

def test_passes():
    equiv.testing.assert_equivalent(equiv.accumulator_step, UNEVEN)

def test_not_applicable():
    equiv.testing.assert_equivalent(textbook, CLIPPED)

def test_without_equiv():
    assert True
"""


def test_junit_xml_carries_the_status_kind_tier_and_worst_ratio(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_ci=TESTS)
    result = pytester.runpytest_subprocess("--junitxml=junit.xml", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, failed=1, skipped=1)
    cases = {
        case.get("name"): {prop.get("name"): prop.get("value") for prop in case.iter("property")}
        for case in ET.parse(pytester.path / "junit.xml").getroot().iter("testcase")
    }
    failed, passed = cases["test_fails"], cases["test_passes"]
    assert list(failed) == list(PROPERTIES)
    assert (failed["equiv_checks"], failed["equiv_status"], failed["equiv_kind"]) == (
        "1",
        "not_equivalent",
        "not_equivalent",
    )
    assert failed["equiv_failure_kind"] == "mean of means"
    assert failed["equiv_tier"] in ("exact", "noise") and float(failed["equiv_worst_ratio"]) > 1
    assert failed["equiv_case"].startswith("Case(batch_size=8, micro_batch_sizes=(1, 3, 4)")
    assert (passed["equiv_status"], passed["equiv_kind"], passed["equiv_failure_kind"]) == (
        "equivalent",
        "equivalent",
        "",
    )
    assert passed["equiv_tier"] in ("exact", "noise") and 0 <= float(passed["equiv_worst_ratio"]) <= 1
    assert cases["test_not_applicable"]["equiv_status"] == "not_applicable"
    assert cases["test_without_equiv"] == {}  # a test that asserted nothing of equiv gets no properties

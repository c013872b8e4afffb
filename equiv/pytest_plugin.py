"""equiv's pytest plugin (entry point ``pytest11``: loaded by pytest wherever equiv is installed).

- registers equiv's Hypothesis profiles (``--hypothesis-profile equiv-ci``,
  ``equiv-dev``, ``equiv-thorough``: :mod:`equiv.checking.profiles`);
- parametrises a test that asks for the ``equiv_case`` fixture with the
  standard cases, one test per case, its name as id (see :mod:`equiv.testing`
  for the assertion that skips a case the step cannot take).

Disable with ``-p no:equiv``.
"""

from __future__ import annotations

import pytest

from equiv.cases.standard import STANDARD_CASES
from equiv.checking.profiles import register_profiles

__all__ = ["FIXTURE"]

#: The fixture a test asks for to run once per standard case.
FIXTURE = "equiv_case"


def pytest_configure(config: pytest.Config) -> None:
    register_profiles()


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if FIXTURE in metafunc.fixturenames:
        metafunc.parametrize(FIXTURE, list(STANDARD_CASES.values()), ids=list(STANDARD_CASES))

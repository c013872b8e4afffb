"""What the unit tests share: one torch thread, the ``device`` fixture, the skip
of CUDA-only tests, one ``-ra`` line per module and reason for skips, and the
CLI tests' ``steps_file``.

A test marked ``peers("transformers", ...)`` needs those packages of the peers extras: it is skipped
without them, except where ``EQUIV_REQUIRE_PEERS=1`` (``tox -e peers``, which installs them and runs
``-m peers``): there a missing package fails the test, so no trainer path goes untested in CI.

A test marked ``deepspeed`` needs DeepSpeed: skipped without it, except where ``EQUIV_REQUIRE_DEEPSPEED=1``
(``tox -e deepspeed``, which installs it and runs ``-m deepspeed``), where its absence fails the test.

A test marked ``cuda`` needs nothing else: without a visible CUDA device it is
skipped here, with :data:`NO_CUDA` as its reason (a module of CUDA tests only,
tests/test_cuda.py, skips itself whole at import, one skip instead of hundreds).
"""

import importlib.util
import os
from pathlib import Path

import pytest
import torch

# Small models: one thread is fastest and keeps a 2-core machine responsive.
torch.set_num_threads(1)

#: Why a test marked ``cuda`` is skipped (tests/test_cuda.py says the same).
NO_CUDA = "needs a CUDA device; none is visible"

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("cuda") is not None and not torch.cuda.is_available():
        pytest.skip(NO_CUDA)
    needs = item.get_closest_marker("peers")
    missing = [package for package in (needs.args if needs else ()) if importlib.util.find_spec(package) is None]
    if missing:
        reason = f"needs {', '.join(missing)} (pip install equiv[peers]; tox -e peers runs it)"
        if os.environ.get("EQUIV_REQUIRE_PEERS") == "1":
            pytest.fail(f"{reason}, and EQUIV_REQUIRE_PEERS=1 says this environment has them")
        pytest.skip(reason)
    if item.get_closest_marker("deepspeed") is not None and importlib.util.find_spec("deepspeed") is None:
        reason = "needs DeepSpeed (pip install 'equiv[deepspeed]'; tox -e deepspeed runs it)"
        if os.environ.get("EQUIV_REQUIRE_DEEPSPEED") == "1":
            pytest.fail(f"{reason}, and EQUIV_REQUIRE_DEEPSPEED=1 says this environment has it")
        pytest.skip(reason)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> pytest.TestReport:
    """A skip is reported at its module rather than its line, so ``-ra`` folds a
    module's skips with one reason into one line (``SKIPPED [9] tests/test_toy_case.py:
    needs a CUDA device; none is visible``) instead of one per test function."""
    report: pytest.TestReport = yield
    if report.skipped and not hasattr(report, "wasxfail") and isinstance(report.longrepr, tuple):
        report.longrepr = (str(item.path), None, report.longrepr[2])
    return report


@pytest.fixture
def steps_file(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    """The test module's ``STEPS`` source written to ``my_steps.py`` in the test's
    own folder, for the command line to load (``equiv check my_steps.py:name``)."""
    path = tmp_path / "my_steps.py"
    path.write_text(request.module.STEPS)
    return path

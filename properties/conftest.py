"""Property suites: one torch thread, and a record of the run for the report.

At the end of the session the outcome and duration of every property, with
the Hypothesis profile and its max_examples, go to reports/properties.json
(gitignored), which ``equiv report equivalence`` tabulates (``equiv.reporting.equivalence``).
"""

import json
import os
from pathlib import Path

import pytest
import torch
from hypothesis import settings

# Small models: one thread per process is fastest and keeps 2 cores responsive.
torch.set_num_threads(1)

RECORD = Path(__file__).resolve().parent.parent / "reports" / "properties.json"
_results: dict[str, dict[str, object]] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        _results[report.nodeid] = {"outcome": report.outcome, "seconds": round(report.duration, 2)}


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if not _results:
        return
    RECORD.parent.mkdir(parents=True, exist_ok=True)
    RECORD.write_text(
        json.dumps(
            {
                "profile": os.environ.get("HYPOTHESIS_PROFILE", "dev"),
                "max_examples": settings.default.max_examples,
                "derandomize": settings.default.derandomize,
                "tests": dict(sorted(_results.items())),
            },
            indent=2,
        )
        + "\n"
    )

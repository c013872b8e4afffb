"""Hypothesis profiles for every suite, chosen with HYPOTHESIS_PROFILE.

- dev (default outside tox): quick feedback, random, example database on.
- ci: derandomized, so a CI run is deterministic and reproducible; no
  database (derandomize implies none; passing both raises).
- thorough: many examples, for long hunts.
deadline=None throughout: torch code has warm-up costs that are not bugs.
"""

import os

from hypothesis import HealthCheck, settings

settings.register_profile("dev", max_examples=30, deadline=None)
settings.register_profile(
    "ci",
    max_examples=60,
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("thorough", max_examples=2000, deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))

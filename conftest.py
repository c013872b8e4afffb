"""Hypothesis profiles for every suite, chosen with HYPOTHESIS_PROFILE.

The profiles are equiv's own (equiv.checking.profiles: dev, ci, thorough),
shipped in the package as ``equiv-dev`` / ``equiv-ci`` / ``equiv-thorough``;
the repository's suites also know them by their short names, so tox's
``HYPOTHESIS_PROFILE=ci`` loads equiv's ci profile (derandomized, no database).
"""

import os

from hypothesis import settings

from equiv.checking.profiles import PROFILES

for _name, _kwargs in PROFILES.items():
    settings.register_profile(_name, **_kwargs)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))

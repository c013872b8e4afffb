"""equiv's Hypothesis profiles, shipped in the package: ``dev``, ``ci``, ``thorough``.

- dev: quick feedback, random, Hypothesis's example database on;
- ci: derandomized (the same cases every run, on every machine: equiv's
  searches are steered by pass / fail only), no database;
- thorough: many examples, for long hunts.

``deadline=None`` throughout: torch code has warm-up costs that are not bugs.
No "explain" phase in any of them (:data:`PHASES`): after a failure it reruns the
shrunk case dozens of times to say which draws matter, which equiv's verdict
already says; on a check of a few seconds it took ~110 s of the ~150 s a failing
``@given(equiv.strategies.cases_for(step))`` test ran.

Registered with Hypothesis as ``equiv-dev``, ``equiv-ci`` and
``equiv-thorough`` when this module is imported (``import equiv`` does, and
so does equiv's pytest plugin: ``pytest --hypothesis-profile equiv-ci`` works
in any project), so they never replace a profile of the user's, nor
Hypothesis's own built-in ``ci`` (which it loads by itself when ``CI`` is
set).  ``equiv verify --profile`` and ``verify(profile=...)`` take the short
names; any other registered profile is taken by its full name.
"""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, Phase, settings
from hypothesis.errors import InvalidArgument

__all__ = ["PHASES", "PREFIX", "PROFILES", "profile_name", "profile_settings", "register_profiles"]

#: Hypothesis's phases less "explain" (see the module docstring): every equiv profile runs these.
PHASES: tuple[Phase, ...] = tuple(phase for phase in Phase if phase is not Phase.explain)

#: Short name -> the settings' keyword arguments.
PROFILES: dict[str, dict[str, Any]] = {
    "dev": {"max_examples": 30, "deadline": None, "phases": PHASES},
    "ci": {
        "max_examples": 60,
        "deadline": None,
        "derandomize": True,
        "database": None,  # derandomize implies none; passing both raises
        "print_blob": True,
        "suppress_health_check": [HealthCheck.too_slow],
        "phases": PHASES,
    },
    "thorough": {"max_examples": 2000, "deadline": None, "print_blob": True, "phases": PHASES},
}
#: What equiv's profiles are called among Hypothesis's.
PREFIX = "equiv-"


def register_profiles() -> None:
    """Register ``equiv-dev``, ``equiv-ci`` and ``equiv-thorough`` (idempotent)."""
    for name, kwargs in PROFILES.items():
        settings.register_profile(PREFIX + name, **kwargs)


def profile_name(name: str) -> str:
    """The registered name of ``name``: equiv's own for a short name ("ci" ->
    "equiv-ci"), else ``name`` itself if Hypothesis knows it.  Raises
    ``InvalidArgument`` naming the choices for an unknown one."""
    if name in PROFILES:
        return PREFIX + name
    try:
        settings.get_profile(name)
    except InvalidArgument:
        raise InvalidArgument(
            f"unknown Hypothesis profile {name!r}: equiv's are {', '.join(PROFILES)} "
            "(or a profile you registered with hypothesis.settings.register_profile)"
        ) from None
    return name


def profile_settings(name: str) -> settings:
    """The settings of profile ``name`` (see :func:`profile_name`)."""
    return settings.get_profile(profile_name(name))


register_profiles()

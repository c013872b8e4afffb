"""The claim every quality suite makes of a bug of the zoo, in one place: the
search FINDS it (a mismatch, not a crash), shrinks it to a case the suite
describes, the shrunk case replays, and without the setting that exposes the
bug the same case passes."""

from collections.abc import Callable
from typing import Any

import equiv
from equiv.checking.verify import VerifyResult, verify


def assert_found_and_shrunk(
    name: str,
    bug: Callable[..., Any],
    shrunk: Callable[[equiv.Case], bool],
    *,
    without: Callable[[equiv.Case], equiv.Case] | None = None,
    result: VerifyResult | None = None,
    **verify_kwargs: Any,
) -> equiv.Case:
    """``result``: a search already run; else ``verify(bug, **verify_kwargs)`` with
    no fresh-process replay (a torch import, seconds per search: the zoo's bugs
    keep no state, and the shrunk case is replayed here in process)."""
    if result is None:
        result = verify(bug, replay_in_fresh_process=False, **verify_kwargs)
    assert result.found, f"no counterexample to {name} in {result.examples} cases"
    assert result.verdict is not None, result.message()  # a mismatch, not a crash
    assert result.verdict.status == "not_equivalent"
    case = result.counterexample
    assert case is not None and shrunk(case), f"{name} shrank to {case!r}"
    # The shrunk case replays: checking it directly gives the same verdict.
    assert not equiv.check(bug, case)
    if without is not None:  # and without its setting the bug is exact again
        equiv.check(bug, without(case)).assert_ok()
    return case

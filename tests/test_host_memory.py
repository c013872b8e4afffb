"""The ``equiv`` command keeps freed host memory for reuse (glibc's mallopt); off on request.

Run in a child process: the setting holds for the rest of a process, and the
test session's own allocations should stay as they come.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# Two fresh interpreters importing equiv (and torch): seconds, so tox -e slow runs it.
pytestmark = pytest.mark.slow

_PROBE = "from equiv.host_memory import keep_freed_host_memory; print(keep_freed_host_memory())"


def _probe(**env: str) -> str:
    return subprocess.run(
        [sys.executable, "-c", _PROBE], env={**os.environ, **env}, capture_output=True, text=True, check=True
    ).stdout.strip()


def _glibc() -> bool:
    return "CS_GNU_LIBC_VERSION" in getattr(os, "confstr_names", {}) and bool(os.confstr("CS_GNU_LIBC_VERSION"))


@pytest.mark.skipif(not _glibc(), reason="mallopt is glibc's")
def test_glibc_is_told_to_keep_freed_memory_unless_turned_off() -> None:
    assert _probe().startswith("glibc malloc keeps freed memory (M_MMAP_THRESHOLD=33554432")
    assert _probe(EQUIV_KEEP_FREED_MEMORY="0") == "None"

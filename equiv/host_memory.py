"""Keep freed host memory for reuse: what the ``equiv`` command sets for itself.

A check builds and frees several copies of the model and its optimizer state
(the float64 truth, the floor samples, the candidate's runs).  glibc's malloc
serves each large buffer with a fresh ``mmap`` and hands it back to the kernel
when freed, so every run touches new pages and pays a page fault per 4 KiB
page on first write.  Measured on this project's check-scaling benchmark
(4M-parameter MLP, one thread): about a quarter of a check's time was page
faults, and a passing check went from 11.6x to 8.7x the candidate's own
float32 steps with freed memory kept (``pytest benchmarks/test_check_scaling.py
--benchmark-only -k 4M``, with and without :func:`keep_freed_host_memory`).

PyTorch's CPU performance guide recommends a caching allocator (jemalloc,
TCMalloc) for the same reason
(https://pytorch.org/tutorials/recipes/recipes/tuning_guide.html, "Switch
Memory allocator").  Without changing the allocator, glibc can be told to
serve buffers up to its largest threshold (32 MiB on 64-bit) from its heap
and to keep freed memory there: ``mallopt(M_MMAP_THRESHOLD)`` and
``mallopt(M_TRIM_THRESHOLD)``.  The cost is that the process keeps its peak
resident size until it exits, which suits a command that checks and exits;
the Python API leaves the allocator alone unless asked.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

__all__ = ["KEEP_FREED_MEMORY_ENV", "keep_freed_host_memory"]

#: Set to 0 to leave glibc's malloc as it is in the ``equiv`` command.
KEEP_FREED_MEMORY_ENV = "EQUIV_KEEP_FREED_MEMORY"
# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
#: glibc refuses a larger mmap threshold on 64-bit (HEAP_MAX_SIZE / 2).
_LARGEST_MMAP_THRESHOLD = 32 * 2**20
_NEVER_TRIM = 2**31 - 1


def keep_freed_host_memory() -> str | None:
    """Have glibc's malloc keep freed buffers of up to 32 MiB for reuse
    (see the module's docstring).  Returns what was set, or None where it
    does not apply: not Linux with glibc, or ``EQUIV_KEEP_FREED_MEMORY=0``."""
    if os.environ.get(KEEP_FREED_MEMORY_ENV, "1") == "0" or not sys.platform.startswith("linux"):
        return None
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and others have no mallopt
        return None
    if not (mallopt(_M_MMAP_THRESHOLD, _LARGEST_MMAP_THRESHOLD) and mallopt(_M_TRIM_THRESHOLD, _NEVER_TRIM)):
        return None
    return f"glibc malloc keeps freed memory (M_MMAP_THRESHOLD={_LARGEST_MMAP_THRESHOLD}, M_TRIM_THRESHOLD=never)"

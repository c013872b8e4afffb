"""How many CPU threads a check runs with: one on small cases, unless the user said.

A check runs many tiny steps (a few thousand parameters, a handful of samples):
each operation is too small to split across threads, and torch's default (one
OpenMP thread per core) makes every operation wait at a barrier for all of them.
On a machine where other work holds a core, a waiting thread spins until that
core is free, and tiny steps become many times slower.  Measured for issue 36
on a 2-core machine with one core held by a busy loop (``python -c 'while True:
pass'``), alternating in the same minutes: ``equiv verify
equiv.accumulator:accumulator_step --max-examples 100 --seed 0`` took 785,
1119 and 930 ms per case with torch's default 2 threads, 127, 122 and 135 ms
with ``OMP_NUM_THREADS=1`` (benchmarks/test_verify_threads.py measures it side
by side).

The rule, for the duration of a ``check`` / ``verify`` (and the ``equiv`` command's):

1. ``threads=N`` (``--threads N``): N threads.
2. ``OMP_NUM_THREADS`` set in the environment: torch's count as it is (the user chose it).
3. every case small (its model at most :data:`SMALL_MODEL_PARAMETERS` parameters,
   as every standard and drawn case is): one thread.
4. otherwise torch's count as it is (a model large enough to gain from threads).

The count in force before is restored afterwards, whatever happened.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch

from equiv.cases.case import Case

__all__ = ["SMALL_MODEL_PARAMETERS", "THREADS_ENV", "chosen_threads", "running_threads"]

#: A case whose model has at most this many parameters runs on one thread (the
#: standard and drawn cases' models have at most a few thousand): its matrix
#: products are far below the size where splitting them across threads pays.
SMALL_MODEL_PARAMETERS = 1_000_000
#: The environment variable that, when set, leaves torch's thread count to the user.
THREADS_ENV = "OMP_NUM_THREADS"


def chosen_threads(threads: int | None = None, cases: Iterable[Case] | None = None) -> int | None:
    """The thread count a check of ``cases`` runs with, by the module's rule.

    Args:
        threads: the user's explicit count (``--threads``), or None.
        cases: the cases to be checked; None for equiv's own drawn cases (small by construction).

    Returns:
        The count to set, or None to leave torch's as it is.

    Raises:
        ValueError: ``threads`` is not a whole number of at least 1.
    """
    if threads is not None:
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads must be a whole number >= 1 (or None: equiv chooses), got {threads!r}")
        return threads
    if os.environ.get(THREADS_ENV, "").strip():
        return None
    if cases is None or all(_is_small(case) for case in cases):
        return 1
    return None


@contextmanager
def running_threads(count: int | None) -> Iterator[None]:
    """Run the body with ``torch.set_num_threads(count)`` (None: unchanged), then restore the count before.

    Args:
        count: what :func:`chosen_threads` returned.
    """
    before = torch.get_num_threads()
    if count is None or count == before:
        yield
        return
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _is_small(case: Case) -> bool:
    """Whether the case's model has at most :data:`SMALL_MODEL_PARAMETERS` parameters.  A model
    that cannot be built is left to the check, which builds it again and reports why."""
    try:
        module = case.build_model().module
    except Exception:  # the check itself raises it, where it always has, with its own message
        return False
    return sum(p.numel() for p in module.parameters()) <= SMALL_MODEL_PARAMETERS

"""A wall-clock limit on a check, so a step that hangs ends the check instead of the user's patience.

:func:`deadline` arms ``SIGALRM`` for the block: when the time is up, the
signal handler raises :class:`CheckTimeout` in the main thread wherever it is.
Python code is interrupted at once (a ``time.sleep`` too); a step stuck inside
one C call (a deadlocked collective) is interrupted when that call returns to
Python, which the command line backs up with a watchdog that ends the process
(``equiv.cli``).  Where no ``SIGALRM`` exists (Windows) or off the main thread
the block runs unlimited.  A ``SIGALRM`` handler of the caller's is put back
afterwards (its pending timer is not).

:func:`counting_interrupts` tells a real Ctrl-C from a ``KeyboardInterrupt`` the
step raised itself: while it is armed, every ``SIGINT`` the process receives is
counted (:func:`interrupts_received`) before the handler that was there runs.  A
``KeyboardInterrupt`` with no ``SIGINT`` counted meanwhile is the step's own.
"""

from __future__ import annotations

import contextlib
import math
import signal
import threading
import time
from collections.abc import Iterator
from types import FrameType

__all__ = ["DEFAULT_TIMEOUT_S", "CheckTimeout", "counting_interrupts", "deadline", "interrupts_received"]

#: Seconds one case's check may take by default: the standard cases take well under
#: one; a 124M-parameter model checks in about a minute on a CPU.
DEFAULT_TIMEOUT_S = 300.0


class CheckTimeout(TimeoutError):
    """The wall-clock limit of a check passed."""

    def __init__(self, seconds: float, detail: str = "") -> None:
        super().__init__(detail or f"the check took over its limit of {seconds:g} s")
        self.seconds = seconds


def _can_alarm() -> bool:
    return hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def deadline(seconds: float | None) -> Iterator[float]:
    """Raise :class:`CheckTimeout` inside the block once ``seconds`` have passed
    (None or ``inf``: no limit).  Yields the block's start (``time.monotonic()``)."""
    started = time.monotonic()
    if seconds is not None and (math.isnan(seconds) or seconds <= 0):
        raise ValueError(f"timeout must be a positive number of seconds or None, got {seconds!r}")
    if seconds is None or math.isinf(seconds) or not _can_alarm():
        yield started
        return

    def expire(signum: int, frame: FrameType | None) -> None:
        raise CheckTimeout(seconds)

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield started
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


#: SIGINTs received inside :func:`counting_interrupts` blocks, in this process.
_interrupts = 0


def interrupts_received() -> int:
    """How many ``SIGINT`` (Ctrl-C) this process has received while :func:`counting_interrupts`
    was armed: compare it before and after a call to tell whether a ``KeyboardInterrupt``
    raised in the call came from the user's Ctrl-C (the count moved) or from the code itself."""
    return _interrupts


@contextlib.contextmanager
def counting_interrupts() -> Iterator[None]:
    """Count every ``SIGINT`` received in the block, then hand it to the handler that was
    there (Python's: raise ``KeyboardInterrupt``), so a Ctrl-C still interrupts as before.
    Off the main thread (no signal reaches it) the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)

    def received(signum: int, frame: FrameType | None) -> None:
        global _interrupts
        _interrupts += 1
        if callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:  # the default action (or a handler set outside Python): interrupt
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, received)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous if previous is not None else signal.default_int_handler)

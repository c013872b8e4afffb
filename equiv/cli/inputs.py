"""The command line's values, read and checked before any work: the step to check (``MODULE:FUNC``),
a ``--case``, an output path, and the argparse types of the flags (counts, seconds, names, splits, byte
sizes); a bad one is a :class:`~equiv.cli.common.UsageError` or argparse's one-line error.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from equiv.cases.case import Case, InvalidCase
from equiv.cli.common import UsageError
from equiv.judging.contract import load_candidate


def load_target(spec: str) -> Callable[..., Any]:
    """``package.module:func`` or ``path/to/file.py:func`` -> the callable
    (:func:`equiv.judging.contract.load_candidate`; a bad spec is a usage error).

    Args:
        spec: ``package.module:func`` or ``path/to/file.py:func``.

    Returns:
        The callable it names.
    """
    try:
        return load_candidate(spec)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc


def _parse_case(text: str, allow_imports: Sequence[str] = ()) -> Case:
    if text.startswith("@"):
        try:
            text = Path(text[1:]).read_text()
        except OSError as exc:
            raise UsageError(f"cannot read the --case file {text[1:]!r}: {exc.strerror or exc}") from None
    try:
        return Case.from_dict(json.loads(text), allow_imports=allow_imports)
    except json.JSONDecodeError as exc:
        raise UsageError(f"--case is not valid JSON ({exc}): {text[:80]!r}") from None
    except (InvalidCase, TypeError, KeyError) as exc:
        raise UsageError(f"--case does not describe a case: {exc}") from None


def _output(path: str | Path | None, flag: str) -> Path | None:
    """An output path checked before any work (a run must not end on a path it cannot write):
    its folder exists, it is not itself a folder, and it opens for writing.  Opening it is the
    only honest test: ``os.access`` says yes to root everywhere, and ``/proc`` or a read-only
    mount refuses a file its permission bits would allow.  A file that was not there is
    removed again; one that was is opened for appending, its content untouched."""
    if path is None:
        return None
    out = Path(path)
    folder = out.parent if str(out.parent) else Path(".")
    if out.is_dir():
        raise UsageError(f"{flag} {str(out)!r} is a folder; give a file path")
    if not folder.is_dir():
        raise UsageError(f"{flag} {str(out)!r}: the folder {str(folder)!r} does not exist (create it first)")
    existed = out.exists()
    try:
        with out.open("a" if existed else "x"):
            pass
    except OSError as exc:
        what = "opened for writing" if existed else f"created in the folder {str(folder)!r}"
        raise UsageError(f"{flag} {str(out)!r} cannot be {what}: {exc.strerror or exc}") from None
    if not existed:
        out.unlink()
    return out


def _timeout(seconds: float) -> float | None:
    if math.isnan(seconds) or seconds < 0:
        raise UsageError(f"--timeout must be a number of seconds >= 0 (0: no limit), got {seconds:g}")
    return seconds or None


def _names(text: str) -> tuple[str, ...]:
    """A comma-separated list flag (``--families mlp,conv1d``); an empty one is refused
    (leaving the flag out is how to ask for the default, never an empty value)."""
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    if not names:
        raise argparse.ArgumentTypeError(f"expected comma-separated names, got {text!r}")
    return names


def _positive_int(text: str) -> int:
    """A count flag (``--global-batch-size 64``): a whole number of at least 1.  Zero is
    refused, never read as "the default" (leave the flag out for that)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {value}")
    return value


def _positive_seconds(text: str) -> float:
    """A time limit that must be finite and above zero (the ranks' own deadline)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}")
    return value


def _split(text: str) -> list[list[int]]:
    """``--split "1,2;3"``: rank 0 holds micro-batches of 1 and 2 samples, rank 1 one of 3."""
    try:
        ranks = [[int(size) for size in rank.split(",")] for rank in text.split(";")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"a split is each rank's micro-batch sizes, ranks separated by ';' (e.g. \"1,2;3\"), got {text!r}"
        ) from None
    return ranks


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_bytes(text: str) -> int:
    """'512MiB', '1.5GB', '1000000' -> bytes (``--budget``'s type).

    Args:
        text: a number with an optional unit among B, KB, MB, GB, KiB, MiB, GiB.

    Returns:
        The number of bytes.
    """
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(
            f"memory budget must be a number with an optional unit among B, KB, MB, GB, KiB, MiB, GiB; got {text!r}"
        )
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])

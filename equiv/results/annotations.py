"""Results as GitHub Actions workflow commands (``equiv check --format github``).

A CI run shows each ``::error file=F,line=L,title=T::message`` line that a step
prints as an annotation on line L of file F, in the run's summary and on a pull
request's diff (https://docs.github.com/actions/reference/workflow-commands-for-github-actions).
equiv points each one at the step's own definition: the code a failing verdict
is about.  One ``::error`` per case that failed (not equivalent, or the step
raised or hung there), one ``::notice`` for a result that passed; a case that
does not apply, or was not run after a hang, is in the printed summary only.

Escaping follows the runner's parser (``@actions/core``'s ``escapeData`` /
``escapeProperty``): ``%``, carriage returns and newlines in the message, and
also ``:`` and ``,`` in a property.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from typing import Any

from equiv.outcomes import Outcome, outcome_words
from equiv.results.protocol import Result
from equiv.results.verdict import CaseVerdicts

__all__ = ["Location", "escape_data", "escape_property", "github_annotations", "step_location"]

#: (file, line) an annotation points at: the step's definition.
Location = tuple[str, int]


def escape_data(text: str) -> str:
    """A workflow command's message, escaped (``%`` first, then CR and LF).

    Args:
        text: the message, any lines.

    Returns:
        One line the runner turns back into ``text``.
    """
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def escape_property(text: str) -> str:
    """A workflow command's property value (``file``, ``title``), escaped: as
    :func:`escape_data`, and ``:`` and ``,`` too (they end a property).

    Args:
        text: the value.

    Returns:
        The value as the runner reads it back.
    """
    return escape_data(text).replace(":", "%3A").replace(",", "%2C")


def step_location(step: Callable[..., Any], cwd: str | None = None) -> Location | None:
    """Where ``step`` is defined: its source file (relative to ``cwd`` when under it) and first line.

    Args:
        step: the step as loaded (a function, a method, a callable object, or wrapped
            by ``functools.wraps``: its original definition).
        cwd: the folder paths are made relative to (default: the current one).

    Returns:
        (file, line), or None when Python cannot tell (a built-in, a step made by ``exec``).
    """
    target = inspect.unwrap(step)
    for candidate in (target, getattr(target, "__func__", None), type(target)):
        if candidate is None:
            continue
        try:
            source = inspect.getsourcefile(candidate)
            _, line = inspect.getsourcelines(candidate)
        except (TypeError, OSError):
            continue
        if source is None:
            continue
        return _relative(source, cwd or os.getcwd()), max(line, 1)
    return None


def github_annotations(
    result: Result, where: Location | None, *, command: str, message: str | None = None
) -> list[str]:
    """The workflow commands for ``result``: an ``::error`` per failing case, or a ``::notice`` if it passed.

    Args:
        result: what a front door returned (:class:`~equiv.results.verdict.CaseVerdicts`: one
            annotation per failing case; any other result: one for the whole result).
        where: the step's definition (:func:`step_location`), or None (no file named).
        command: what ran, for each annotation's title (``"equiv check"``).
        message: the whole result's text when it is not ``result.message()`` (a search's,
            naming its replay commands).

    Returns:
        The lines to print, each one command.
    """
    if result.status is Outcome.EQUIVALENT or (not isinstance(result, CaseVerdicts) and bool(result)):
        return [_command("notice", where, command, result.line())]
    if not isinstance(result, CaseVerdicts):
        outcome = getattr(result, "outcome", None) or result.status  # a search's precision finding told apart
        title = f"{command}: {outcome.label}"
        return [_command("error", where, title, message if message is not None else result.message())]
    lines = []
    for name in result.names:
        if name in result.failed:
            verdict = result.failed[name]
            outcome = getattr(verdict, "outcome", verdict.status)  # a failing precision finding told apart
            failure = getattr(verdict, "failure_kind", None)  # what wrong step it amounts to, where known
            named = f" ({failure.name})" if failure is not None and failure.classified else ""
            lines.append(_command("error", where, f"{command}: {outcome.label}{named}: {name}", verdict.message()))
        elif name in result.errors:
            fault = outcome_words(result.fault(name))
            lines.append(_command("error", where, f"{command}: step error ({fault}): {name}", result.errors[name]))
    return lines or [_command("error", where, f"{command}: {result.status.label}", result.line())]


def _command(level: str, where: Location | None, title: str, message: str) -> str:
    """One GitHub workflow command; ``level`` is the annotation's level ("notice", "error")."""
    properties = [] if where is None else [f"file={escape_property(where[0])}", f"line={where[1]}"]
    properties.append(f"title={escape_property(title)}")
    return f"::{level} {','.join(properties)}::{escape_data(message)}"


def _relative(path: str, cwd: str) -> str:
    """``path`` relative to ``cwd`` when it lies under it (GitHub resolves files from the
    repository's root, where CI runs), else as it is."""
    absolute, root = os.path.abspath(path), os.path.abspath(cwd)
    try:
        inside = os.path.commonpath([absolute, root]) == root
    except ValueError:  # another drive (Windows)
        return absolute
    return os.path.relpath(absolute, root).replace(os.sep, "/") if inside else absolute

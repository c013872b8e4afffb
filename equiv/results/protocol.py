"""The one protocol every front door's result satisfies: :class:`Result`.

``check``, ``verify``, ``check_distributed``, ``verify_distributed``,
``check_pipeline`` and ``audit`` return different things (one verdict, a
search, a verdict per rank, a window per optimizer step), read the same way:

- ``status``: an :class:`~equiv.outcomes.Outcome` (the one vocabulary);
- ``bool(result)``: True only when the result is a pass (``status`` EQUIVALENT);
- ``message()``: the whole readable text; ``line()``: one line of it, which
  starts with the status's label ("equivalent: ...", "not equivalent: ...");
- ``to_dict()``: plain values under the versioned JSON schema :data:`SCHEMA`
  (``equiv/results/schema.json``, :func:`schema`): ``schema``, ``kind`` (which
  result), ``status``, ``line``, then the kind's own fields;
- ``assert_ok()``: raises (:class:`EquivalenceError` for verdicts) with the
  message unless the result passed.

:class:`ResultBase` holds what is the same for every kind (``to_dict``'s
envelope, ``assert_ok``, ``str``); a kind writes ``status``, ``__bool__``,
``message``, ``line`` and its own fields (``_fields``).
"""

from __future__ import annotations

import json
from functools import cache
from importlib import resources
from typing import Any, ClassVar, Protocol, cast, runtime_checkable

from equiv.outcomes import Outcome

__all__ = ["SCHEMA", "EquivalenceError", "Result", "ResultBase", "SearchBase", "headed", "schema"]

#: The version of the JSON every ``to_dict()`` writes (``"schema"``); a change
#: that renames or drops a field, or changes its meaning, is a new version.
SCHEMA = "equiv.result/2"


class EquivalenceError(AssertionError):
    """Raised by ``assert_ok()`` of a result that did not pass; carries the result."""

    def __init__(self, message: str, verdict: Any) -> None:
        super().__init__(message)
        self.verdict = verdict


@runtime_checkable
class Result(Protocol):
    """What every front door's result offers (see the module's docstring)."""

    @property
    def status(self) -> Outcome: ...

    def __bool__(self) -> bool: ...

    def message(self) -> str: ...

    def line(self) -> str: ...

    def to_dict(self) -> dict[str, Any]: ...

    def assert_ok(self) -> None: ...


class ResultBase:
    """The shared half of :class:`Result`: ``to_dict``'s envelope, ``assert_ok`` and ``str``."""

    __slots__ = ()

    #: The kind's name in JSON (``"kind"``): one of the schema's kinds.
    KIND: ClassVar[str] = ""

    def message(self) -> str:
        raise NotImplementedError

    def line(self) -> str:
        raise NotImplementedError

    def _fields(self) -> dict[str, Any]:
        """The kind's own fields of :meth:`to_dict` (after the envelope)."""
        return {}

    def to_dict(self) -> dict[str, Any]:
        """The result as plain values, under the schema :data:`SCHEMA`."""
        status = cast(Result, self).status
        return {"schema": SCHEMA, "kind": self.KIND, "status": status.value, "line": self.line(), **self._fields()}

    def _failure(self) -> AssertionError:
        """What :meth:`assert_ok` raises."""
        return EquivalenceError(self.message(), self)

    def assert_ok(self) -> None:
        """Raise (:class:`EquivalenceError`, with :meth:`message`) unless the result passed."""
        __tracebackhide__ = True
        if not self:
            raise self._failure()

    def __str__(self) -> str:
        return self.message()


class SearchBase(ResultBase):
    """The shared half of a search's result (``equiv.verify``, ``equiv.verify_distributed``):
    truthy when nothing was found; a kind writes what was searched and where it shrank to."""

    __slots__ = ()

    #: What the step raised (or how a rank failed) on the counterexample, if it did.
    error: str | None
    #: Cases that passed with a precision note.
    precision_notes: int
    #: The counterexample's verdict (one with ``detail()``: how far off), None when there is none or it raised.
    verdict: Any

    @property
    def found(self) -> bool:
        raise NotImplementedError

    @property
    def outcome(self) -> Outcome | None:
        """None (nothing found), or the finer outcome of what was."""
        raise NotImplementedError

    @property
    def kind(self) -> Outcome | None:
        """The same as :attr:`outcome`; kept for code written before it."""
        return self.outcome

    def _searched(self) -> str:
        """The candidate and how much was searched, in words."""
        raise NotImplementedError

    def _shrunk(self) -> str:
        """Where the counterexample shrank to, in words (after :meth:`_searched`)."""
        raise NotImplementedError

    def _detail(self) -> str:
        """The counterexample's verdict's detail (how far off), or ""."""
        return "" if self.verdict is None else str(self.verdict.detail())

    @property
    def status(self) -> Outcome:
        """EQUIVALENT (nothing found), STEP_ERROR (the step raised or hung, a rank died) or
        NOT_EQUIVALENT (a counterexample; :attr:`outcome` tells a precision finding apart)."""
        if not self.found:
            return Outcome.EQUIVALENT
        return Outcome.STEP_ERROR if self.error is not None else Outcome.NOT_EQUIVALENT

    def __bool__(self) -> bool:
        return not self.found

    def line(self) -> str:
        """One line: the outcome, the candidate, how much was searched, and what was found."""
        if not self.found:
            notes = f", {self.precision_notes} with a precision note" if self.precision_notes else ""
            return headed(self.status, f"{self._searched()}, no counterexample{notes}")
        found = self._searched() + self._shrunk()
        if self.error is not None:
            return headed(self.status, f"{found}: {(self.error.splitlines() or [''])[0]}")
        return headed(self.outcome or self.status, found + self._detail())


def headed(status: Outcome, text: str) -> str:
    """A one-line result: the status's label, then ``text`` (newlines folded)."""
    return f"{status.label}: " + " ".join(text.split())


@cache
def schema() -> dict[str, Any]:
    """The JSON schema of :meth:`Result.to_dict` (``equiv/results/schema.json``, shipped with the package)."""
    text = resources.files("equiv.results").joinpath("schema.json").read_text(encoding="utf-8")
    loaded: dict[str, Any] = json.loads(text)
    return loaded

"""Where an audit's windows go as they are judged: ``on_window`` callbacks for
:func:`equiv.audit`.

* :func:`jsonl_writer`: each window's ``to_dict()`` (the shared result schema's
  ``window_audit``) appended to a file as one JSON line, as soon as it is judged;
* :func:`tensorboard_writer`: each window's worst ratio and verdict beside the
  loss curve, through a ``torch.utils.tensorboard.SummaryWriter`` (or any object
  with its ``add_scalar`` / ``add_text``: the writers of other trackers that
  mirror it).

Each takes ``then=``, another ``on_window`` called after it, so they chain.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from equiv.auditing.replay import WindowAudit
from equiv.outcomes import Outcome

__all__ = ["OnWindow", "ScalarWriter", "jsonl_writer", "tensorboard_writer"]

#: Hears each audited window's verdict as it is made.
OnWindow = Callable[[WindowAudit], None]


class ScalarWriter(Protocol):
    """What :func:`tensorboard_writer` writes through: ``SummaryWriter``'s two methods."""

    def add_scalar(self, tag: str, scalar_value: Any, global_step: int | None = None) -> Any: ...

    def add_text(self, tag: str, text_string: str, global_step: int | None = None) -> Any: ...


def jsonl_writer(path: str | Path, *, then: OnWindow | None = None) -> OnWindow:
    """An ``on_window`` that appends each window's ``to_dict()`` to ``path`` as one JSON line
    as soon as it is judged (a run that dies keeps what was judged).

    Args:
        path: the file, created if missing, appended to.
        then: another ``on_window``, called with each window after it is written.

    Returns:
        The callback, for ``equiv.audit(..., on_window=...)``.
    """
    target = Path(path)

    def on_window(window: WindowAudit) -> None:
        with target.open("a", encoding="utf-8") as out:
            out.write(json.dumps(window.to_dict()) + "\n")
        if then is not None:
            then(window)

    return on_window


def tensorboard_writer(
    writer: ScalarWriter,
    *,
    tag: str = "equiv/audit",
    global_step: Callable[[WindowAudit], int] | None = None,
    then: OnWindow | None = None,
) -> OnWindow:
    """An ``on_window`` that writes each audited window beside the run's own curves:

    * ``<tag>/worst_ratio``: the worst tensor's greatest difference over its allowance
      (at most 1 when equivalent; a rise towards 1 is drift to watch), for a judged window;
    * ``<tag>/equivalent``: 1 for an equivalent window, 0 for one that is not (not written for
      a window not judged: inherently not equivalent, or a full-batch step that is not finite);
    * ``<tag>/verdict``: the window's one-line verdict as text, for every window that is not
      equivalent or not judged (an equivalent window writes scalars only);
    * ``<tag>/weight_ratio``: for a failing window whose witness recovered the run's weights (issue 44),
      the run's weight of each micro-batch's loss over the full batch's ``1/N``, averaged (1 for the full
      batch; 2 for a loss counted twice; the normaliser is named in the verdict's text).

    Args:
        writer: a ``torch.utils.tensorboard.SummaryWriter`` (or anything with its
            ``add_scalar(tag, value, global_step)`` and ``add_text(tag, text, global_step)``).
        tag: the prefix of the tags.
        global_step: the step to plot a window at (e.g. ``lambda w: trainer.state.global_step``
            read when the window is judged); by default the window's optimizer step counted
            from the audit's start (``window.step``).
        then: another ``on_window``, called with each window after it is written.

    Returns:
        The callback, for ``equiv.audit(..., on_window=...)``.
    """
    if not (callable(getattr(writer, "add_scalar", None)) and callable(getattr(writer, "add_text", None))):
        raise TypeError(
            f"writer must have add_scalar and add_text (a torch.utils.tensorboard.SummaryWriter), "
            f"got {type(writer).__name__}"
        )

    def on_window(window: WindowAudit) -> None:
        step = window.step if global_step is None else global_step(window)
        if window.judged:
            if window.worst is not None and math.isfinite(window.worst.ratio):
                writer.add_scalar(f"{tag}/worst_ratio", window.worst.ratio, step)
            writer.add_scalar(f"{tag}/equivalent", 1.0 if window.status is Outcome.EQUIVALENT else 0.0, step)
        if window.status is not Outcome.EQUIVALENT:
            writer.add_text(f"{tag}/verdict", window.line(), step)
        ratio = None if window.witness is None else window.witness.ratio()
        if ratio is not None and math.isfinite(ratio):
            writer.add_scalar(f"{tag}/weight_ratio", ratio, step)
        if then is not None:
            then(window)

    return on_window

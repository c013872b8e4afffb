"""Audit a training run the user already has: sampled optimizer steps checked
against the full-batch step of the same window, through hooks, with no rewrite
(:func:`audit`, its options :class:`AuditSettings`): the hooks and what a window saw in
:mod:`equiv.auditing.recording`, its judging in :mod:`equiv.auditing.judging` (the replay, a run source
of the engine, in :mod:`equiv.auditing.replay`), the result in :mod:`equiv.results.audit`."""

from equiv.auditing.averaged import ExponentialAverage
from equiv.auditing.replay import RecordedWindow, WindowAudit, judge_window
from equiv.auditing.settings import AuditSettings
from equiv.auditing.trainers import lightning_callback, transformers_callback
from equiv.auditing.watch import Audit, AuditFailure, audit
from equiv.auditing.writers import jsonl_writer, tensorboard_writer

__all__ = [
    "Audit",
    "AuditFailure",
    "AuditSettings",
    "ExponentialAverage",
    "RecordedWindow",
    "WindowAudit",
    "audit",
    "jsonl_writer",
    "judge_window",
    "lightning_callback",
    "tensorboard_writer",
    "transformers_callback",
]

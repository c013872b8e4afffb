"""Audit a training run the user already has: sampled optimizer steps checked
against the full-batch step of the same window, through hooks, with no rewrite
(:func:`audit`; the replay and judgement in :mod:`equiv.auditing.replay`)."""

from equiv.auditing.replay import RecordedWindow, WindowAudit, judge_window
from equiv.auditing.trainers import lightning_callback, transformers_callback
from equiv.auditing.watch import Audit, AuditFailure, audit, jsonl_writer

__all__ = [
    "Audit",
    "AuditFailure",
    "RecordedWindow",
    "WindowAudit",
    "audit",
    "jsonl_writer",
    "judge_window",
    "lightning_callback",
    "transformers_callback",
]

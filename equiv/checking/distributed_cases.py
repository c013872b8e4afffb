"""Distributed cases checked one after another: ``equiv check-distributed``'s loop and
the search's one case, a rank fault kept as data beside the verdicts.

:func:`check_distributed_case` is one case: a :class:`DistributedVerdict`, or the
:class:`RankFault` of ranks that raised, hung, died or mismatched their collectives
(:func:`equiv.verify_distributed` judges each drawn case with it).
:func:`check_distributed_cases` runs named cases in order (the CLI's standard
splits, or its ``--split``), stopping after a hang (each remaining case would wait
out the timeout again) or, where ``stop_on_fault``, after any fault (under torchrun
a fault may leave a rank mid-collective).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from equiv.checking.distributed import DistributedCase, DistributedVerdict, check_distributed
from equiv.distributed.engines import DEFAULT_ENGINE
from equiv.distributed.launcher import DistributedCheckError, Launcher, run_on_ranks
from equiv.judging.contract import Candidate
from equiv.outcomes import Fault
from equiv.results.verdict import CaseVerdicts

__all__ = ["CaseLoop", "RankFault", "check_distributed_case", "check_distributed_cases"]


@dataclass(frozen=True)
class RankFault:
    """Ranks that gave no verdict on a case: what they said, and which fault it was."""

    #: The launcher's report (which rank, how, the case).
    error: str
    fault: Fault
    cause: DistributedCheckError


def check_distributed_case(
    candidate: Candidate,
    dcase: DistributedCase,
    *,
    engine: str = DEFAULT_ENGINE,
    timeout_s: float = 120.0,
    train_dtype: torch.dtype | str | None = None,
    strict: bool = False,
    launcher: Launcher = run_on_ranks,
) -> DistributedVerdict | RankFault:
    """:func:`~equiv.checking.distributed.check_distributed` on one case, a rank fault returned, not raised.

    Args:
        candidate, dcase, engine, timeout_s, train_dtype, strict, launcher: as
            :func:`~equiv.checking.distributed.check_distributed` takes them.

    Returns:
        The case's verdict, or the :class:`RankFault` of ranks that raised, hung, died
        or mismatched their collectives.

    Raises:
        As :func:`~equiv.checking.distributed.check_distributed` does for what no rank could run.
    """
    try:
        return check_distributed(
            candidate,
            dcase,
            engine=engine,
            timeout_s=timeout_s,
            train_dtype=train_dtype,
            strict=strict,
            launcher=launcher,
        )
    except DistributedCheckError as exc:
        return RankFault(str(exc), exc.fault, exc)


@dataclass(frozen=True)
class CaseLoop:
    """How :func:`check_distributed_cases` runs its cases (the keywords of :func:`check_distributed_case`,
    and when it stops)."""

    engine: str = DEFAULT_ENGINE
    timeout_s: float = 120.0
    train_dtype: torch.dtype | str | None = None
    strict: bool = False
    launcher: Launcher = run_on_ranks
    #: Skip the remaining cases after any rank fault, not only after a hang (under torchrun).
    stop_on_fault: bool = False

    def check(self, candidate: Candidate, dcase: DistributedCase) -> DistributedVerdict | RankFault:
        """:func:`check_distributed_case` on ``dcase`` with this loop's settings."""
        return check_distributed_case(
            candidate,
            dcase,
            engine=self.engine,
            timeout_s=self.timeout_s,
            train_dtype=self.train_dtype,
            strict=self.strict,
            launcher=self.launcher,
        )


def check_distributed_cases(
    candidate: Candidate,
    cases: Mapping[str, DistributedCase],
    name: str,
    loop: CaseLoop | None = None,
    *,
    starting: Callable[[int, str, DistributedCase], None] | None = None,
    shown: Callable[[str], None] | None = None,
) -> CaseVerdicts[DistributedVerdict]:
    """Check ``candidate`` on each of ``cases`` in order.

    Args:
        candidate: the step, as :func:`~equiv.checking.distributed.check_distributed` takes it.
        cases: case name -> case, all on the same world size.
        name: the candidate as the result names it (the CLI's target).
        loop: the engine, the check's settings, the launcher, and whether any fault stops the loop
            (None: :class:`CaseLoop`'s defaults).
        starting: hears (index from 1, case name, case) before each case runs.
        shown: hears each case's row as it is judged, and the line that says why the rest were not run.

    Returns:
        Every case's verdict, or its rank fault, or why it was not run (after a hang: each
        would wait out the timeout again; with ``stop_on_fault``, after any fault).

    Raises:
        As :func:`~equiv.checking.distributed.check_distributed` does for a case no rank could run.
    """
    loop = CaseLoop() if loop is None else loop
    tally = _Tally(name, f"on {next(iter(cases.values())).world_size} ranks ({loop.engine})")
    for index, (case_name, dcase) in enumerate(cases.items(), start=1):
        if starting is not None:
            starting(index, case_name, dcase)
        tally.add(case_name, loop.check(candidate, dcase))
        if shown is not None:
            shown(tally.result().row(case_name))
        fault = tally.faults.get(case_name)
        if fault is not None and (loop.stop_on_fault or fault is Fault.HUNG) and index < len(cases):
            rest = list(cases)[index:]
            why, line = _not_run(case_name, fault is Fault.HUNG, loop.timeout_s)
            tally.skip(rest, why)
            if shown is not None:
                shown(f"      the other {len(rest)} case(s) were not run: {line}")
            break
    return tally.result()


@dataclass
class _Tally:
    """The cases of :func:`check_distributed_cases` so far: each one's verdict, rank fault or
    why it was not run, in the order met, for the result and each row shown as it is judged."""

    name: str
    setting: str
    verdicts: dict[str, DistributedVerdict] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    faults: dict[str, Fault] = field(default_factory=dict)
    not_run: dict[str, str] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)

    def add(self, case_name: str, outcome: DistributedVerdict | RankFault) -> None:
        if isinstance(outcome, RankFault):
            self.errors[case_name], self.faults[case_name] = outcome.error, outcome.fault
        else:
            self.verdicts[case_name] = outcome
        self.order.append(case_name)

    def skip(self, rest: list[str], why: str) -> None:
        self.not_run.update(dict.fromkeys(rest, why))
        self.order.extend(rest)

    def result(self) -> CaseVerdicts[DistributedVerdict]:
        """The result as it stands (copies: later cases do not change it)."""
        return CaseVerdicts(
            self.name,
            dict(self.verdicts),
            dict(self.errors),
            tuple(self.order),
            setting=self.setting,
            faults=dict(self.faults),
            not_run=dict(self.not_run),
        )


def _not_run(case_name: str, hung: bool, timeout_s: float) -> tuple[str, str]:
    """Why the cases after a fault on ``case_name`` are not run: as each result says it, and as its line shows it.
    After a hang each case would wait out the timeout again (as equiv check skips them); under
    torchrun a fault may leave a rank mid-collective: its process group cannot be trusted again."""
    if hung:
        return (
            f"the step hung on {case_name!r}",
            f"the step hung on {case_name!r}, and each would wait {timeout_s:g} s as long",
        )
    return (
        f"after the fault on {case_name!r} the ranks' process group may be left mid-collective",
        "after a fault the ranks' process group may be left mid-collective",
    )

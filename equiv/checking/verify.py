"""``equiv.verify``: search cases for a counterexample to a user's step.

Hypothesis draws cases from :func:`equiv.strategies.cases`, checks the
candidate on each with :func:`equiv.check`, and shrinks the first mismatch to
the smallest case that still shows it.  Default search: sample-mean losses,
no BatchNorm or dropout; token-level losses (``--item-weighted``) and
inherent layers (``--allow-inherent``) only when asked.  Cases with an LR
scheduler are searched when the candidate takes a ``scheduler`` keyword.

From the shell: ``equiv verify MODULE:FUNC [--seed S] ...`` (:mod:`equiv.cli`).
"""

from __future__ import annotations

import dataclasses
import json
import random
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from hypothesis import Phase, settings

from equiv.cases.case import Case
from equiv.checking.check import check
from equiv.checking.profiles import profile_settings
from equiv.checking.search import DISCARD, Discard, Failure, Progress, SearchOutcome, SearchRun, run_search
from equiv.checking.search_space import SearchSpace
from equiv.checking.threads import chosen_threads, running_threads
from equiv.judging.contract import BoundCandidate, Candidate, CandidateError, CandidateTimeout, bind
from equiv.judging.deadline import DEFAULT_TIMEOUT_S
from equiv.judging.judge import precision_fails_because
from equiv.judging.runs import NonFiniteLossError
from equiv.outcomes import Fault, Outcome
from equiv.results.protocol import SearchBase
from equiv.results.verdict import Verdict

__all__ = ["VerifyResult", "verify"]


#: Seconds a fresh-process replay of one case may take (start-up included).
_REPLAY_TIMEOUT_S = 120


@dataclass(frozen=True, slots=True)
class VerifyResult(SearchBase):
    """What a search found; truthy when no counterexample was found."""

    KIND = "verify"

    candidate: str
    #: Checks run, shrinking included.
    examples: int
    #: How many checks it took to meet the first counterexample (None: none met).
    first_failure_at: int | None
    #: The shrunk counterexample and its verdict (None when none was found or the candidate raised).
    counterexample: Case | None
    verdict: Verdict | None
    #: The candidate's exception on the shrunk case, when it raised.
    error: str | None
    seed: int | None
    profile: str
    max_examples: int
    #: Hypothesis's reproduction blob for ``--reproduce`` (when it gave one).
    blob: str | None
    elapsed_s: float
    #: Of elapsed_s, the seconds spent inside equiv.check (the training runs and
    #: their comparison); the rest is drawing and shrinking cases.
    checking_s: float = 0.0
    #: The counterexample failed once but not when replayed: the candidate is not deterministic.
    flaky: bool = False
    #: The shrunk case failed in the search but passed alone in a fresh process:
    #: the step keeps state across calls (None: not replayed, see ``fresh_replay``).
    state_across_calls: bool | None = None
    #: What replaying the shrunk case alone in a fresh process showed, or why it was not replayed.
    fresh_replay: str = ""
    #: Cases skipped as inherently non-equivalent (only with allow_inherent), and their reasons.
    inherent_cases: int = 0
    inherent_reasons: tuple[str, ...] = ()
    #: "model / optimizer" -> the largest difference over allowance seen on an equivalent case
    #: (rounding noise: its digits differ from machine to machine).
    worst_ratio: dict[str, float] = field(default_factory=dict)
    #: "model / optimizer" -> how many drawn cases were equivalent (the same on every machine).
    equivalent_cases: dict[str, int] = field(default_factory=dict)
    #: What the search drew from (for replay and reports).
    search: SearchSpace = field(default_factory=SearchSpace)
    #: The step's own traceback when it raised (None otherwise).
    error_traceback: str | None = None
    #: Equivalent cases that passed with a precision note (float32-sized differences
    #: inside the float64 run only), and the first one's note.
    precision_notes: int = 0
    precision_note: str | None = None
    #: The precision the search judged for (the --train-dtype / --strict-precision it ran with).
    train_dtype: str | None = None
    strict: bool = False

    @property
    def found(self) -> bool:
        return self.counterexample is not None

    @property
    def outcome(self) -> Outcome | None:
        """None (nothing found), STEP_ERROR (the candidate raised or hung), PRECISION
        (float32 roundoff inside the float64 run only) or NOT_EQUIVALENT (mathematically different)."""
        if not self.found:
            return None
        if self.error is not None:
            return Outcome.STEP_ERROR
        if self.verdict is not None and self.verdict.outcome is Outcome.PRECISION:
            return Outcome.PRECISION
        return Outcome.NOT_EQUIVALENT

    def _searched(self) -> str:
        return f"{self.candidate}, {self.examples} case(s) searched"

    def _shrunk(self) -> str:
        return f", found after {self.first_failure_at}: {self.counterexample!r}"

    def replay_hint(self, target: str = "MODULE:FUNC") -> str:
        """Commands that reproduce what was found.  When the shrunk case passes
        alone (state kept across calls), only the whole search reproduces it."""
        lines = []
        alone_reproduces = not self.state_across_calls
        precision = (f" --train-dtype {self.train_dtype}" if self.train_dtype else "") + (
            " --strict-precision" if self.strict else ""
        )
        if self.counterexample is not None and alone_reproduces:
            case_json = json.dumps(self.counterexample.to_dict(), sort_keys=True)
            lines.append(f"  this case:   equiv check {target} --case '{case_json}'{precision}")
        how = f"--seed {self.seed}" if self.seed is not None else f"--profile {self.profile}"
        lines.append(
            f"  this search: equiv verify {target} {how} --max-examples {self.max_examples}"
            + "".join(f" {flag}" for flag in self.search.flags())
            + precision
        )
        if self.blob is not None and alone_reproduces:
            # The search's own flags ride along, so a replayed draw prints the same "this search" line.
            lines.append(
                f"  shrunk draw: equiv verify {target} --reproduce {self.blob} {how} "
                f"--max-examples {self.max_examples}" + "".join(f" {flag}" for flag in self.search.flags()) + precision
            )
        return "\n".join(lines)

    @property
    def seconds_per_case(self) -> float:
        return self.elapsed_s / max(self.examples, 1)

    def message(self, target: str = "MODULE:FUNC") -> str:
        outside = 1 - self.checking_s / self.elapsed_s if self.elapsed_s > 0 else 0.0
        timing = (
            f"{self.examples} checks in {self.elapsed_s:.1f} s, {1000 * self.seconds_per_case:.0f} ms per case, "
            f"{100 * outside:.0f}% outside the checks"
        )
        if not self.found:
            text = f"no counterexample in {self.examples} cases ({timing}; candidate {self.candidate})"
            if self.precision_notes:
                text += (
                    f"\n{self.precision_notes} of them with a precision note (passing unless you train in "
                    f"float64: --train-dtype float64 or --strict-precision), e.g.: {self.precision_note}"
                )
            if self.inherent_cases:
                text += f"\n{self.inherent_cases} case(s) inherently non-equivalent, skipped:"
                text += "".join(f"\n  - {reason}" for reason in self.inherent_reasons)
            return text
        assert self.counterexample is not None
        if self.outcome is Outcome.PRECISION:
            head = (
                f"precision finding after {self.first_failure_at} case(s) (no mathematical mismatch found; "
                f"not shrunk):\n  {self.counterexample!r}"
            )
        else:
            head = f"counterexample after {self.first_failure_at} case(s), shrunk to:\n  {self.counterexample!r}"
        if self.state_across_calls:
            head += (
                "\nfails only after earlier calls: your step keeps state across calls (a module-level cache, "
                "hooks never removed, a counter). The shrunk case alone passes in a fresh process; the search "
                "below reproduces the sequence of calls that breaks it."
            )
        if self.flaky:
            head += (
                "\n(flaky: the same case passed when replayed, so the candidate is not deterministic; "
                "it may use unseeded randomness or state kept across calls)"
            )
        if self.error is not None:
            body = f"The candidate raised: {self.error}"
        else:
            assert self.verdict is not None
            body = self.verdict.message()
        if self.state_across_calls:  # the verdict's one-case replay would pass: only the search reproduces it
            body = "\n".join(line for line in body.splitlines() if not line.startswith("Reproduce:"))
        return f"{head}\n{body}\n({timing})\nReplay:\n{self.replay_hint(target)}"

    def _fields(self) -> dict[str, Any]:
        return {
            "candidate": self.candidate,
            "found": self.found,
            "examples": self.examples,
            "first_failure_at": self.first_failure_at,
            "counterexample": None if self.counterexample is None else self.counterexample.to_dict(),
            "verdict": None if self.verdict is None else self.verdict.to_dict(),
            "error": self.error,
            "seed": self.seed,
            "profile": self.profile,
            "max_examples": self.max_examples,
            "blob": self.blob,
            "flaky": self.flaky,
            "outcome": (self.outcome or self.status).value,
            "state_across_calls": self.state_across_calls,
            "fresh_replay": self.fresh_replay,
            "elapsed_s": self.elapsed_s,
            "checking_s": self.checking_s,
            "precision_notes": self.precision_notes,
            "precision_note": self.precision_note,
            "inherent_cases": self.inherent_cases,
            "inherent_reasons": list(self.inherent_reasons),
            "worst_ratio": dict(sorted(self.worst_ratio.items())),
            "equivalent_cases": dict(sorted(self.equivalent_cases.items())),
            "search": self.search.to_dict(),
        }


#: The seed of a search under a derandomized profile (ci) when none is given.
DERANDOMIZED_SEED = 0


def verify(
    candidate: Candidate | BoundCandidate,
    space: SearchSpace | None = None,
    *,
    max_examples: int | None = None,
    seed: int | None = None,
    profile: str | None = None,
    reproduce: str | None = None,
    progress: Progress | None = None,
    replay_in_fresh_process: bool = True,
    timeout: float | None = DEFAULT_TIMEOUT_S,
    train_dtype: torch.dtype | str | None = None,
    strict: bool = False,
    threads: int | None = None,
) -> VerifyResult:
    """Search for a case where ``candidate`` is not the full-batch step.

    A found case is replayed alone in a fresh Python process (when the candidate is importable by name): if
    it passes there, the step keeps state across calls and the result says so.  A case whose only difference
    is float32 roundoff inside the float64 run (a "precision" verdict) never stands in for a mathematical
    mismatch: the search goes on, and reports it only when it finds no mismatch.  Warnings raised by the
    checks are shown once per search.  Cases clip (none / inactive / active) only if the candidate takes
    ``max_grad_norm``, and step an LR scheduler only if it takes ``scheduler``.  Shrinking: a failure shrinks
    towards fewer steps, samples and micro-batches, the smallest model and the plainest optimizer.

    Args:
        candidate: the step, as :func:`equiv.check` takes it.
        space: what cases are drawn from (:class:`SearchSpace`: model families, optimizers, losses, bounds on
            the batch and the micro-batch count, the device; default: everything the strategy draws, on the
            CPU, with sample-mean losses, no BatchNorm or dropout).
        max_examples: cases to try (default: the profile's).
        seed: fixes the search (a derandomized profile is already fixed; otherwise a seed is drawn and
            reported so the search can be replayed).
        profile: equiv's "dev", "ci" or "thorough" (:mod:`equiv.checking.profiles`), or any registered
            Hypothesis profile (default: the one loaded).
        reproduce: a blob printed by an earlier search, replayed.
        progress: called after every check with (checks so far, seconds elapsed).
        replay_in_fresh_process: replay a found case alone in a fresh process.
        timeout: seconds one case's check may take (None: no limit); a step that hangs past it ends the
            search at once with that case, as an error (not shrunk: each shrink step would wait out the
            limit again).
        train_dtype, strict: as in :func:`equiv.check`; a case with only a precision note passes and is
            counted (``precision_notes``) unless the user trains in float64 or asks for strict precision.
        threads: torch's CPU thread count during the search (None: equiv chooses one thread, the drawn cases
            being small, unless ``OMP_NUM_THREADS`` is set; see :mod:`equiv.checking.threads`); the count
            before is restored afterwards.

    Returns:
        A :class:`VerifyResult`: the smallest counterexample and its verdict (or the error of a step that
        raised or hung), or nothing found; cases tried, seed, time.

    Raises:
        ContractError: the candidate cannot take ``(model, optimizer, micro_batches, loss_fn)``.
        InvalidArgument: a bound below 1, or more micro-batches than samples.
        ValueError: ``reproduce`` no longer reproduces a failure.
    """
    candidate = bind(candidate)
    decider = _CaseDecider(candidate, timeout=timeout, train_dtype=train_dtype, strict=strict, threads=threads)
    run = _search_run(profile, max_examples, seed, reproduce, progress)
    return decider.search(SearchSpace() if space is None else space, run, replay_in_fresh_process, profile)


def _search_run(
    profile: str | None, max_examples: int | None, seed: int | None, reproduce: str | None, progress: Progress | None
) -> SearchRun:
    """The search's settings: the profile's (default: the loaded one), with a seed
    always (drawn and reported when none is given), no "explain" phase."""
    base = profile_settings(profile) if profile is not None else settings()  # settings(): the loaded profile
    if seed is None and reproduce is None:
        # A derandomized profile searches from a fixed seed, not from Hypothesis's
        # hash of this function's source: every edit to equiv would otherwise draw
        # other cases in every report and pinned search.
        seed = DERANDOMIZED_SEED if base.derandomize else random.SystemRandom().randrange(2**32)
    return SearchRun(
        base=base,
        max_examples=base.max_examples if max_examples is None else max_examples,
        seed=seed,
        derandomize=base.derandomize and seed is None,
        reproduce=reproduce,
        print_blob=True,
        progress=progress,
        # No "explain" phase: it reruns the shrunk case dozens of times to say
        # which draws matter, which the verdict already says (and costs more
        # than the whole search).
        phases=tuple(p for p in base.phases if p is not Phase.explain),
        # The draws depend on the seed alone, not on what the process imported.
        local_constants=False,
        warn_once=True,
    )


class _CaseDecider:
    """Each drawn case checked with :func:`equiv.check` (pass or fail is all a
    search needs; the details of the one it finds are filled in at the end),
    and what the passing ones showed, counted."""

    def __init__(self, candidate: BoundCandidate, *, threads: int | None, **check_options: Any) -> None:
        # The thread count by the module's rule (a bad one refused first), then a bad
        # train_dtype or strict refused: all before the search starts.
        check_options["threads"] = chosen_threads(threads)
        precision_fails_because(check_options.get("train_dtype"), check_options.get("strict", False))
        self.candidate, self.check_options = candidate, check_options
        self.examples = 0
        self.inherent_cases = 0
        self.inherent_reasons: dict[str, None] = {}
        #: "model / optimizer" -> the worst ratio on an equivalent case, and how many were equivalent.
        self.worst_ratio: dict[str, float] = {}
        self.equivalent_cases: dict[str, int] = {}
        #: (at which case, the case, its verdict): precision-only failures, reported only when nothing else is.
        self.precision_findings: list[tuple[int, Case, Verdict]] = []
        self.precision_notes: list[str] = []

    def __call__(self, case: Case) -> Failure[Verdict] | Discard | None:
        self.examples += 1
        try:
            verdict = check(self.candidate, case, details=False, **self.check_options)
        except NonFiniteLossError:
            return DISCARD  # the case diverges on its own (too large a learning rate): not a finding
        except CandidateTimeout as exc:
            return Failure(error=str(exc), traceback=exc.step_traceback, fault=Fault.HUNG, cause=exc)
        except CandidateError as exc:
            return Failure(error=str(exc), traceback=exc.step_traceback, fault=Fault.RAISED, cause=exc)
        if verdict.status is Outcome.NOT_APPLICABLE:
            return DISCARD  # the strategy only draws what the candidate can take; never a finding
        if verdict.status is Outcome.INHERENTLY_NON_EQUIVALENT:
            self.inherent_cases += 1
            self.inherent_reasons.update(dict.fromkeys(verdict.inherent))
            return None
        if verdict.outcome is Outcome.PRECISION:
            # Not a failure: the shrinker must not trade a mathematical mismatch for this class.
            self.precision_findings.append((self.examples, case, verdict))
            return None
        if not verdict:
            return Failure(verdict=verdict)
        if verdict.precision_note is not None:
            self.precision_notes.append(verdict.precision_note)
        key = f"{case.model} / {case.optimizer}"
        ratio = max((d.ratio for d in verdict.worst.values()), default=0.0)
        self.worst_ratio[key] = max(self.worst_ratio.get(key, 0.0), ratio)
        self.equivalent_cases[key] = self.equivalent_cases.get(key, 0) + 1
        # No hypothesis.target(ratio): a passing case's ratio is rounding noise
        # whose digits move with the CPU's kernels, and a search steered by it
        # draws other cases on another machine (its outcome, its shrunk case and
        # the report would differ).  Which cases are drawn depends only on the
        # seed and on pass / fail, which every machine agrees on.
        return None

    def passing(self) -> dict[str, Any]:
        """What the cases that did not fail showed (the result's fields of that name)."""
        notes = self.precision_notes
        return {
            "inherent_cases": self.inherent_cases,
            "inherent_reasons": tuple(self.inherent_reasons),
            "worst_ratio": self.worst_ratio,
            "equivalent_cases": self.equivalent_cases,
            "precision_notes": len(notes),
            "precision_note": notes[0] if notes else None,
        }

    def finding(self, outcome: SearchOutcome[Case, Verdict]) -> tuple[Case | None, Failure[Verdict] | None, int | None]:
        """(the case found, its failure, at which case it was first met): the
        search's, else the first precision finding; a verdict in full."""
        case, failure, at = outcome.example, outcome.failure, outcome.first_failure_at
        if failure is None and self.precision_findings:
            at, case, verdict = self.precision_findings[0]
            failure = Failure(verdict=verdict)
        if case is None or failure is None or failure.verdict is None or outcome.flaky:
            return case, failure, at
        return case, self._in_full(case, failure), at

    def search(self, space: SearchSpace, run: SearchRun, replay: bool, profile: str | None) -> VerifyResult:
        """:func:`verify`'s search of ``space`` as ``run`` says (``profile``: its name, as
        given), with :attr:`check_options`' thread count (the drawn cases are equiv's own,
        small models); the case found is replayed alone in a fresh process if ``replay``
        and it stood (not flaky, not hung)."""
        with running_threads(self.check_options["threads"]):
            outcome = run_search(space.strategy(self.candidate), self, run, name=self.candidate.name)
            case, failure, first_failure_at = self.finding(outcome)
        elapsed_s, state_across_calls, fresh_replay = time.perf_counter() - outcome.started, None, ""
        if case is not None and not outcome.flaky and not outcome.hung and replay:
            state_across_calls, fresh_replay = _replay_alone(self.candidate, case)
        train_dtype = self.check_options["train_dtype"]
        return VerifyResult(
            candidate=self.candidate.name,
            examples=outcome.examples,
            first_failure_at=first_failure_at,
            counterexample=case,
            verdict=None if failure is None else failure.verdict,
            seed=run.seed,
            error=None if failure is None else failure.error,
            error_traceback=None if failure is None else failure.traceback,
            profile=profile or getattr(settings, "_current_profile", None) or "default",
            max_examples=run.max_examples,
            blob=outcome.blob if outcome.blob is not None or case is None else run.reproduce,
            elapsed_s=elapsed_s,
            checking_s=outcome.judging_s,
            flaky=outcome.flaky,
            state_across_calls=state_across_calls,
            fresh_replay=fresh_replay,
            search=space,
            **self.passing(),
            train_dtype=None if train_dtype is None else str(train_dtype).removeprefix("torch."),
            strict=self.check_options["strict"],
        )

    def _in_full(self, case: Case, failure: Failure[Verdict]) -> Failure[Verdict]:
        """The found case with its verdict in full (where in each tensor).  Its truth
        and floors are kept from the search, so this runs the candidate alone; a
        candidate that does not fail the same way again keeps the search's verdict."""
        assert failure.verdict is not None
        try:
            verdict = check(self.candidate, case, **self.check_options)
        except CandidateError:
            return failure
        if verdict.outcome is not failure.verdict.outcome:
            return failure
        return dataclasses.replace(failure, verdict=verdict)


#: Replays one case alone: prints {"status": ...} or {"error": ...} as JSON.
_REPLAY = """
import json, sys
from equiv.cases.case import Case
from equiv.checking.check import check
from equiv.judging.judge import precision_fails_because
from equiv.judging.contract import CandidateError, load_candidate
candidate = load_candidate(sys.argv[1])
try:
    # The case comes from the search that ran this step: its imports are the user's own.
    verdict = check(candidate, Case.from_dict(json.loads(sys.argv[2]), allow_imports=True))
    print(json.dumps({"status": verdict.status}))
except CandidateError as exc:
    print(json.dumps({"error": str(exc)}))
"""


def _replay_alone(candidate: BoundCandidate, case: Case) -> tuple[bool | None, str]:
    """Replay the found case in a fresh process: (state kept across calls?, what happened)."""
    reference = candidate.reference
    if reference is None:
        return None, "not replayed alone: the candidate has no importable name (a lambda or a local function)"
    command = [sys.executable, "-c", _REPLAY, reference, json.dumps(case.to_dict())]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=_REPLAY_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        return None, f"not replayed alone: the fresh process took over {_REPLAY_TIMEOUT_S} s"
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return None, f"not replayed alone: the fresh process failed ({last})"
    outcome = json.loads(lines[-1])
    if outcome.get("status") == Outcome.EQUIVALENT:
        return True, f"the case alone, in a fresh process ({reference}): equivalent"
    return False, f"the case alone, in a fresh process ({reference}): {outcome.get('status') or 'raised'}"

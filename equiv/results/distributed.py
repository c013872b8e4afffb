"""What a distributed check returns: :class:`DistributedVerdict`, one verdict per
rank and the gradient collectives counted (:func:`equiv.check_distributed`,
:mod:`equiv.checking.distributed`, re-exports it where it was first published)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.fsdp import MixedPrecisionPolicy

from equiv.cases.distributed import DistributedCase
from equiv.distributed.engines import DEFAULT_ENGINE
from equiv.distributed.engines import ENGINES as ENGINE_RECORDS
from equiv.outcomes import Outcome
from equiv.results.protocol import headed
from equiv.results.verdict import FailureKind, Judgement, TensorDiff, Verdict

__all__ = ["CommStats", "DistributedVerdict"]


@dataclass(frozen=True, slots=True)
class CommStats:
    """Gradient collectives on one rank, per optimizer step: DDP's all-reduces
    (one per bucket per sync) or FSDP2's reduce-scatters (one per unit per sync)."""

    calls_per_step: tuple[int, ...]
    #: Bytes each call took in (FSDP2: the padded unsharded gradients, before scattering).
    bytes_per_step: tuple[int, ...]


def _policy_source(policy: MixedPrecisionPolicy) -> str:
    """``policy`` as Python that runs after ``import torch, equiv`` (its repr names
    ``MixedPrecisionPolicy`` bare): its fields that differ from the defaults."""
    default = MixedPrecisionPolicy()
    fields = ", ".join(
        f"{item.name}={getattr(policy, item.name)!r}"
        for item in dataclasses.fields(policy)
        if getattr(policy, item.name) != getattr(default, item.name)
    )
    return f"torch.distributed.fsdp.MixedPrecisionPolicy({fields})"


@dataclass(frozen=True)
class DistributedVerdict(Judgement):
    """Truthy only when every rank matches the single-process full-batch step."""

    KIND = "distributed_verdict"

    case: DistributedCase
    candidate: str
    #: One verdict per rank (its trajectory against the same references).
    ranks: tuple[Verdict, ...]
    #: tier -> per-rank gradient collective statistics (all-reduces or reduce-scatters, see ``engine``)
    comm: dict[str, tuple[CommStats, ...]] = field(default_factory=dict)
    engine: str = DEFAULT_ENGINE
    #: FSDP2: the units (``fully_shard``-ed modules with trainable parameters);
    #: each reduce-scatters once per gradient sync.
    fsdp_units: int = 0
    #: FSDP2: the ``MixedPrecisionPolicy`` the model was sharded with (None: full precision).
    mp_policy: MixedPrecisionPolicy | None = None
    #: Set when the mismatch is the mixed-precision policy's: the same step
    #: without the policy matches (a precision finding, see :attr:`outcome`).
    precision_note: str | None = None
    #: tier -> per rank, per step: the collectives the step issued itself
    #: (name -> calls; a token count all-reduced...), apart from the gradient syncs.
    step_collectives: dict[str, tuple[tuple[dict[str, int], ...], ...]] = dataclasses.field(default_factory=dict)

    def __bool__(self) -> bool:
        return all(self.ranks)

    @property
    def failure_kind(self) -> FailureKind | None:
        """The first failing rank's kind of failure (named by its witness, as ``equiv check`` names one), for
        what reads a verdict's kind (``--format github``, the JUnit properties); None where none was named."""
        return next((v.failure_kind for v in self.ranks if not v and v.failure_kind is not None), None)

    @property
    def status(self) -> Outcome:
        statuses = {v.status for v in self.ranks}
        for status in (Outcome.NOT_APPLICABLE, Outcome.INHERENTLY_NON_EQUIVALENT, Outcome.NOT_EQUIVALENT):
            if status in statuses:
                return status
        return Outcome.EQUIVALENT

    @property
    def outcome(self) -> Outcome:
        """The status, with a precision finding told apart from a mathematical
        mismatch: the mixed-precision policy's (16-bit reduction or
        accumulation), or the ranks' own (float32-sized differences inside the
        float64 run, failing for float64 training or strict precision, as in
        :func:`equiv.check`)."""
        failing = [v for v in self.ranks if not v]
        if self.status is Outcome.NOT_EQUIVALENT and (
            self.precision_note or all(v.outcome is Outcome.PRECISION for v in failing)
        ):
            return Outcome.PRECISION
        return self.status

    @property
    def kind(self) -> Outcome:
        """The same as :attr:`outcome`; kept for code written before it."""
        return self.outcome

    @property
    def collective(self) -> str:
        """The gradient collective counted: "all-reduce" (DDP), "reduce-scatter" (FSDP2) or "engine"
        (DeepSpeed's: every collective of its ``engine.backward`` and ``engine.step``)."""
        return ENGINE_RECORDS[self.engine].collective

    def collectives_per_step(self, tier: str = "exact") -> set[int]:
        """The distinct gradient-collective counts per step seen on any rank."""
        return {calls for stats in self.comm.get(tier, ()) for calls in stats.calls_per_step}

    def allreduces_per_step(self, tier: str = "exact") -> set[int]:
        """The distinct DDP all-reduce counts per step seen on any rank."""
        if ENGINE_RECORDS[self.engine].collective != "all-reduce":
            raise ValueError(
                f"allreduces_per_step() counts DDP's gradient all-reduces; this check ran engine={self.engine!r}: "
                "use reduce_scatters_per_step()"
            )
        return self.collectives_per_step(tier)

    def reduce_scatters_per_step(self, tier: str = "exact") -> set[int]:
        """The distinct FSDP2 reduce-scatter counts per step seen on any rank
        (all units together: ``fsdp_units`` per gradient sync)."""
        if not ENGINE_RECORDS[self.engine].shards_parameters:
            raise ValueError(
                f"reduce_scatters_per_step() counts FSDP2's reduce-scatters; this check ran engine={self.engine!r}: "
                "use allreduces_per_step()"
            )
        return self.collectives_per_step(tier)

    def bytes_per_step(self, tier: str = "exact") -> int:
        """The most bytes any rank sent into gradient collectives in one step."""
        return max((b for stats in self.comm.get(tier, ()) for b in stats.bytes_per_step), default=0)

    def step_collectives_per_step(self, tier: str = "exact") -> list[dict[str, int]]:
        """The collectives the step issued itself at each step, the most any rank
        made of each (e.g. ``[{"all_reduce": 1}]``: a count all-reduced once per
        window); DDP's and FSDP2's gradient syncs are counted apart."""
        steps = max((len(rank) for rank in self.step_collectives.get(tier, ())), default=0)
        out: list[dict[str, int]] = [{} for _ in range(steps)]
        for rank in self.step_collectives.get(tier, ()):
            for step, calls in enumerate(rank):
                for name, count in calls.items():
                    out[step][name] = max(out[step].get(name, 0), count)
        return out

    def measured_error(self, tier: str) -> TensorDiff | None:
        """How far off ``tier`` is, on any rank: the parameter update furthest
        past its allowance (what training feels), else the worst tensor."""
        diffs = [d for v in self.ranks for d in v.mismatches if d.tier == tier]
        updates = [d for d in diffs if d.quantity == "update"]
        worst = [v.worst[tier] for v in self.ranks if tier in v.worst]
        return max(updates or diffs or worst, key=lambda d: d.ratio, default=None)

    def _reproduce(self) -> str:
        extra = "" if self.engine == DEFAULT_ENGINE else f", engine={self.engine!r}"
        imports = "equiv"
        if self.mp_policy is not None:
            extra += f", mp_policy={_policy_source(self.mp_policy)}"
            imports = "torch, equiv"
        # The keywords that make a failing precision finding fail again (the same on every rank).
        extra += next((v._precision_flags() for v in self.ranks if v.precision is not None), "")
        # Every name as the imports reach it, so the line runs as printed (tensor_parallel included).
        call = f"equiv.check_distributed({self.candidate}, {self.case.source('equiv.')}{extra})"
        return f"Reproduce: {call}" if imports == "equiv" else f"Reproduce: import {imports}; {call}"

    def note(self) -> str | None:
        """A passing rank's precision note (the mixed-precision policy's own note is :attr:`precision_note`)."""
        if self.status is not Outcome.EQUIVALENT:
            return None
        return next((v.precision_note for v in self.ranks if v.precision_note), None)

    def reasons(self) -> tuple[str, ...]:
        return next((v.reasons() for v in self.ranks if v.status is self.status), ())

    def line(self) -> str:
        """One line: the outcome, the candidate, the ranks and engine, and the first failing rank's line."""
        where = f"{self.candidate} on {self.case.world_size} ranks ({self.engine}), {self.case!r}"
        return headed(self.outcome, where + self.detail())

    def detail(self) -> str:
        """What :meth:`line` says after the case: the first failing rank's detail, or a passing rank's."""
        failing = next(((rank, v) for rank, v in enumerate(self.ranks) if not v), None)
        if failing is None or self.reasons():
            shown = next((v for v in self.ranks if v.note()), self.ranks[0]) if self.ranks else None
            return "" if shown is None else shown.detail()
        rank, verdict = failing
        return f", rank {rank}{verdict.detail()}"

    def _fields(self) -> dict[str, Any]:
        return {
            "candidate": self.candidate,
            "case": self.case.to_dict(),
            "outcome": self.outcome.value,
            "engine": self.engine,
            "world_size": self.case.world_size,
            "ranks": [v.to_dict() for v in self.ranks],
            "collectives_per_step": {tier: sorted(self.collectives_per_step(tier)) for tier in sorted(self.comm)},
            "precision_note": self.precision_note,
            "message": self.message(),
        }

    def message(self) -> str:
        record = ENGINE_RECORDS[self.engine]
        engine = record.describe(self.case)
        per = "data rank" if self.case.ranks_per_data_rank > 1 else "rank"
        lines = [
            f"{self.case.world_size} ranks under {engine}, micro-batches per {per} "
            f"{[list(s) for s in self.case.rank_micro_batch_sizes]}"
        ]
        if self.outcome is Outcome.PRECISION and self.precision_note:
            lines.append(f"Precision ({self.candidate} under {self.mp_policy!r}): {self.precision_note}")
            for failing_tier in sorted({d.tier for v in self.ranks for d in v.mismatches}):
                diff = self.measured_error(failing_tier)
                if diff is not None:
                    lines.append(
                        f"Measured error, {failing_tier} tier ({diff.dtype}): {diff.max_abs_diff:.3g} absolute, "
                        f"{diff.max_rel_diff:.3g} relative in {diff.label} at step {diff.step} "
                        f"({diff.ratio:.3g} x allowed)"
                    )
        failing = [(rank, v) for rank, v in enumerate(self.ranks) if not v]
        if failing:
            rank, verdict = failing[0]
            body = [line for line in verdict.message().splitlines() if not line.startswith("Reproduce:")]
            lines.append(f"rank {rank} of {self.case.world_size}: " + "\n".join(body))
            if len(failing) > 1:
                lines.append(f"also not equivalent on rank(s) {[r for r, _ in failing[1:]]}")
        else:
            # One rank's summary suffices (one with a precision note, if any has
            # one); the distributed reproduction follows.
            shown = next((v for v in self.ranks if v.precision_note), self.ranks[0])
            lines += [line for line in shown.message().splitlines() if not line.startswith("Reproduce:")]
        for tier, _stats in sorted(self.comm.items() if record.collective != "none" else ()):
            units = f" ({self.fsdp_units} FSDP units, one each per sync)" if record.shards_parameters else ""
            lines.append(
                f"{record.collectives_counted} per step ({tier} tier): {sorted(self.collectives_per_step(tier))}"
                f"{units}, up to {self.bytes_per_step(tier)} bytes per step per rank"
            )
        own = self.step_collectives_per_step("exact")
        if any(own):
            per_step = "; ".join(
                f"step {step}: " + (", ".join(f"{name} x{count}" for name, count in sorted(calls.items())) or "none")
                for step, calls in enumerate(own, start=1)
            )
            lines.append(f"the step's own collectives (exact tier, most on any rank): {per_step}")
        lines.append(self._reproduce())
        return "\n".join(lines)

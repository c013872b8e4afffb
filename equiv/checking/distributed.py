"""Equivalence beyond one process: W data-parallel ranks x N micro-batches.

The distributed candidate contract is the single-process one, run on every
rank at once::

    step(model, optimizer, micro_batches, loss_fn) -> None

- ``model`` is the case's model wrapped by the engine (the process group is
  initialised: gloo on CPU, NCCL on CUDA): ``engine="ddp"`` wraps it in
  ``DistributedDataParallel``; ``engine="fsdp2"`` applies FSDP2's
  ``fully_shard`` to each layer and then to the root, on a 1-D device mesh of
  the W ranks (parameters, gradients and optimizer state become DTensor shards);
  ``engine="tp"`` applies tensor parallelism (``parallelize_module``) on a 1-D
  mesh whose ranks all see the same micro-batches, and ``engine="fsdp2+tp"``
  TP inside each data rank and FSDP2 over the data ranks on a 2-D mesh
  (``DistributedCase.of(..., tensor_parallel=T)``; see
  :mod:`equiv.distributed.tensor_parallel`); under ``engine="tp"`` a
  position-wise model (the token-level MoE) runs sequence-parallel instead:
  each TP rank holds a slice of every sequence's positions, as Megatron's
  sequence parallelism splits the router's tokens, the model replicated and
  its gradients reduced over the TP group (DDP); ``engine="cp"`` is context
  parallelism: each data rank's micro-batches are served by C ranks
  (``DistributedCase.of(..., context_parallel=C)``), each holding one
  contiguous slice of every sequence's positions (inputs and targets), the
  model wrapped in DDP over every rank (data x context), as Megatron reduces
  gradients over its DP x CP group; ``engine="fsdp2+cp"`` shards with FSDP2
  over the same ranks instead (see :mod:`equiv.distributed.context_parallel`);
- ``micro_batches`` are THIS rank's micro-batches: each step's global batch is
  cut into consecutive rank shards (sizes may differ between ranks), and each
  shard into that rank's micro-batches;
- ``loss_fn`` returns the mean over this micro-batch's items (with ``sum`` and
  ``count``), exactly as on one process.

The reference is one single-process full-batch step on the concatenated
global batch.  Every rank's parameters and optimizer state (under FSDP2
gathered to full tensors with ``full_tensor()``) are compared with it after
every step, in the same two tiers as :func:`equiv.check`.  The gradient
collectives are counted per optimizer step: under DDP a comm hook counts the
all-reduces (a correct ``no_sync`` step does one per window, whatever N is);
under FSDP2 a custom reduce-scatter (``FSDPModule.set_custom_reduce_scatter``)
counts each unit's reduce-scatters (one per unit per window with
``set_requires_gradient_sync(False)`` on all but the last micro-batch, N with
sync on every micro-batch).

The ranks are launched by :func:`equiv.distributed.launcher.run_on_ranks`
(fresh processes with a deadline: a rank that raises, hangs or dies ends the
check with :class:`DistributedCheckError` naming the rank and the case), the
model is sharded by :mod:`equiv.distributed.sharding` and the collectives are
counted by :mod:`equiv.distributed.collectives`; this module only judges.
``run_on_ranks``, ``fully_shard_layers`` and ``DistributedCheckError`` are
re-exported here, where they were first published.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import pickle
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from equiv.cases.case import InvalidCase
from equiv.cases.distributed import DistributedCase
from equiv.cases.strategies import MATRIX_ONLY_OPTIMIZERS
from equiv.checking.distributed_witness import WITNESS_READ, rank_witnesses
from equiv.checking.failure_kinds import named_by
from equiv.distributed.collectives import CollectiveCounts, StepCollectives
from equiv.distributed.context_parallel import clear_layout, install_layout
from equiv.distributed.deepspeed import DEEPSPEED_MUON
from equiv.distributed.engines import DEFAULT_ENGINE, STEP_ENGINES, Apply, Wrapping, engine_named
from equiv.distributed.engines import ENGINES as ENGINE_RECORDS
from equiv.distributed.launcher import DistributedCheckError, Launcher, run_on_ranks
from equiv.distributed.matching import mark
from equiv.distributed.sharding import full_tensors, fully_shard_layers
from equiv.judging.contract import Candidate, bind, shipped
from equiv.judging.floors import TIERS
from equiv.judging.judge import FailsBecause, ReferenceRuns, precision_fails_because, precision_finding
from equiv.judging.runs import RankOptions, Snapshot, lifted_low_precision, run_candidate
from equiv.results.distributed import CommStats, DistributedVerdict
from equiv.results.verdict import TensorDiff, Tier, Verdict

__all__ = [
    "ENGINES",
    "DistributedCase",
    "DistributedCheckError",
    "DistributedVerdict",
    "check_distributed",
    "fully_shard_layers",
    "matrix_optimizer_refusal",
    "run_on_ranks",
]

#: The engines a distributed check wraps the model in, by name (each one record of
#: :data:`equiv.distributed.engines.ENGINES`, which says how it wraps the model).
ENGINES: tuple[str, ...] = STEP_ENGINES


@dataclass(frozen=True, slots=True)
class RankTier:
    """What one rank sends back for one tier: its trajectory and what it counted."""

    #: Every step's parameters and optimizer state, DTensor shards gathered, on the CPU.
    snapshots: list[Snapshot]
    #: Gradient collectives per step (DDP's all-reduces or FSDP2's reduce-scatters) and the bytes they took in.
    calls: tuple[int, ...]
    bytes: tuple[int, ...]
    #: FSDP2 units the engine made (0 where it shards nothing).
    units: int
    #: Per step, the collectives the step issued itself (name -> calls), apart from the gradient syncs.
    own_calls: tuple[dict[str, int], ...]

    @property
    def comm(self) -> CommStats:
        return CommStats(self.calls, self.bytes)


#: What a rank of a distributed check returns: tier -> its :class:`RankTier`.
RankResult = dict[str, RankTier]


def _gathered(snapshots: list[Snapshot]) -> list[Snapshot]:
    """Snapshots with every DTensor shard gathered and on the CPU (a
    collective: every rank runs this in the same order), so their names and
    shapes are the single-process ones."""
    return [
        dataclasses.replace(
            s,
            params=full_tensors(s.params),
            buffers=full_tensors(s.buffers),
            optimizer_state=full_tensors(s.optimizer_state),
        )
        for s in snapshots
    ]


@dataclass(frozen=True)
class _CheckTask:
    """One rank of a distributed check: the candidate in each tier's dtype."""

    candidate: Callable[..., Any]
    dcase: DistributedCase
    tiers: list[tuple[str, str]]
    #: The engine's ``apply_*`` functions, in order (its record's: sent with the task, so the
    #: ranks wrap the model as the engine the check was given says).
    apply: tuple[Apply, ...]
    mp_policy: MixedPrecisionPolicy | None
    #: torch's default dtype while the candidate runs (None: unchanged), e.g. "float64"
    #: to tell a tensor made without a dtype from a mismatch (as equiv.check does).
    default_dtype: str | None = None
    #: The bfloat16 and float16 the step asks for lifted to each tier's dtype, to tell
    #: its own low-precision arithmetic (an accumulation buffer) from a mismatch (as equiv.check does).
    promote_low_precision: bool = False
    #: The engine's record's wrapper of a rank's model and optimizer together (DeepSpeed), or None.
    wrap_optimizer: Callable[[DistributedCase, int, float | None, CollectiveCounts], Any] | None = None

    def _comm_hook(self, hook: Any, model: nn.Module) -> Any:
        """DDP's counting comm hook, lifted with the step's own bfloat16 and float16 where asked."""
        return lifted_low_precision(hook, next(model.parameters()).dtype) if self.promote_low_precision else hook

    def _optimizer_wrapping(self, rank: int, counter: CollectiveCounts) -> RankOptions:
        """``wrap_optimizer`` for this rank where the engine takes the optimizer too (DeepSpeed; its own
        collectives counted in ``counter``), else nothing."""
        if self.wrap_optimizer is None:
            return {}
        return {"wrap_optimizer": self.wrap_optimizer(self.dcase, rank, self.dcase.case.max_grad_norm, counter)}

    def __call__(self, rank: int, world_size: int, progress: Callable[[str], None]) -> RankResult:
        device = torch.device(self.dcase.case.device)
        results: RankResult = {}
        own = StepCollectives.installed()  # what the step issues itself, apart from the gradient syncs
        for tier, dtype_name in self.tiers:
            counter = CollectiveCounts()  # all-reduces under DDP, reduce-scatters under FSDP2, DeepSpeed's own
            own.reset()
            # Points every rank passes in order, so a rank that made one collective more
            # or less is named at the next one (see equiv.distributed.matching).
            mark(f"the start of the {tier} tier")
            # Every sequence split over ranks (context parallel, or a position-wise model under
            # tensor parallel: sequence parallel): the groups a step reads (context_parallel.layout()).
            if self.dcase.sequence_slices > 1:
                install_layout(self.dcase.sequence_slices)
            else:  # whole sequences on every rank: nothing to sum over (the token MoE's routing counts)
                clear_layout()
            wrapping = Wrapping(device.type, self.dcase, counter, self.mp_policy, comm_hook=self._comm_hook)

            def wrap(model: nn.Module, wrapping: Wrapping = wrapping) -> nn.Module:
                for apply in self.apply:  # as torchtitan composes apply_tp, then apply_fsdp
                    model = apply(model, wrapping)
                return model

            def on_step(step: int, counter: CollectiveCounts = counter, tier: str = tier) -> None:
                mark(f"{tier} tier, step {step}")
                progress(f"{tier} tier, step {step}: in the candidate")
                counter.start_step(step)
                own.start_step()

            options: RankOptions = {
                "wrap_model": wrap,
                "batch_slice": self.dcase.rank_slice(rank),
                "micro_batch_sizes": self.dcase.rank_micro_batches(rank),
                "on_step": on_step,
                # A rank is a process of its own: os._exit there is a rank that died, as the launcher says.
                "catch_os_exit": False,
                **self._optimizer_wrapping(rank, counter),
            }
            snapshots = run_candidate(
                self.dcase.case,
                self.candidate,
                getattr(torch, dtype_name),
                default_dtype=None if self.default_dtype is None else getattr(torch, self.default_dtype),
                promote_low_precision=self.promote_low_precision,
                **options,
            )
            own.stop()
            mark(f"the end of the {tier} tier's steps")
            progress(f"{tier} tier: gathering the snapshots")
            results[tier] = RankTier(
                _gathered(snapshots), tuple(counter.calls), tuple(counter.bytes), wrapping.units, tuple(own.calls)
            )
        return results


def _check_split(dcase: DistributedCase, engine: str) -> None:
    """The split must fit the engine: a tensor- (context-) parallel engine needs T >= 2
    (C >= 2) ranks per group, any other T = 1 (C = 1); and what the engine's record refuses."""
    record = engine_named(engine)
    for group, size, keyword in (
        ("tensor", dcase.tensor_parallel, "tensor_parallel=T"),
        ("context", dcase.context_parallel, "context_parallel=C"),
    ):
        name = keyword.split("=")[0]
        if record.group == group and size < 2:
            raise InvalidCase(
                f"engine={engine!r} needs DistributedCase.of(..., {keyword}) with {keyword[-1]} >= 2 "
                f"ranks per {group}-parallel group, got {name}={size}"
            )
        if record.group != group and size != 1:
            engines = " or ".join(repr(n) for n, e in ENGINE_RECORDS.items() if e.group == group)
            raise InvalidCase(f"{name}={size} needs engine {engines}, got engine={engine!r}")
    refusal = record.refuse(dcase, dcase.case.model)
    if refusal is not None:
        raise InvalidCase(refusal)
    matrix = matrix_optimizer_refusal(engine, dcase.case.optimizer)
    if matrix is not None:
        raise InvalidCase(matrix)


def matrix_optimizer_refusal(engine: str, optimizer: str) -> str | None:
    """Why ``optimizer`` (a matrix-only optimizer such as ``torch.optim.Muon``, which
    orthogonalises each weight matrix: :data:`equiv.strategies.MATRIX_ONLY_OPTIMIZERS`) cannot
    run under ``engine``; None where it can.  torch's Muon runs under every engine but
    DeepSpeed's (DDP hands it the whole averaged matrix; FSDP2 and tensor parallelism the
    DTensor matrix, which it orthogonalises whole: in float64 runs its Newton-Schulz is lifted
    to float64, see :mod:`equiv.judging.runs`); DeepSpeed's Muon under its engine and DDP."""
    if optimizer not in MATRIX_ONLY_OPTIMIZERS:
        return None
    record = engine_named(engine)
    if optimizer == DEEPSPEED_MUON:
        # DeepSpeed's Muon runs under its engine (ZeRO-1/2 orthogonalise each whole reduced matrix) or on whole
        # weights (its own step: DDP's ranks hold the whole averaged matrix); nothing runs it on DTensor shards.
        if record.shards_parameters or record.group == "tensor":
            return (
                f"optimizer {DEEPSPEED_MUON!r} is DeepSpeed's Muon, which DeepSpeed's engine runs (engine "
                f"'deepspeed' or 'deepspeed-zero1') or one process on whole weights (DDP); engine={engine!r} "
                "hands it DTensor shards"
            )
        return None
    if record.wrap_optimizer is not None:
        # Measured with DeepSpeed 0.19.8 on gloo: the client torch.optim.Muon raises "Param gradient must be a 2D
        # matrix" at the first step.  DeepSpeed's own Muon (its config's optimizer "Muon", parameters tagged
        # use_muon) is the case's optimizer DEEPSPEED_MUON.
        return (
            f"engine={engine!r} hands the client optimizer one flat 1-D partition of each parameter group "
            f"(ZeRO-1/2), which torch.optim.{optimizer} refuses (it orthogonalises 2-D matrices only); "
            f"DeepSpeed's own Muon is optimizer={DEEPSPEED_MUON!r}"
        )
    return None


def _lowers_precision(policy: MixedPrecisionPolicy | None) -> bool:
    return policy is not None and (policy.param_dtype is not None or policy.reduce_dtype is not None)


def check_distributed(
    candidate: Candidate,
    dcase: DistributedCase,
    *,
    tiers: Sequence[Tier] = TIERS,
    timeout_s: float = 120.0,
    engine: str = DEFAULT_ENGINE,
    mp_policy: MixedPrecisionPolicy | None = None,
    train_dtype: torch.dtype | str | None = None,
    strict: bool = False,
    launcher: Launcher = run_on_ranks,
) -> DistributedVerdict:
    """Run ``candidate`` on ``dcase.world_size`` local processes and compare
    every rank with the single-process full-batch step.

    ``engine`` wraps the model: ``"ddp"`` in ``DistributedDataParallel``,
    ``"fsdp2"`` with ``fully_shard`` per layer and at the root (with
    ``mp_policy``, an FSDP2 ``MixedPrecisionPolicy``, if given); ``"tp"``
    with ``parallelize_module`` (column-wise then row-wise ``nn.Linear``
    pairs) on a 1-D mesh of ``dcase.tensor_parallel`` ranks that all see the
    same micro-batches; ``"fsdp2+tp"`` with TP inside each group of
    ``tensor_parallel`` ranks and FSDP2 over the data ranks (a 2-D mesh); ``"cp"``
    with ``dcase.context_parallel`` ranks per data rank, each holding a slice of
    every sequence's positions, under DDP over all ranks (``"fsdp2+cp"``: FSDP2 over
    all ranks; see :mod:`equiv.distributed.context_parallel`).  A candidate
    that fails only under a 16-bit ``mp_policy`` and matches without it is a
    precision finding (``verdict.outcome == "precision"``), reported with the
    measured error.  Where the backend has no ``PREMUL_SUM`` (gloo), FSDP2
    reduces with a plain sum and divides after it (the same gradient), so a
    step may set its own divide factor (``set_gradient_divide_factor(1.0)``).

    Precision, as in :func:`equiv.check`: when every rank's mismatches are
    inside the float64 run and every lower-precision run matched, the failing
    float64 tier runs again on the ranks with torch's default dtype set to
    float64; if every rank then matches (a tensor made without a dtype), or
    every difference is float32-sized, each rank's verdict carries that
    precision finding.  It passes with a precision note unless ``train_dtype``
    is float64 or ``strict`` is set; then it fails as PRECISION.  Bfloat16-sized
    differences in the float32 and float64 runs (a step that accumulates in its
    own bfloat16 buffer, or all-reduces through ``bf16_compress_hook``) run again
    on the ranks with the step's bfloat16 and float16 lifted to each tier's dtype
    (its DDP comm hook too); if every rank then matches, the finding is
    ``bfloat16_arithmetic``, failing unless ``train_dtype`` is bfloat16 or float16.
    (Under a 16-bit ``mp_policy`` the policy's rerun without it decides instead.)

    Ranks whose collectives do not line up end the check at once with a
    :class:`DistributedCheckError` naming which rank called what, where
    (:mod:`equiv.distributed.matching`), not at the timeout.

    ``launcher`` runs the ranks: :func:`run_on_ranks` spawns them here;
    :meth:`equiv.distributed.torchrun.TorchrunRanks.run` runs them on the
    ranks torchrun started (``equiv check-distributed`` under torchrun).

    Args:
        candidate: the step, importable by name (a module-level function): the ranks
            are spawned processes that import it (so call this under
            ``if __name__ == "__main__":`` in a script).
        dcase: the case and each rank's micro-batch sizes (:class:`DistributedCase`).
        tiers: as in :func:`equiv.check`.
        timeout_s: seconds the ranks may take, counted once every rank has started
            (starting has 120 s of its own).
        engine: ``"ddp"``, ``"fsdp2"``, ``"tp"``, ``"fsdp2+tp"``, ``"cp"`` or ``"fsdp2+cp"`` (above).
        mp_policy: FSDP2's ``MixedPrecisionPolicy`` (``engine="fsdp2"``).
        train_dtype, strict: as in :func:`equiv.check`.
        launcher: runs the ranks (above).

    Returns:
        A :class:`DistributedVerdict`: every rank's verdict, the collectives counted.

    Raises:
        DistributedCheckError: a rank raised, hung past ``timeout_s``, died, or the
            ranks' collectives did not line up; its ``fault``
            (:class:`~equiv.outcomes.Fault`) says which.  No process is left behind.
        InvalidCase: the case or engine cannot run as asked (named, with the value given).
        ValueError: ``timeout_s`` or ``train_dtype`` is not valid, or a CUDA case has fewer GPUs than ranks.
        UnguardedMainError: called at the top level of a script the ranks import again
            (not under ``if __name__ == "__main__":``).
    """
    __tracebackhide__ = True
    precision_fails_because(train_dtype, strict)  # a bad value is refused before any rank starts
    fails_because = functools.partial(_fails_because, train_dtype, strict)
    _check_arguments(dcase, engine, mp_policy, timeout_s)
    bound = bind(candidate)
    sent = _sendable(candidate, bound.name)
    reasons = bound.not_applicable_reasons(dcase.case)
    if reasons:  # nothing to run: every rank says why the case does not apply
        verdict = Verdict(case=dcase.case, candidate=bound.name, mismatches=(), not_applicable=reasons)
        return DistributedVerdict(
            case=dcase, candidate=bound.name, ranks=(verdict,) * dcase.world_size, engine=engine, mp_policy=mp_policy
        )
    if (
        launcher is run_on_ranks
        and dcase.case.device.startswith("cuda")
        and torch.cuda.device_count() < dcase.world_size
    ):
        raise ValueError(
            f"{dcase.world_size} ranks on {dcase.case.device!r} need as many GPUs, {torch.cuda.device_count()} visible"
        )
    references = ReferenceRuns.of(dcase.case, tiers)
    ranks = _Ranks(sent, bound.name, dcase, engine, timeout_s, launcher, references)
    return ranks.verdict(mp_policy, fails_because)


def _check_arguments(
    dcase: DistributedCase, engine: str, mp_policy: MixedPrecisionPolicy | None, timeout_s: float
) -> None:
    """Refuse what no rank could run, before any starts."""
    if not isinstance(dcase, DistributedCase):
        raise TypeError(f"dcase must be an equiv.DistributedCase, got {type(dcase).__name__}")
    record = engine_named(engine)  # a ValueError naming the engines for any other
    if mp_policy is not None and not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(
            f"mp_policy must be a torch.distributed.fsdp.MixedPrecisionPolicy or None, got {type(mp_policy).__name__}"
        )
    if mp_policy is not None and not record.shards_parameters:
        raise ValueError(f"mp_policy is an FSDP2 setting: it needs engine='fsdp2', got engine={engine!r}")
    _check_split(dcase, engine)
    counts = [len(sizes) for sizes in dcase.rank_micro_batch_sizes]
    if record.same_micro_batch_counts and len(set(counts)) > 1:
        # FSDP2: each forward all-gathers every unit's parameters (and each backward
        # again), so a rank with fewer micro-batches would leave the others
        # waiting in a collective.  DeepSpeed: gradient_accumulation_steps is one
        # number for every rank.  Shard sizes may differ; counts may not.
        why = (
            "each forward and backward all-gathers the parameters"
            if record.shards_parameters
            else "its gradient_accumulation_steps is one number for every rank"
        )
        raise InvalidCase(
            f"under engine={engine!r} every rank needs the same number of micro-batches ({why}), "
            f"got {counts} micro-batches per rank in {dcase!r}"
        )
    if not (timeout_s > 0 and math.isfinite(timeout_s)):
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")


def _sendable(candidate: Candidate, name: str) -> Any:
    """The candidate as the ranks receive it: by its import path (each rank loads it, a file path included)."""
    sent = shipped(candidate)
    try:
        pickle.dumps(sent)
    except Exception as exc:
        raise TypeError(
            f"candidate {name} cannot be sent to the ranks ({exc}); "
            "define it at module level in an importable module or a .py file"
        ) from None
    return sent


#: How the ranks run a step again for :func:`~equiv.judging.judge.precision_finding`, in words.
_RERUNS = {
    "default_dtype": "with torch's default dtype set to float64",
    "low_precision": "with the step's bfloat16 and float16 lifted to each tier's dtype",
}


@dataclass(frozen=True)
class _Ranks:
    """One distributed check's ranks: launched once per question (every tier;
    the failing tiers again with float64 as torch's default dtype, with the
    step's bfloat16 lifted, or without the mixed-precision policy), each rank
    judged against the same references."""

    sent: Any
    name: str
    dcase: DistributedCase
    engine: str
    timeout_s: float
    launcher: Launcher
    references: ReferenceRuns

    @property
    def tier_dtypes(self) -> list[tuple[str, str]]:
        return [(tier, str(self.references.dtype(tier)).removeprefix("torch.")) for tier in self.references.tiers]

    def launch(
        self, tiers: Collection[Tier], policy: MixedPrecisionPolicy | None, rerun: str | None = None
    ) -> list[RankResult]:
        """Run ``tiers`` on the ranks: what each rank returned, in rank order.  ``rerun``: how
        :func:`~equiv.judging.judge.precision_finding` asks the step to run again, one of
        :data:`_RERUNS` (torch's default dtype set to float64, or the step's own bfloat16
        and float16 lifted to each tier's dtype), or None: as it is."""
        if rerun is not None and rerun not in _RERUNS:
            raise ValueError(f"rerun must be one of {sorted(_RERUNS)} or None, got {rerun!r}")
        dcase, engine = self.dcase, self.engine
        task = _CheckTask(
            self.sent,
            dcase,
            [(t, d) for t, d in self.tier_dtypes if t in tiers],
            engine_named(engine).apply,
            policy,
            default_dtype="float64" if rerun == "default_dtype" else None,
            promote_low_precision=rerun == "low_precision",
            wrap_optimizer=engine_named(engine).wrap_optimizer,
        )
        extra = (
            "" if engine == DEFAULT_ENGINE else f", engine={engine!r}" + (f", mp_policy={policy!r}" if policy else "")
        )
        extra += "" if rerun is None else f", {_RERUNS[rerun]}"
        # Under FSDP2 on CUDA the snapshots' shards are gathered where they live
        # (NCCL) and copied to the CPU; the CPU backend serves any CPU tensor.
        fsdp_on_cuda = engine_named(engine).shards_parameters and dcase.case.device.startswith("cuda")
        return self.launcher(
            task,
            dcase.world_size,
            device=dcase.case.device,
            backend="cpu:gloo,cuda:nccl" if fsdp_on_cuda else None,
            timeout_s=self.timeout_s,
            describe=f"candidate {self.name}, case {dcase!r}{extra}",
            match_collectives=True,
        )

    def verdict(self, mp_policy: MixedPrecisionPolicy | None, fails_because: FailsBecause) -> DistributedVerdict:
        """Every tier on the ranks, each rank's verdict, precision told apart (as :func:`check_distributed` says)."""
        references, name = self.references, self.name
        per_rank = self.launch(references.tiers, mp_policy)
        verdicts = [
            references.verdict(name, {tier: results[tier].snapshots for tier in references.tiers})
            for results in per_rank
        ]

        def rerun_on_the_ranks(failing: Sequence[Tier], how: str) -> list[TensorDiff] | None:
            if how == "low_precision" and _lowers_precision(mp_policy):
                # Lifting bfloat16 would lift the policy's casts with the step's own: whether the
                # policy is what differs is _policy_note's question (rerun without it), not the step's.
                return None
            rerun = self.launch(failing, mp_policy, how)
            return [d for r in rerun for t in failing for d in references.compare(t, r[t].snapshots)]

        # One judge of precision for one process and for W ranks: every rank's mismatches together.
        finding = precision_finding(verdicts, references, rerun_on_the_ranks, fails_because)
        if finding is not None:
            verdicts = [dataclasses.replace(v, precision=finding) if v.mismatches else v for v in verdicts]
        precision_note = None
        if (
            not all(verdicts)
            and finding is None
            and _lowers_precision(mp_policy)
            and not any(v.inherent for v in verdicts)
        ):
            precision_note = self._policy_note(verdicts, mp_policy)
        if finding is None and precision_note is None and not all(verdicts) and WITNESS_READ.get():
            # Only after a failing verdict that precision does not explain (an FSDP2 policy's 16-bit reduction
            # included): which weight each rank's update gave each micro-batch (issue 44).
            witnesses = rank_witnesses(self.sent, self.dcase, self.engine, verdicts, self.launcher, self.timeout_s)
            verdicts = [
                v if w is None else dataclasses.replace(v, witness=w, failure_kind=named_by(w))
                for v, w in zip(verdicts, witnesses, strict=True)
            ]
        tiers = references.tiers
        return DistributedVerdict(
            case=self.dcase,
            candidate=name,
            ranks=tuple(verdicts),
            engine=self.engine,
            comm={tier: tuple(r[tier].comm for r in per_rank) for tier in tiers},
            fsdp_units=max(r[tier].units for r in per_rank for tier in tiers),
            mp_policy=mp_policy,
            precision_note=precision_note,
            step_collectives={tier: tuple(r[tier].own_calls for r in per_rank) for tier in tiers},
        )

    def _policy_note(self, verdicts: Sequence[Verdict], mp_policy: MixedPrecisionPolicy | None) -> str | None:
        """As check() tells float32 roundoff inside the float64 run from a
        mismatch: rerun the failing tiers without the policy.  If that
        matches, the step is the full-batch step and the policy's 16-bit
        reduction/accumulation is what differs (trl #2175 under FSDP1)."""
        failing = {d.tier for v in verdicts for d in v.mismatches}
        rerun = self.launch(failing, None)
        if all(self.references.verdict(self.name, {t: r[t].snapshots for t in failing}) for r in rerun):
            return (
                f"the same step with no MixedPrecisionPolicy matches, so the difference is the policy's "
                f"{_policy_dtypes(mp_policy)}"
            )
        return None


def _policy_dtypes(policy: MixedPrecisionPolicy | None) -> str:
    assert policy is not None
    parts = []
    if policy.param_dtype is not None:
        parts.append(f"{str(policy.param_dtype).removeprefix('torch.')} parameters in forward/backward")
    if policy.reduce_dtype is not None:
        parts.append(
            f"{str(policy.reduce_dtype).removeprefix('torch.')} gradient reduction (and accumulation between "
            "micro-batches without sync)"
        )
    return " and ".join(parts)


def _fails_because(train_dtype: torch.dtype | str | None, strict: bool, sized: torch.dtype) -> str:
    """:func:`precision_fails_because` with the user's settings bound (a picklable callable)."""
    return precision_fails_because(train_dtype, strict, sized)

"""Search rank splits for a distributed counterexample: the distributed counterpart of :func:`equiv.verify`.

Where data-parallel accumulation breaks, the split decides whether it shows:
ranks holding different numbers of samples (a per-rank mean averaged by DDP,
transformers #34242), different numbers of micro-batches (a count all-reduced
once per micro-batch), different numbers of real tokens (a GA=1 shortcut that is
exact only "when every rank contributed the same number of tokens", torchtune
PR #2980), a micro-batch with no real token at all.  A hand-picked split guesses
which; :func:`verify_distributed` lets Hypothesis draw them (world size, each
rank's micro-batch sizes, the loss, the optimizer, clipping, the engine) and
shrink a failure to the smallest split that still shows it.

Every drawn case runs through :func:`~equiv.checking.distributed.check_distributed`
on spawned ranks (a warm fork server makes one about 0.2 s on the CPU), judged
as every check is: both tiers, derived allowances, the precision class.  Which
cases are drawn depends only on the seed and on pass / fail, so a seeded search
finds the same split on every machine.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, TypedDict

import torch
from hypothesis import strategies as st
from typing_extensions import Unpack  # typing's from Python 3.11; equiv supports 3.10

from equiv.cases.case import Case
from equiv.cases.strategies import MATRIX_ONLY_OPTIMIZERS
from equiv.checking.distributed import ENGINES, DistributedCase, DistributedVerdict, matrix_optimizer_refusal
from equiv.checking.distributed_cases import CaseLoop, RankFault
from equiv.checking.distributed_witness import witness_deferred
from equiv.checking.search import DISCARD, Discard, Failure, Progress, SearchOutcome, SearchRun, run_search
from equiv.distributed.deepspeed import DEEPSPEED_MUON
from equiv.distributed.engines import DATA_PARALLEL_ENGINES, DEFAULT_ENGINE, engine_named
from equiv.distributed.engines import ENGINES as ENGINE_RECORDS
from equiv.judging.contract import BoundCandidate, Candidate, bind
from equiv.judging.judge import precision_fails_because
from equiv.outcomes import Fault, Outcome
from equiv.results.protocol import SearchBase

__all__ = [
    "DATA_PARALLEL_ENGINES",
    "DEFAULT_OPTIMIZERS",
    "ENGINES",
    "MODELS",
    "DistributedSearchResult",
    "DistributedSearchSpace",
    "UnequalCountsFault",
    "distributed_cases",
    "standard_distributed_cases",
    "verify_distributed",
]

# The engines a search may draw are :data:`ENGINES` (see :func:`~equiv.checking.distributed.check_distributed`);
# which models each draws, with how many data ranks and ranks per group, is its record's
# (:data:`equiv.distributed.engines.ENGINES`).
#: The models drawn: a small MLP on a sample-mean loss, a token model whose
#: batches hold padding (each sample a different number of real tokens, and
#: whole micro-batches with none drawn on some ranks), and the MoE model with its
#: sequence-wise load-balancing loss and a router z-loss (``loss="mse_aux"``).
_BASES: dict[str, Case] = {
    "mlp": Case(batch_size=1, micro_batch_sizes=(1,), model_kwargs={"hidden": (8,), "activation": "tanh"}),
    "tokens": Case(batch_size=1, micro_batch_sizes=(1,), model="token_mlp", loss="token_cross_entropy"),
    "moe": Case(batch_size=1, micro_batch_sizes=(1,), model="moe", model_kwargs={"z_weight": 0.01}, loss="mse_aux"),
}
#: The model names a search draws from, in shrinking order.
MODELS = tuple(_BASES)
#: What a model name means where sequences are split (context parallel, and tensor parallel's sequence parallelism) where
#: it differs: the MoE with an output at every position (``model="token_moe"``, ``loss="token_mse_aux"``),
#: the same router losses per sequence.
_SEQUENCE_BASES: dict[str, Case] = {
    "moe": Case(
        batch_size=1, micro_batch_sizes=(1,), model="token_moe", model_kwargs={"z_weight": 0.01}, loss="token_mse_aux"
    ),
}
_OPTIMIZERS = {"SGD": {"lr": 0.05}, "Adam": {"lr": 1e-2}, "Muon": {"lr": 0.02}, "DeepSpeedMuon": {"lr": 0.02}}
#: The optimizers a search draws unless asked for others (``optimizers=``): SGD and Adam.  ``"Muon"``
#: (torch.optim.Muon, which orthogonalises each weight matrix) is drawn on a bias-free MLP only, under the
#: engines that can run it (:func:`~equiv.checking.distributed.matrix_optimizer_refusal`: all but DeepSpeed's).
DEFAULT_OPTIMIZERS: tuple[str, ...] = ("SGD", "Adam")
#: An active clip norm for these models' gradients (drawn only for a step that takes max_grad_norm).
_CLIP_NORM = 0.05


@st.composite
def distributed_cases(
    draw: st.DrawFn,
    *,
    max_world_size: int = 3,
    max_micro_batches: int = 3,
    max_micro_batch_size: int = 4,
    clipping: bool = False,
    models: Sequence[str] = MODELS,
    engine: str = DEFAULT_ENGINE,
    equal_micro_batch_counts: bool = False,
) -> DistributedCase:
    """Distributed cases: 2 to ``max_world_size`` ranks, each with 1 to
    ``max_micro_batches`` micro-batches of 1 to ``max_micro_batch_size``
    samples (so ranks differ in samples, micro-batches and, on the token model,
    real tokens), one of ``models`` (:data:`MODELS`), an optimizer, 1 or 2
    steps, and an active clip norm when ``clipping``.  The optimizer is one of
    :data:`DEFAULT_OPTIMIZERS` (others, Muon among them: :class:`DistributedSearchSpace`'s
    ``optimizers``).  Under ``engine="fsdp2"``
    every rank has the same number of micro-batches (each forward and backward
    all-gathers the parameters on every rank), of its own sizes.  Under
    ``equal_micro_batch_counts`` asks the same of every engine (a step whose
    collectives depend on its micro-batch count runs only so).  Under
    ``engine="tp"`` one data rank served by 2 (the record's ``search_group_ranks``)
    TP ranks ("moe" as the token-level MoE, sequence-parallel: each TP rank
    a slice of every sequence); under ``"fsdp2+tp"`` 2 to ``max_world_size // 2`` data ranks (at
    least 2: 4 processes even when ``max_world_size`` is 3) of
    2 each.  Under ``"cp"`` and ``"fsdp2+cp"`` 1 to
    ``max_world_size // 2`` data ranks of 2 ranks each (the token model, and "moe" as the token-level MoE), each
    holding a slice of every sequence.
    On the token model, one micro-batch of one rank may be drawn with no real
    token at all (``Case.empty_samples``), besides the padding every sample has.
    Shrinks towards 2 ranks of one 1-sample micro-batch."""
    _check_bounds(max_world_size, max_micro_batches, max_micro_batch_size, models)
    record = engine_named(engine)
    tensor_parallel = record.search_group_ranks if record.group == "tensor" else 1
    context_parallel = record.search_group_ranks if record.group == "context" else 1
    low, fixed = record.search_data_ranks  # data ranks: a fixed count is not drawn
    world_size = (
        fixed if fixed is not None else draw(st.integers(low, max(low, max_world_size // record.search_group_ranks)))
    )
    if record.same_micro_batch_counts or equal_micro_batch_counts:
        count = draw(st.integers(1, max_micro_batches))
        sizes = st.lists(st.integers(1, max_micro_batch_size), min_size=count, max_size=count)
    else:
        sizes = st.lists(st.integers(1, max_micro_batch_size), min_size=1, max_size=max_micro_batches)
    ranks = draw(st.lists(sizes, min_size=world_size, max_size=world_size))
    model = draw(st.sampled_from(tuple(models)))
    split = record.splits_sequences
    base = _SEQUENCE_BASES.get(model, _BASES[model]) if split else _BASES[model]
    case = draw(_with_optimizer(base, model, DEFAULT_OPTIMIZERS)).replace(steps=draw(st.integers(1, 2)))
    if clipping and draw(st.booleans()):
        case = case.replace(max_grad_norm=_CLIP_NORM)
    if case.loss == "token_cross_entropy":
        flat = [size for sizes in ranks for size in sizes]  # the window as DistributedCase.of lays it out
        case = case.replace(batch_size=sum(flat), micro_batch_sizes=flat, empty_samples=draw(_empty_micro_batch(ranks)))
    return DistributedCase.of(case, ranks, tensor_parallel=tensor_parallel, context_parallel=context_parallel)


def _with_optimizer(base: Case, model: str, optimizers: Sequence[str]) -> st.SearchStrategy[Case]:
    """``base`` with one of ``optimizers``, SGD first (it shrinks to it); a matrix-only one (Muon)
    on the MLP only, made bias-free (every parameter a matrix)."""
    drawable = [name for name in optimizers if model == "mlp" or name not in MATRIX_ONLY_OPTIMIZERS]

    def made(name: str) -> Case:
        kwargs = {**base.model_kwargs, "bias": False} if name in MATRIX_ONLY_OPTIMIZERS else base.model_kwargs
        return base.replace(optimizer=name, optimizer_kwargs=_OPTIMIZERS[name], model_kwargs=kwargs)

    return st.sampled_from(sorted(drawable, reverse=True)).map(made)


def _check_optimizers(optimizers: Sequence[str], models: Sequence[str], engines: Sequence[str]) -> None:
    """Refuse optimizers no case can be drawn with, naming the value: unknown names, a
    matrix-only optimizer alone without the MLP, or one no run of an engine can judge."""
    if isinstance(optimizers, str) or not optimizers or any(name not in _OPTIMIZERS for name in optimizers):
        raise ValueError(f"optimizers must be a non-empty subset of {tuple(_OPTIMIZERS)}, got {optimizers!r}")
    if "mlp" not in models and all(name in MATRIX_ONLY_OPTIMIZERS for name in optimizers):
        raise ValueError(f"optimizers {tuple(optimizers)!r} take 2-D weights only: they need models with 'mlp'")
    for engine in engines:
        for name in optimizers:
            refusal = matrix_optimizer_refusal(engine, name)
            if refusal is not None:
                raise ValueError(f"optimizers cannot hold {name!r} under engine {engine!r}: {refusal}")


def _empty_micro_batch(ranks: Sequence[Sequence[int]]) -> st.SearchStrategy[tuple[int, ...]]:
    """No sample without real tokens (shrinks to it), or every sample of one
    micro-batch of one rank: a micro-batch with no real token on that rank only
    (never the only micro-batch of the window: the full-batch mean needs a token)."""
    slots = [(rank, index) for rank, sizes in enumerate(ranks) for index in range(len(sizes))]
    if len(slots) < 2:
        return st.just(())

    def samples(slot: tuple[int, int]) -> tuple[int, ...]:
        rank, index = slot
        start = sum(sum(sizes) for sizes in ranks[:rank]) + sum(ranks[rank][:index])
        return tuple(range(start, start + ranks[rank][index]))

    return st.just(()) | st.sampled_from(slots).map(samples)


def standard_distributed_cases(world_size: int, engine: str = DEFAULT_ENGINE) -> dict[str, DistributedCase]:
    """The cases ``equiv check-distributed`` runs when given none, for
    ``world_size`` ranks: splits that expose what goes wrong across ranks
    without a search.  Rank r holds 1 + (r + 2) samples in two micro-batches
    (ranks differ in samples, so a per-rank mean is caught), on the MLP with
    SGD and with Adam, and on the token model (ranks differ in real tokens);
    under DDP also r + 1 micro-batches of 2 samples (ranks differ in
    micro-batch counts: a count all-reduced per micro-batch, sync left on);
    an active clip norm (not applicable to a step that takes no
    ``max_grad_norm``); and Muon on a bias-free MLP (torch.optim.Muon under
    DDP and FSDP2, DeepSpeed's own under its engines: see
    :func:`~equiv.checking.distributed.matrix_optimizer_refusal`).
    Two steps each, so state carried between steps counts."""
    if engine not in DATA_PARALLEL_ENGINES:
        raise ValueError(f"engine must be one of {DATA_PARALLEL_ENGINES} (the data-parallel engines), got {engine!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    sizes = [[1, rank + 2] for rank in range(world_size)]
    mlp = _BASES["mlp"].replace(steps=2)
    adam = mlp.replace(optimizer="Adam", optimizer_kwargs=_OPTIMIZERS["Adam"])
    cases = {
        "uneven shards, SGD": DistributedCase.of(mlp.replace(optimizer_kwargs=_OPTIMIZERS["SGD"]), sizes),
        "uneven shards, Adam": DistributedCase.of(adam, sizes),
        "ragged real tokens": DistributedCase.of(_BASES["tokens"].replace(steps=2), sizes),
    }
    if not ENGINE_RECORDS[engine].same_micro_batch_counts:  # FSDP2 all-gathers per forward: equal counts only
        cases["uneven micro-batch counts, Adam"] = DistributedCase.of(
            adam, [[2] * (rank + 1) for rank in range(world_size)]
        )
    cases["clipped (max_grad_norm), Adam"] = DistributedCase.of(adam.replace(max_grad_norm=_CLIP_NORM), sizes)
    # An orthogonalising optimizer, which a mean of rank-local updates cannot stand in for (DeepSpeed #7807):
    # torch's Muon (whole averaged matrices under DDP, DTensor matrices under FSDP2), DeepSpeed's own under its engine.
    record = ENGINE_RECORDS[engine]
    muon = DEEPSPEED_MUON if record.wrap_optimizer is not None else "Muon"
    # (without DeepSpeed its engines are refused in one line when a case runs: no case of its optimizer is made)
    runnable = record.refuse(cases["uneven shards, Adam"], adam.model) is None
    if runnable and matrix_optimizer_refusal(engine, muon) is None:
        bias_free = {**mlp.model_kwargs, "bias": False}  # every parameter a matrix
        muon_case = mlp.replace(optimizer=muon, optimizer_kwargs=_OPTIMIZERS[muon], model_kwargs=bias_free)
        cases["bias-free MLP, Muon"] = DistributedCase.of(muon_case, sizes)
    return cases


def _check_bounds(
    max_world_size: int, max_micro_batches: int, max_micro_batch_size: int, models: Sequence[str]
) -> None:
    """Refuse bounds no case can be drawn from, naming the value."""
    for name, value, low in (
        ("max_world_size", max_world_size, 2),
        ("max_micro_batches", max_micro_batches, 1),
        ("max_micro_batch_size", max_micro_batch_size, 1),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an integer of at least {low}, got {value!r}")
    unknown = [model for model in models if model not in MODELS]
    if unknown or not models:
        raise ValueError(f"models must be a non-empty subset of {MODELS}, got {tuple(models)!r}")


#: Faults that say the ranks' collectives did not line up (or waited on each other for ever).
_COLLECTIVE_FAULTS = (Fault.HUNG, Fault.COLLECTIVE_MISMATCH)


@dataclass(frozen=True)
class UnequalCountsFault:
    """Ranks holding different numbers of micro-batches hung or mismatched their
    collectives under the step: its collectives depend on its micro-batch count
    (a sync per micro-batch).  A finding of its own, reported beside the search
    of the cases the step can run (every rank as many micro-batches), never
    instead of it."""

    counterexample: DistributedCase
    engine: str
    error: str
    fault: Fault

    def describe(self) -> str:
        """One paragraph: which split, hang or mismatch, why, what to do, and the ranks' first line."""
        split = "; ".join(
            f"rank {rank}: {list(sizes)}" for rank, sizes in enumerate(self.counterexample.rank_micro_batch_sizes)
        )
        what = "hang" if self.fault is Fault.HUNG else "mismatch their collectives"
        first = next((line.strip() for line in self.error.splitlines() if line.strip()), "")
        return (
            f"Also: ranks holding different numbers of micro-batches {what} under this step ({split}; engine "
            f"{self.engine}): its collectives depend on its micro-batch count (a gradient sync per micro-batch). "
            f"Sync once per window (DDP's no_sync() around all but the last backward) or give every rank as "
            f"many micro-batches. The ranks said: {first}"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "counterexample": self.counterexample.to_dict(),
            "engine": self.engine,
            "error": self.error,
            "fault": self.fault.value,
        }


@dataclass(frozen=True)
class DistributedSearchResult(SearchBase):
    """What :func:`verify_distributed` found: the smallest split that shows a
    difference (``counterexample`` with its ``verdict``, or the ``error`` of a
    rank that raised, hung, died or made mismatched collectives), or nothing."""

    KIND = "distributed_search"

    candidate: str
    engines: tuple[str, ...]
    examples: int
    seed: int
    elapsed_s: float
    counterexample: DistributedCase | None = None
    engine: str | None = None
    verdict: DistributedVerdict | None = None
    error: str | None = None
    #: Cases whose only difference was a precision note across ranks (passed, counted).
    precision_notes: int = 0
    #: how the ranks of the counterexample failed to give a verdict (with ``error``), as data
    fault: Fault | None = None
    #: Ranks with unequal micro-batch counts hung or mismatched collectives, and a search of
    #: equal counts found the counterexample above: that fault, reported beside it.
    also: UnequalCountsFault | None = None
    #: Cases searched with every rank holding as many micro-batches, after unequal counts
    #: hung or mismatched collectives (None: no such search was needed).
    equal_counts_examples: int | None = None

    @property
    def found(self) -> bool:
        return self.counterexample is not None

    @property
    def outcome(self) -> Outcome | None:
        """None (nothing found), STEP_ERROR (a rank raised, hung, died or its
        collectives did not match its peers'), or the verdict's outcome."""
        if not self.found:
            return None
        if self.error is not None:
            return Outcome.STEP_ERROR
        assert self.verdict is not None
        return self.verdict.outcome

    def _searched(self) -> str:
        return f"{self.candidate}, {self.examples} distributed case(s) searched ({', '.join(self.engines)})"

    def _shrunk(self) -> str:
        return f", shrunk to {self.counterexample!r} under {self.engine}"

    def _fields(self) -> dict[str, Any]:
        found = self.counterexample
        return {
            "candidate": self.candidate,
            "engines": list(self.engines),
            "examples": self.examples,
            "seed": self.seed,
            "elapsed_s": self.elapsed_s,
            "found": self.found,
            "outcome": (self.outcome or self.status).value,
            "engine": self.engine,
            "counterexample": None if found is None else found.to_dict(),
            "verdict": None if self.verdict is None else self.verdict.to_dict(),
            "error": self.error,
            "precision_notes": self.precision_notes,
            "fault": None if self.fault is None else self.fault.value,
            "also": None if self.also is None else self.also.to_dict(),
            "equal_counts_examples": self.equal_counts_examples,
        }

    def message(self) -> str:
        head = (
            f"equiv verify-distributed: {self.candidate}, {self.examples} distributed case(s) "
            f"({', '.join(self.engines)}), seed {self.seed}, {self.elapsed_s:.1f} s"
        )
        if not self.found:
            notes = f"; {self.precision_notes} with a precision note" if self.precision_notes else ""
            return f"{head}: no counterexample{notes}."
        assert self.counterexample is not None
        split = "; ".join(
            f"rank {rank}: {list(sizes)}" for rank, sizes in enumerate(self.counterexample.rank_micro_batch_sizes)
        )
        lines = [
            f"{head}: counterexample, shrunk to {self.counterexample.world_size} ranks ({split}), "
            f"engine {self.engine}:",
            "",
        ]
        shown = self.error if self.error is not None else self.verdict.message() if self.verdict is not None else ""
        # One Reproduce line, the search's own (the verdict's says the same without the engine it ran under).
        lines.append("\n".join(line for line in shown.splitlines() if not line.startswith("Reproduce:")))
        # The keywords that make a failing precision finding fail again (the same on every rank).
        ranks = self.verdict.ranks if self.verdict is not None else ()
        flags = next((v._precision_flags() for v in ranks if v.precision is not None), "")
        lines += [
            "",
            f"Reproduce: equiv.check_distributed({self.candidate}, {self.counterexample.source('equiv.')}, "
            f"engine={self.engine!r}{flags})",
        ]
        if self.also is not None:
            lines += ["", self.also.describe()]
        elif self.equal_counts_examples is not None:
            lines += [
                "",
                f"With every rank holding as many micro-batches: no counterexample in "
                f"{self.equal_counts_examples} case(s).",
            ]
        return "\n".join(lines)


class _Bounds(TypedDict, total=False):
    """The keywords of :class:`DistributedSearchSpace`, as :func:`verify_distributed` also takes them."""

    engines: Sequence[str]
    models: Sequence[str]
    max_world_size: int
    max_micro_batches: int
    max_micro_batch_size: int
    equal_micro_batch_counts: bool
    optimizers: Sequence[str]


@dataclass(frozen=True, kw_only=True)
class DistributedSearchSpace:
    """What a distributed search draws from (:func:`distributed_cases` of
    ``models`` on each of ``engines``), refused when made if no case can be
    drawn from it (a ``ValueError`` naming the value)."""

    #: The engines drawn (:data:`ENGINES`), kept as a tuple.
    engines: Sequence[str] = (DEFAULT_ENGINE,)
    #: The models drawn (:data:`MODELS`), kept as a tuple; an engine with ``search_models`` in its
    #: record draws those only ("tp" the MLP and the MoE, "fsdp2+tp" the MLP, "cp" and "fsdp2+cp"
    #: the token model and the MoE).
    models: Sequence[str] = MODELS
    #: Bounds on the ranks, each rank's micro-batch count and each micro-batch's samples.
    max_world_size: int = 3
    max_micro_batches: int = 3
    max_micro_batch_size: int = 4
    #: Every rank holds as many micro-batches as the others (a step whose collectives depend on the count).
    equal_micro_batch_counts: bool = False
    #: The optimizers drawn (:data:`DEFAULT_OPTIMIZERS`; ``"Muon"`` too on request), kept as a tuple.
    optimizers: Sequence[str] = DEFAULT_OPTIMIZERS

    def __post_init__(self) -> None:
        object.__setattr__(self, "engines", tuple(self.engines))
        object.__setattr__(self, "models", tuple(self.models))
        _check_optimizers(self.optimizers, self.models, self.engines)
        object.__setattr__(self, "optimizers", tuple(self.optimizers))
        unknown = [engine for engine in self.engines if engine not in ENGINES]
        if unknown or not self.engines:
            raise ValueError(f"engines must be a non-empty subset of {ENGINES}, got {self.engines!r}")
        _check_bounds(self.max_world_size, self.max_micro_batches, self.max_micro_batch_size, self.models)
        for engine, record in ENGINE_RECORDS.items():
            drawable = record.search_models
            if (
                record.group == "tensor"
                and drawable is not None
                and engine in self.engines
                and not set(self.models) <= set(drawable)
            ):
                raise ValueError(
                    f"engine {engine!r} shards nn.Linear pairs (and runs the MoE sequence-parallel "
                    f"under 'tp' alone): models must be a subset of {drawable} with it, got "
                    f"{self.models!r}"
                )
        context = {name: record for name, record in ENGINE_RECORDS.items() if record.group == "context"}
        for record in context.values():
            drawable = record.search_models or MODELS
            if any(model not in drawable for model in self.models) and any(e in context for e in self.engines):
                names = " and ".join(repr(name) for name in context)
                raise ValueError(
                    f"engines {names} split every sequence's positions over ranks: models must "
                    f"be a subset of {drawable} with them, got {self.models!r}"
                )

    def strategy(self, *, clipping: bool) -> st.SearchStrategy[tuple[DistributedCase, str]]:
        """(a case, the engine it runs on): an engine drawn first, then a case for it;
        an active clip norm drawn only with ``clipping``."""

        def on(engine: str) -> st.SearchStrategy[tuple[DistributedCase, str]]:
            drawn = distributed_cases(
                max_world_size=self.max_world_size,
                max_micro_batches=self.max_micro_batches,
                max_micro_batch_size=self.max_micro_batch_size,
                clipping=clipping,
                models=self.models,
                engine=engine,
                equal_micro_batch_counts=self.equal_micro_batch_counts,
            )
            if self.optimizers != DEFAULT_OPTIMIZERS:  # drawn again from these (the defaults' draws kept as they are)
                drawn = drawn.flatmap(self._with_optimizers)
            return drawn.map(lambda dcase: (dcase, engine))

        return st.sampled_from(tuple(self.engines)).flatmap(on)

    def _with_optimizers(self, dcase: DistributedCase) -> st.SearchStrategy[DistributedCase]:
        """``dcase`` with one of :attr:`optimizers` instead (a matrix-only one on the MLP only, made bias-free)."""
        return _with_optimizer(dcase.case, str(dcase.case.model), self.optimizers).map(
            lambda case: dataclasses.replace(dcase, case=case.replace(steps=dcase.case.steps))
        )

    def to_dict(self) -> dict[str, Any]:
        return {key: list(value) if isinstance(value, tuple) else value for key, value in asdict(self).items()}


def verify_distributed(
    candidate: Candidate | BoundCandidate,
    space: DistributedSearchSpace | None = None,
    *,
    max_examples: int = 25,
    seed: int | None = None,
    timeout_s: float = 20.0,
    progress: Progress | None = None,
    train_dtype: torch.dtype | str | None = None,
    strict: bool = False,
    **bounds: Unpack[_Bounds],
) -> DistributedSearchResult:
    """Search distributed cases for one where ``candidate`` is not the full-batch step,
    shrinking the first found to the smallest split that still shows it.

    Call it under ``if __name__ == "__main__":`` in a script: the ranks are spawned
    processes that import the script (and the candidate) again.

    Args:
        candidate: a module-level function (the ranks import it), as
            :func:`equiv.check_distributed` takes it.
        space: what is drawn (:class:`DistributedSearchSpace`), or None with its keywords in ``bounds``.
        **bounds: ``space``'s keywords: ``engines``, ``models``, ``max_world_size``, ``max_micro_batches``,
            ``max_micro_batch_size``, ``equal_micro_batch_counts``, ``optimizers`` (not both with ``space``).
        max_examples: distributed cases to try.
        seed: fixes the search (default: drawn and reported).
        timeout_s: seconds one case's ranks may take; a rank that hangs ends the search
            with that case (not shrunk).
        progress: hears (cases so far, seconds) after every case.
        train_dtype, strict: when a precision finding fails, as in :func:`equiv.check_distributed`
            (a step computing in bfloat16 fails float32 training, the default, and passes
            ``train_dtype="bfloat16"``).

    Returns:
        A :class:`DistributedSearchResult`: the smallest split found with its verdict,
        or the error and :class:`~equiv.outcomes.Fault` of ranks that raised, hung,
        died or mismatched their collectives; or nothing found.  A case that is only
        a precision note passes and is counted.  When ranks holding different numbers
        of micro-batches hang or mismatch their collectives, the search goes on among
        cases where every rank holds as many (another ``max_examples``): a mismatch
        found there is the counterexample, that fault reported beside it (``also``).

    Raises:
        TypeError: both ``space`` and keywords were given.
        ValueError, InvalidArgument: a bound out of range (named, with the value given).
    """
    bound = bind(candidate)
    precision_fails_because(train_dtype, strict)  # a bad value is refused before any case runs
    space = _search_space(space, bounds)
    if isinstance(max_examples, bool) or not isinstance(max_examples, int) or max_examples < 1:
        raise ValueError(f"max_examples must be a positive integer, got {max_examples!r}")
    seed = random.SystemRandom().randrange(2**32) if seed is None else seed
    decider = _CaseDecider(candidate, timeout_s=timeout_s, train_dtype=train_dtype, strict=strict)
    run = SearchRun(max_examples=max_examples, seed=seed, progress=progress)
    searched = decider.witnessed(
        _search(space, decider, run, clipping="max_grad_norm" in bound.keywords, name=bound.name)
    )
    return searched.result(bound.name, space, seed, precision_notes=decider.precision_notes)


def _search_space(space: DistributedSearchSpace | None, bounds: _Bounds) -> DistributedSearchSpace:
    """The space searched: ``space``, or one made of its keywords (refused when both are given)."""
    if space is not None and bounds:
        raise TypeError(f"give the search space or its keywords, not both (got space and {sorted(bounds)})")
    return DistributedSearchSpace(**bounds) if space is None else space


@dataclass
class _CaseDecider:
    """A search's ``decide``: one drawn (case, engine) checked on spawned ranks, the
    cases that passed with only a precision note counted."""

    candidate: Candidate | BoundCandidate
    timeout_s: float
    train_dtype: torch.dtype | str | None
    strict: bool
    precision_notes: int = 0

    def __call__(self, drawn: tuple[DistributedCase, str]) -> Failure[DistributedVerdict] | Discard | None:
        with witness_deferred():  # while the search shrinks: the reported example's is read once, at the end
            verdict = self.check(drawn)
        if isinstance(verdict, RankFault):
            return Failure(error=verdict.error, fault=verdict.fault, cause=verdict.cause)
        if verdict.status is Outcome.NOT_APPLICABLE:
            return DISCARD
        if not verdict:
            return Failure(verdict=verdict)
        if verdict.precision_note or any(rank.precision_note for rank in verdict.ranks):
            self.precision_notes += 1
        return None

    def check(self, drawn: tuple[DistributedCase, str]) -> DistributedVerdict | RankFault:
        """The drawn case's verdict (or the ranks' fault), as :func:`check_distributed_case` gives it."""
        dcase, engine = drawn
        loop = CaseLoop(engine=engine, timeout_s=self.timeout_s, train_dtype=self.train_dtype, strict=self.strict)
        return loop.check(self.candidate, dcase)

    def witnessed(self, searched: _Searched) -> _Searched:
        """``searched`` with its counterexample's verdict read again, witness and all (skipped while shrinking);
        kept as it was when the rerun does not fail the same way."""
        failure, example = searched.outcome.failure, searched.outcome.example
        if failure is None or failure.verdict is None or example is None:
            return searched
        again = self.check(example)
        if isinstance(again, RankFault) or again.status is not failure.verdict.status:
            return searched
        outcome = dataclasses.replace(searched.outcome, failure=Failure(verdict=again))
        return dataclasses.replace(searched, outcome=outcome)


@dataclass(frozen=True)
class _Searched:
    """What the searches met: the one whose finding is reported (the first, or the
    equal-count one that found a mismatch), with the examples of both."""

    outcome: SearchOutcome[tuple[DistributedCase, str], DistributedVerdict]
    #: Examples of both searches, and ``time.perf_counter()`` when the first started.
    examples: int
    started: float
    also: UnequalCountsFault | None = None
    equal_counts_examples: int | None = None

    def result(
        self, candidate: str, space: DistributedSearchSpace, seed: int, *, precision_notes: int
    ) -> DistributedSearchResult:
        dcase, engine = self.outcome.example if self.outcome.example is not None else (None, None)
        failure = self.outcome.failure
        return DistributedSearchResult(
            candidate=candidate,
            engines=tuple(space.engines),
            examples=self.examples,
            seed=seed,
            elapsed_s=time.perf_counter() - self.started,
            counterexample=dcase,
            engine=engine,
            verdict=None if failure is None else failure.verdict,
            error=None if failure is None else failure.error,
            precision_notes=precision_notes,
            fault=None if failure is None else failure.fault,
            also=self.also,
            equal_counts_examples=self.equal_counts_examples,
        )


def _search(
    space: DistributedSearchSpace, decider: _CaseDecider, run: SearchRun, *, clipping: bool, name: str
) -> _Searched:
    """Search ``space``; when unequal micro-batch counts hang the step or mismatch its collectives,
    search on among the cases it can run (every rank as many micro-batches) for a mathematical
    mismatch, with the same budget."""
    outcome = run_search(space.strategy(clipping=clipping), decider, run, name=name)
    unequal = _unequal_counts_fault(outcome.example, outcome.failure)
    if unequal is None:
        return _Searched(outcome, outcome.examples, outcome.started)
    started, examples, progress = outcome.started, outcome.examples, run.progress

    def more(done: int, seconds: float) -> None:
        if progress is not None:
            progress(examples + done, time.perf_counter() - started)

    equal = dataclasses.replace(space, equal_micro_batch_counts=True)
    again = run_search(equal.strategy(clipping=clipping), decider, dataclasses.replace(run, progress=more), name=name)
    found = again if again.found else outcome
    return _Searched(
        found,
        examples + again.examples,
        started,
        also=unequal if again.found else None,
        equal_counts_examples=again.examples,
    )


def _unequal_counts_fault(
    example: tuple[DistributedCase, str] | None, failure: Failure[DistributedVerdict] | None
) -> UnequalCountsFault | None:
    """The finding, when ranks holding different numbers of micro-batches hung or
    mismatched their collectives (None for any other finding, or none)."""
    if example is None or failure is None or failure.fault not in _COLLECTIVE_FAULTS or failure.error is None:
        return None
    dcase, engine = example
    if len({len(sizes) for sizes in dcase.rank_micro_batch_sizes}) < 2:
        return None
    return UnequalCountsFault(dcase, engine, failure.error, failure.fault)

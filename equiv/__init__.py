"""equiv: is your gradient accumulation equivalent to full-batch training?

The public API.  The code is grouped by layer (the table in :mod:`equiv.layers`), and imports flow
one way, down::

    equiv, strategies, testing, pytest_plugin, __main__  ->  cli  ->  reporting  ->  findings  ->  peers
      ->  auditing  ->  checking, cost  ->  judging  ->  results  ->  cases, zoo, adapters
      ->  accumulator, losses, batches, distributed, outcomes, names, host_memory, layers

- ``equiv``, ``strategies``, ``testing``, ``pytest_plugin``, ``__main__``: the facade, what a user types (this
  module's ``__all__``, the Hypothesis strategies, the pytest helpers and plugin, ``python -m equiv``);
- ``cli``: the ``equiv`` command;
- ``reporting``: the markdown reports, rendered from findings and peers' results (nothing there measures);
- ``findings``: what reports/equivalence.md shows, measured, as plain results;
- ``peers``: other libraries' accumulation, driven as their users drive it and judged by the checker, one
  window or whole epochs (what reports/peers.md shows);
- ``auditing``: a real run watched through hooks, sampled steps judged against the full batch;
- ``checking``: the front doors: check, verify, search, the distributed and pipeline checks;
- ``cost``: memory, workloads, train steps, the cost model and the planner;
- ``judging``: the engine: truth, floors and candidate runs, comparison, allowances, the Judge;
- ``results``: what every front door returns: rows, verdicts, the pinned facts;
- ``cases``: what to run (:class:`Case`, models, standard cases, strategies);
- ``zoo``: known bugs the checker must catch;
- ``adapters``: other libraries' accumulation steps (Accelerate, Lightning, transformers) as candidates;
- ``accumulator``, ``losses``, ``batches``: the reference accumulator, the loss protocol (sample, token,
  packed and policy losses), micro-batches;
- ``distributed``: spawning ranks, FSDP2 sharding and counted collectives (under checking and cost);
- ``outcomes``, ``names``, ``host_memory``, ``layers``: result words, import paths, freed host memory kept
  for reuse, the layer table.

``__all__`` is what a user types: the front doors (check, verify, audit, the
distributed and pipeline checks, plan), the accumulator, what a case is made
of, the losses, the one protocol every front door's result satisfies
(:class:`Result`, its status an :class:`Outcome`) and the errors to catch.
Everything else stays where it is defined: a result's own class
(``equiv.results.verdict.Verdict``, ``equiv.checking.distributed.DistributedVerdict``,
``equiv.checking.verify.VerifyResult``...), the pinned facts
(``equiv.results.facts.VerdictFacts``), the models (``equiv.cases.models``),
memory and planning (``equiv.cost.memory``, ``equiv.cost.planner``).
"""

from equiv import strategies  # the public Hypothesis strategies: equiv.strategies
from equiv.accumulator import Accumulator, accumulator_step
from equiv.auditing import ExponentialAverage, audit
from equiv.cases.case import Case, InvalidCase
from equiv.checking.check import check
from equiv.checking.distributed import DistributedCase, check_distributed
from equiv.checking.distributed_search import DistributedSearchSpace, verify_distributed
from equiv.checking.pipeline import PipelineSetting, check_pipeline
from equiv.checking.search_space import SearchSpace
from equiv.checking.verify import verify
from equiv.cost.planner import NothingFitsError, plan
from equiv.distributed.launcher import DistributedCheckError, UnguardedMainError
from equiv.judging.contract import CandidateError, CandidateTimeout, ContractError
from equiv.judging.deadline import CheckTimeout
from equiv.losses import MSE, CrossEntropy, Loss, NextTokenCrossEntropy, TokenCrossEntropy
from equiv.outcomes import Outcome
from equiv.results.protocol import EquivalenceError, Result

#: The one place the version is written (pyproject.toml reads it from here).
__version__ = "0.1.0"

__all__ = [
    "MSE",
    "Accumulator",
    "CandidateError",
    "CandidateTimeout",
    "Case",
    "CheckTimeout",
    "ContractError",
    "CrossEntropy",
    "DistributedCase",
    "DistributedCheckError",
    "DistributedSearchSpace",
    "EquivalenceError",
    "ExponentialAverage",
    "InvalidCase",
    "Loss",
    "NextTokenCrossEntropy",
    "NothingFitsError",
    "Outcome",
    "PipelineSetting",
    "Result",
    "SearchSpace",
    "TokenCrossEntropy",
    "UnguardedMainError",
    "__version__",
    "accumulator_step",
    "audit",
    "check",
    "check_distributed",
    "check_pipeline",
    "plan",
    "strategies",
    "verify",
    "verify_distributed",
]

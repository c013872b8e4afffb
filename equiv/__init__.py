"""equiv: is your gradient accumulation equivalent to full-batch training?

The public API.  The code is grouped by layer, and imports flow one way::

    cli  ->  reporting  ->  findings  ->  peers  ->  auditing  ->  checking, cost  ->  cases, zoo, peers.adapters
         ->  accumulator, losses, batches, distributed

- ``accumulator``, ``losses``, ``batches``: the reference accumulator and the loss protocol;
- ``distributed``: spawning ranks, FSDP2 sharding and counted collectives (under checking and cost);
- ``cases``: what to run (:class:`Case`, models, standard cases, strategies);
- ``zoo``: known bugs the checker must catch;
- ``checking``: truth, floors and candidate runs, comparison, verdicts, search, distributed;
- ``cost``: memory, workloads, train steps, the cost model and the planner;
- ``auditing``: a real run watched through hooks, sampled steps judged against the full batch;
- ``peers``: other libraries' accumulation (adapters), driven as their users drive it and judged
  by the checker, one window or whole epochs (what reports/peers.md shows);
- ``findings``: what reports/equivalence.md shows, measured, as plain results;
- ``reporting``: the markdown reports, rendered from findings and peers' results (nothing there measures);
  ``cli``: the ``equiv`` command.
"""

from equiv import strategies  # the public Hypothesis strategies: equiv.strategies
from equiv.accumulator import Accumulator, WindowResult, accumulator_step
from equiv.auditing import Audit, AuditFailure, WindowAudit, audit
from equiv.cases.case import Case, InvalidCase
from equiv.cases.models import CausalLM, ModelBundle, register_model
from equiv.cases.moe import MoELayer, MoEModel
from equiv.checking.check import check
from equiv.checking.distributed import DistributedCase, DistributedCheckError, DistributedVerdict, check_distributed
from equiv.checking.distributed_search import DistributedSearchResult, verify_distributed
from equiv.checking.pipeline import PipelineSetting, PipelineVerdict, check_pipeline
from equiv.checking.search_space import SearchSpace
from equiv.checking.verify import VerifyResult, verify
from equiv.cost.memory import StepMemory, StorageCounter, measure_step_memory
from equiv.cost.planner import NothingFitsError, Plan, PlanRow, plan
from equiv.judging.contract import Candidate, CandidateError, ContractError
from equiv.judging.inherent import inherent_non_equivalences
from equiv.judging.judge import ReferenceRuns
from equiv.judging.runs import NonFiniteLossError, full_batch_step
from equiv.losses import (
    MSE,
    CrossEntropy,
    Loss,
    MSEWithAux,
    NextTokenCrossEntropy,
    TokenCrossEntropy,
    loss_sum_and_count,
)
from equiv.outcomes import Outcome
from equiv.results.facts import VerdictFacts
from equiv.results.verdict import CaseVerdicts, EquivalenceError, TensorDiff, Verdict

#: The one place the version is written (pyproject.toml reads it from here).
__version__ = "0.1.0"

__all__ = [
    "MSE",
    "Accumulator",
    "Audit",
    "AuditFailure",
    "Candidate",
    "CandidateError",
    "Case",
    "CaseVerdicts",
    "CausalLM",
    "ContractError",
    "CrossEntropy",
    "DistributedCase",
    "DistributedCheckError",
    "DistributedSearchResult",
    "DistributedVerdict",
    "EquivalenceError",
    "InvalidCase",
    "Loss",
    "MSEWithAux",
    "MoELayer",
    "MoEModel",
    "ModelBundle",
    "NextTokenCrossEntropy",
    "NonFiniteLossError",
    "NothingFitsError",
    "Outcome",
    "PipelineSetting",
    "PipelineVerdict",
    "Plan",
    "PlanRow",
    "ReferenceRuns",
    "SearchSpace",
    "StepMemory",
    "StorageCounter",
    "TensorDiff",
    "TokenCrossEntropy",
    "Verdict",
    "VerdictFacts",
    "VerifyResult",
    "WindowAudit",
    "WindowResult",
    "__version__",
    "accumulator_step",
    "audit",
    "check",
    "check_distributed",
    "check_pipeline",
    "full_batch_step",
    "inherent_non_equivalences",
    "loss_sum_and_count",
    "measure_step_memory",
    "plan",
    "register_model",
    "strategies",
    "verify",
    "verify_distributed",
]

"""equiv: is your gradient accumulation equivalent to full-batch training?

The public API; the code lives in one module per idea (see each module).
"""

from equiv import strategies  # the public Hypothesis strategies: equiv.strategies
from equiv.accumulator import Accumulator, WindowResult
from equiv.candidates import accumulator_step, loss_sum_and_count
from equiv.cases import Case, InvalidCase
from equiv.causal_lm import CausalLM  # importing it registers the "causal_lm" model family
from equiv.check import ReferenceRuns, check
from equiv.distributed import DistributedCase, DistributedCheckError, DistributedVerdict, check_distributed
from equiv.inherent import inherent_non_equivalences
from equiv.losses import MSE, CrossEntropy, Loss, TokenCrossEntropy
from equiv.memory import StepMemory, StorageCounter, measure_step_memory
from equiv.models import ModelBundle, register_model
from equiv.planner import NothingFitsError, Plan, PlanRow, plan
from equiv.trajectory import Candidate, CandidateError, NonFiniteLossError, full_batch_step
from equiv.verdict import EquivalenceError, TensorDiff, Verdict
from equiv.verify import VerifyResult, verify

__version__ = "0.1.0"

__all__ = [
    "MSE",
    "Accumulator",
    "Candidate",
    "CandidateError",
    "Case",
    "CausalLM",
    "CrossEntropy",
    "DistributedCase",
    "DistributedCheckError",
    "DistributedVerdict",
    "EquivalenceError",
    "InvalidCase",
    "Loss",
    "ModelBundle",
    "NonFiniteLossError",
    "NothingFitsError",
    "Plan",
    "PlanRow",
    "ReferenceRuns",
    "StepMemory",
    "StorageCounter",
    "TensorDiff",
    "TokenCrossEntropy",
    "Verdict",
    "VerifyResult",
    "WindowResult",
    "__version__",
    "accumulator_step",
    "check",
    "check_distributed",
    "full_batch_step",
    "inherent_non_equivalences",
    "loss_sum_and_count",
    "measure_step_memory",
    "plan",
    "register_model",
    "strategies",
    "verify",
]

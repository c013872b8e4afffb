"""Adapters: accumulation that people actually use, under the candidate contract.

Each adapter is a candidate ``step(model, optimizer, micro_batches, loss_fn)``
driving someone else's code, faithfully, bugs and all:

- :mod:`equiv.adapters.loops`: the textbook ``loss / N`` loop (nanoGPT) and
  equiv's own loop in torchtitan's style (normalised by the window's item count;
  a reference point, not torchtitan's code).
- :mod:`equiv.adapters.mindspore_ports`: the MindSpore tutorials' patterns
  (r1.0/r1.3 ``GradientAccumulation``, the r1.3 parallel-mode loss-scale cell,
  2.0 ``Accumulator``, r2.6 ``GradAccumulation``) ported to PyTorch.
- :mod:`equiv.adapters.accelerate`: Hugging Face Accelerate (extra ``accelerate``).
- :mod:`equiv.adapters.lightning`: PyTorch Lightning's Trainer (extra ``lightning``).
- :mod:`equiv.adapters.transformers`: Hugging Face transformers' ``Trainer``
  (extra ``peers``; transformers is imported only when a run starts).

Libraries with an epoch loop of their own also offer ``run_epochs`` (or, for
the transformers Trainer, ``train``): one run over whole epochs, as their users
drive them, judged by :mod:`equiv.peers.runs`.

Adapters with state that outlives one window (a step counter, a framework's
global state) start afresh when they are handed a model they have not seen,
which is what happens at the start of every run of a case: cases stay
independent.  The optional frameworks are imported only by their modules.
"""

from equiv.adapters.loops import textbook_step, torchtitan_step
from equiv.adapters.mindspore_ports import (
    MindSporeAccumulator,
    MindSporeAccuStepsWithLossScale,
    MindSporeGradAccumulation,
    MindSporeGradientAccumulation,
)

__all__ = [
    "MindSporeAccuStepsWithLossScale",
    "MindSporeAccumulator",
    "MindSporeGradAccumulation",
    "MindSporeGradientAccumulation",
    "textbook_step",
    "torchtitan_step",
]

"""The tensor-parallel section of reports/equivalence.md, rendered: clipping under TP and FSDP2 + TP.

The TP zoo's verdicts under ``"tp"`` and ``"fsdp2+tp"`` and what the search
under ``"tp"`` found, as :func:`equiv.findings.tensor_parallel.measure_tensor_parallel`
measured them (see there for the case, the splits and the search's settings).
Nothing here measures.
"""

from __future__ import annotations

from equiv.findings.results import TensorParallelFindings
from equiv.reporting.markdown import markdown_table

__all__ = ["tensor_parallel_section"]


def tensor_parallel_section(findings: TensorParallelFindings) -> str:
    """The section, from :func:`equiv.findings.tensor_parallel.measure_tensor_parallel`."""
    return "\n\n".join(
        [
            "## Tensor parallelism: clipping over DTensor shards",
            "`equiv.check_distributed(step, DistributedCase.of(case, split, tensor_parallel=2), engine=...)` on gloo "
            'ranks: `"tp"` applies `parallelize_module` (`ColwiseParallel` on the MLP\'s first `nn.Linear`, '
            "`RowwiseParallel` on its second, whose bias stays replicated) on a 1-D mesh of 2 ranks that see the same "
            'micro-batches; `"fsdp2+tp"` does the same inside each row of a 2 x 2 `(dp, tp)` mesh and then '
            "`fully_shard` over `dp`. Case: the MLP (4-8-3, tanh), Adam, 2 steps, clip norm 0.01 (active). Columns "
            "name the data ranks' micro-batches. The window's gradient norm must cover every shard of every parameter, "
            "replicated ones once, once per window: the reference `Accumulator` (`get_total_norm` on the DTensor "
            "gradients; under FSDP2 + TP the item count summed over the data ranks only) is exact under both. "
            "'search under TP': `verify_distributed(step, engines=('tp',), models=('mlp',), "
            f"max_examples={findings.examples}, seed={findings.seed})`, the split shrunk; the zoo weights micro-batches "
            "by its own samples, right under TP on every split, so what the search finds is the clipping.",
            markdown_table(findings.table),
        ]
    )

"""What reports/equivalence.md shows, measured: checks, searches, distributed runs and cost sweeps.

One module per report area, as :mod:`equiv.reporting` has one per section:
:mod:`~equiv.findings.equivalence` (the standard cases, the report's own
searches, and :func:`~equiv.findings.equivalence.measure_equivalence`, which
measures everything), :mod:`~equiv.findings.distributed` (DDP, FSDP2 and its
cost sweep, loss-scale windows), :mod:`~equiv.findings.distributed_findings`
(the distributed search, torchrun), :mod:`~equiv.findings.moe`,
:mod:`~equiv.findings.tensor_parallel` and :mod:`~equiv.findings.pipeline`.
Each returns plain results (:mod:`equiv.findings.results`: dataclasses and
DataFrames of already formatted cells), which :mod:`equiv.reporting` renders
and ``equiv report equivalence`` writes.  Above checking, cost, zoo and the
distributed machinery; below reporting (tests/test_layout.py).
"""

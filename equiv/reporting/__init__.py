"""Markdown reports: equivalence (standard cases, searches, distributed), peers, benchmarks.

Rendering only: each module turns measured results into its report's text
(:mod:`equiv.findings.results` for reports/equivalence.md,
:mod:`equiv.peers.results` for reports/peers.md, a ``pytest --benchmark-json``
file for reports/benchmarks.md) and imports nothing that measures
(tests/test_layout.py).  ``equiv report ...`` (``equiv.cli``) measures, then
hands the results here and writes the text.
"""

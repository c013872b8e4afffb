"""Markdown reports: equivalence (standard cases, searches, distributed), peers, benchmarks.

Each module builds its report's text; ``equiv report ...`` (``equiv.cli``) writes it.
"""

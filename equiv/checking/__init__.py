"""Checking a step: run the float64 truth, the floors and the candidate
(:mod:`~equiv.judging.runs`), compare them against derived allowances
(:mod:`~equiv.judging.tolerances`, :mod:`~equiv.judging.compare`) and say
what was found (:mod:`~equiv.results.verdict`); :func:`~equiv.checking.check.check`
for one case, :func:`~equiv.checking.verify.verify` to search, and
:mod:`~equiv.checking.distributed` for W ranks."""

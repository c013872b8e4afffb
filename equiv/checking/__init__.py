"""Checking a step: run the float64 truth, the floors and the candidate
(:mod:`~equiv.checking.trajectory`), compare them against derived allowances
(:mod:`~equiv.checking.tolerances`, :mod:`~equiv.checking.compare`) and say
what was found (:mod:`~equiv.checking.verdict`); :func:`~equiv.checking.check.check`
for one case, :func:`~equiv.checking.verify.verify` to search, and
:mod:`~equiv.checking.distributed` for W ranks."""

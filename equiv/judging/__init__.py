"""The engine under every verdict: runs, floors, comparison, allowances.

Every verdict equiv gives (a check, a search's case, a distributed or pipeline
check, an audited window, a peer's whole run) is made here, one way:

- :mod:`~equiv.judging.runs`: a run of a step from a case's start, one snapshot
  per optimizer step (the float64 truth, a floor sample, the candidate);
- :mod:`~equiv.judging.floors`: the ONE floor plan: which roundings of the same
  mathematics (dtypes x named variants: an order of the batch, normalising after
  backward) measure a tier's floor, and in which order they run;
- :mod:`~equiv.judging.compare`: the truth's trajectory, the floors' distances
  from it and the candidate's rows, streaming; :mod:`~equiv.judging.details`: a
  shown row's details (where, how many, NaN and inf, an update's cosine);
  :mod:`~equiv.judging.reductions`: the maxima read in few host transfers and the
  scratch buffers both reuse;
- :mod:`~equiv.judging.tolerances`: the allowance derived from a floor and the
  roundoff of the tier's dtype (nothing outside this package computes one);
- :mod:`~equiv.judging.judge`: :class:`~equiv.judging.judge.Judge`, which asks a
  *run source* for the truth, the floor samples the plan names (only while the
  verdict depends on them) and the candidate, and turns them into rows;
- :mod:`~equiv.judging.contract`, :mod:`~equiv.judging.deadline`,
  :mod:`~equiv.judging.inherent`: the candidate contract, the wall-clock limit,
  and the layers no accumulation can reproduce;
- :mod:`~equiv.judging.witness`: the weights a failing window gave each
  micro-batch's loss, recovered from its gradient and named (issue 44; not yet
  shown by the front doors).

No entry points and no messages here: the front doors (:mod:`equiv.checking`,
:mod:`equiv.auditing`, :mod:`equiv.peers`) build a run source, ask the judge and
wrap its rows in a result (:mod:`equiv.results`).
"""

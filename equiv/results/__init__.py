"""What every front door returns: the rows of a comparison
(:class:`~equiv.results.verdict.TensorDiff`), the verdict on one case
(:class:`~equiv.results.verdict.Verdict`), the verdict on W ranks
(:class:`~equiv.results.distributed.DistributedVerdict`), what of a verdict holds on every
machine (:mod:`~equiv.results.facts`), an audit's windows and counts (:mod:`~equiv.results.audit`), and the
weights a failing step gave its micro-batches (:mod:`~equiv.results.witness`, a failing check's ``weights``).

One protocol, one schema
------------------------
Every front door's result is an :class:`equiv.Result`
(:mod:`equiv.results.protocol`): ``status`` (an :class:`equiv.Outcome`),
``bool()`` (True only when it passed), ``message()``, ``line()``,
``to_dict()`` and ``assert_ok()``.  ``to_dict()`` writes JSON under the
versioned schema ``equiv/results/schema.json`` (shipped with the package;
:func:`equiv.results.protocol.schema` loads it), which is also what the
``equiv`` command's ``--json`` files hold::

    {"schema": "equiv.result/2",        # this schema's version
     "kind":   "verdict",               # which result (below)
     "status": "not_equivalent",        # an Outcome value
     "line":   "not equivalent: ...",   # line(): the result in one line
     ...}                               # the kind's own fields

========================  =====================================================  ==========================================
kind                      returned by                                            its own fields (besides the envelope)
========================  =====================================================  ==========================================
``verdict``               ``equiv.check(step, case)``                            candidate, case, outcome, inherent,
                                                                                 not_applicable, mismatches, worst, precision
``case_verdicts``         ``equiv.check(step)``, ``equiv check``,                candidate, setting, counts, cases (each a
                          ``equiv check-distributed``                            result with its case_name, or an error)
``verify``                ``equiv.verify``, ``equiv verify``                     candidate, found, counterexample, verdict,
                                                                                 outcome, seed, blob, search, ...
``distributed_verdict``   ``equiv.check_distributed``                            candidate, case, outcome, engine, world_size,
                                                                                 ranks (a verdict each), message, ...
``distributed_search``    ``equiv.verify_distributed``, ``verify-distributed``   candidate, engines, found, counterexample,
                                                                                 engine, verdict, outcome, error, ...
``pipeline_verdict``      ``equiv.check_pipeline``                               setting, description, worst_ratio, error,
                                                                                 fault
``audit``                 ``equiv.audit``                                        steps, every, audited, failures, windows
``window_audit``          one audited window (``Audit.windows``)                 step, micro_batches, items, tier,
                                                                                 mismatches, worst, inherent, hint
``run_verdict``           a peer's run in the peers survey                       steps, first_failure, mismatches
========================  =====================================================  ==========================================

``status`` is coarse (a failing precision finding is ``not_equivalent``);
``outcome``, where a kind has it, is the finer Outcome (``precision``).
Version 1 renamed the ``kind`` that verdicts and searches wrote (an Outcome)
to ``outcome``.  Fields may be added within a version; one renamed, dropped
or changed in meaning makes a new version.
"""

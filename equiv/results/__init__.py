"""What every front door returns: the rows of a comparison
(:class:`~equiv.results.verdict.TensorDiff`), the verdict on one case
(:class:`~equiv.results.verdict.Verdict`), and what of a verdict holds on every
machine (:mod:`~equiv.results.facts`)."""

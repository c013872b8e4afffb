"""What to run: a :class:`~equiv.cases.case.Case`, the models and losses it
names, the standard cases, a case on several ranks
(:class:`~equiv.cases.distributed.DistributedCase`), and the Hypothesis strategies that draw cases."""

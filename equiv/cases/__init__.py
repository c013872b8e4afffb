"""What to run: a :class:`~equiv.cases.case.Case`, the models and losses it
names, the standard cases, and the Hypothesis strategies that draw cases."""

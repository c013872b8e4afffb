"""``python -m equiv``: the same as the ``equiv`` command."""

from equiv.cli import console

console()

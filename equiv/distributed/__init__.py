"""The distributed machinery under equiv's checks and cost sweeps, below both:
:mod:`~equiv.distributed.launcher` runs a task on W spawned ranks and names
a rank that raises, hangs or dies; :mod:`~equiv.distributed.torchrun` runs
it on the ranks torchrun started instead; :mod:`~equiv.distributed.sharding` shards
a model with FSDP2 and gathers its shards; :mod:`~equiv.distributed.collectives`
counts the collectives a step makes; :mod:`~equiv.distributed.matching` names
ranks whose collectives do not line up; :mod:`~equiv.distributed.engines` holds the
parallel engines, one record each (how each wraps a rank's model).  It imports nothing of equiv above it:
:mod:`equiv.checking.distributed` (the judge) and :mod:`equiv.cost.fsdp` (the
cost sweep) import it."""

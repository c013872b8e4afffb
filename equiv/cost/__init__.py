"""What accumulation costs: peak memory per phase (:mod:`~equiv.cost.memory`),
the workloads and train steps measured (:mod:`~equiv.cost.workloads`,
:mod:`~equiv.cost.steps`), the fitted cost lines (:mod:`~equiv.cost.costmodel`)
and the N planner built on them (:mod:`~equiv.cost.planner`)."""

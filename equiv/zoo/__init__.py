"""Steps that equiv must judge correctly: known bugs (:mod:`~equiv.zoo.bugs`,
:mod:`~equiv.zoo.distributed_bugs`) and other people's accumulation driven
under the candidate contract (:mod:`~equiv.adapters`)."""

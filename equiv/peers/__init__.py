"""Peers: accumulation that people actually use, driven as its users drive it and judged by equiv's checker.

- :mod:`equiv.adapters`: each library (Accelerate, Lightning, the
  transformers Trainer, nanoGPT's loop, the MindSpore tutorials' patterns)
  under the candidate contract, and over whole epochs where it has its own loop;
- :mod:`equiv.judging.trajectories` (the engine's): a whole run judged step by
  step against a float64 reference, in both tiers, with the derived allowances
  of :func:`equiv.check`;
- :mod:`equiv.zoo.kinds` and :mod:`equiv.checking.failure_kinds`: the kinds of
  failure (mean of means, tail divided by N, ...) a failing run is named by,
  as ``equiv check``'s verdicts name them;
- :mod:`equiv.peers.runs`: the whole-run drivers (one DataLoader / one ``fit``
  / one ``Trainer.train()``) and their measurement;
- :mod:`equiv.peers.catalogue`: the peers, the situations they are measured
  in, and the known upstream issues;
- :mod:`equiv.peers.search`: the smallest counterexample (Hypothesis);
- :mod:`equiv.peers.trl`, :mod:`equiv.peers.torchtune`: TRL's GRPOTrainer /
  SFTTrainer and torchtune's full fine-tune recipe run as their users run them,
  every optimizer step audited (:func:`equiv.audit`) against the documented
  full-batch objective;
- :mod:`equiv.peers.survey`: everything reports/peers.md shows, measured into
  :mod:`equiv.peers.results` (plain data that :mod:`equiv.reporting.peers` renders).

Below :mod:`equiv.reporting` (which renders, never measures); the adapters sit
lower still (they need only the loss protocol), so :mod:`equiv.auditing` can
drive them.  Nothing is imported here: importing an adapter must not import the
checker, nor an optional framework.
"""

"""A queueing model of a serving fleet: modelled engines (:mod:`kvloop.shared.engine_model`) placed by the broker's
real core, replaying a multi-turn workload (:mod:`.sim`), with figures in ``kvloop bench load``'s shape."""

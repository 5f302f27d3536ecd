"""Cluster scheduling: policies that share GPUs among adaptive jobs, and a simulator.

* :mod:`stratagem.sched.policy` - one interface (:class:`~.policy.base.Policy`) and four
  policies: a goodput-aware one in the spirit of Pollux, Tiresias, Optimus and FIFO.
* :mod:`stratagem.sched.simulator` - a deterministic, trace-driven simulator that replays a
  workload against measured application profiles (``stratagem simulate``).

See ``docs/concepts/scheduling.md``.
"""

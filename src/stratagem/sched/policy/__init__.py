"""Scheduling policies behind one interface, and a registry by name.

A new policy: a class with ``name``, ``adaptive_batch`` and ``allocate(jobs, cluster,
current, now)`` (see :class:`~stratagem.sched.policy.base.Policy`) in its own module here,
registered in ``POLICIES``. Place replicas with :mod:`.placement` so the distribution rules
hold; :func:`~.base.check_allocation` tells whether they do.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from stratagem.errors import StratagemError
from stratagem.sched.policy.base import (
    Allocation,
    ClusterSpec,
    JobView,
    Policy,
    check_allocation,
)
from stratagem.sched.policy.fifo import FifoPolicy
from stratagem.sched.policy.optimus import OptimusPolicy
from stratagem.sched.policy.pollux import PolluxPolicy
from stratagem.sched.policy.pollux_paper import PolluxPaperPolicy
from stratagem.sched.policy.tiresias import TiresiasPolicy

POLICIES: dict[str, Callable[..., Policy]] = {
    "pollux": PolluxPolicy,
    "pollux-paper": PolluxPaperPolicy,
    "tiresias": TiresiasPolicy,
    "optimus": OptimusPolicy,
    "fifo": FifoPolicy,
}


def make_policy(name: str, **options: Any) -> Policy:
    """A fresh policy by name (``options`` go to its constructor)."""
    try:
        factory = POLICIES[name]
    except KeyError:
        raise StratagemError(f"unknown policy {name!r}", where="--policy",
                             fix=f"one of {', '.join(POLICIES)}") from None
    return factory(**options)


__all__ = ["POLICIES", "Allocation", "ClusterSpec", "FifoPolicy", "JobView", "OptimusPolicy",
           "Policy", "PolluxPaperPolicy", "PolluxPolicy", "TiresiasPolicy", "check_allocation",
           "make_policy"]

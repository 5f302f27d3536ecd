"""FIFO: jobs start in submission order with the replicas they asked for, and run to the end.

Strict order, no backfilling: when the oldest waiting job does not fit, nothing behind it
starts either. Running jobs are never moved.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from stratagem.sched.policy.base import Allocation, ClusterSpec, JobView
from stratagem.sched.policy.placement import NodeState


@dataclass
class FifoPolicy:
    name: str = "fifo"
    adaptive_batch: bool = False

    def allocate(self, jobs: Sequence[JobView], cluster: ClusterSpec,
                 current: Mapping[str, tuple[int, ...]], now: float) -> Allocation:
        state = NodeState(cluster)
        out: Allocation = {}
        for job in jobs:
            reps = tuple(sorted(current.get(job.name, ())))
            if reps and state.can_take(reps):
                state.take(reps)
                out[job.name] = reps
        for job in sorted(jobs, key=lambda j: (j.submit_time, j.name)):
            if job.name in out:
                continue
            count = min(job.requested_replicas, job.max_replicas, cluster.total_gpus)
            reps = state.place_and_take(max(count, job.min_replicas))
            if not reps:
                break
            out[job.name] = reps
        return out

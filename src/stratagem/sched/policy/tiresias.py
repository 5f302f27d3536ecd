"""Tiresias (Gu et al., NSDI 2019): two-dimensional least attained service, discretised.

A job's attained service is GPU-time (replicas x seconds run). Thresholds split jobs into
priority queues (fewer GPU-seconds: higher priority); within a queue, first come first
served. Each interval, jobs are admitted in priority order while their requested replicas
fit (skipping any that do not); running jobs that are no longer admitted are preempted.
Admitted running jobs keep their GPUs, new ones are placed consolidated. Jobs run with the
replicas and batch size they were submitted with. The default threshold, 16 GPU-hours, is
the one the Pollux artifact used for its Tiresias baseline.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from stratagem.sched.policy.base import Allocation, ClusterSpec, JobView
from stratagem.sched.policy.placement import NodeState, keep_or_place, pin


@dataclass
class TiresiasPolicy:
    thresholds: tuple[float, ...] = (16 * 3600.0,)  # GPU-seconds between queues
    name: str = "tiresias"
    adaptive_batch: bool = False

    def queue(self, job: JobView) -> int:
        return bisect.bisect_right(sorted(self.thresholds), job.attained_service)

    def allocate(self, jobs: Sequence[JobView], cluster: ClusterSpec,
                 current: Mapping[str, tuple[int, ...]], now: float) -> Allocation:
        state = NodeState(cluster)
        pinned = pin(jobs, current, state)
        order = sorted((j for j in jobs if j.name not in pinned),
                       key=lambda j: (self.queue(j), j.submit_time, j.name))
        free = state.total_free
        counts: dict[str, int] = {}
        for job in order:
            count = max(min(job.requested_replicas, job.max_replicas), job.min_replicas)
            if count <= free:
                counts[job.name] = count
                free -= count
        return {**pinned, **keep_or_place([j.name for j in order], counts, current, state)}

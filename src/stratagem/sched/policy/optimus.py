"""Optimus (Peng et al., EuroSys 2018), with oracle knowledge of each job's remaining work.

Each job's remaining time on (nodes, replicas) comes from ``JobView.remaining_time`` (the
simulator knows the true remaining progress and step times). Every job that fits gets one
replica, shortest remaining time first; then GPUs go one at a time to the job whose
remaining time drops the most, until none is left or no job gains. Jobs keep their
submitted batch size.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from stratagem.sched.policy.base import Allocation, ClusterSpec, JobView
from stratagem.sched.policy.placement import NodeState, keep_or_place, pin


def _time(job: JobView, replicas: int, gpn: int) -> float:
    if replicas <= 0:
        return math.inf
    if job.remaining_time is None:
        return 1.0 / replicas
    return job.remaining_time(math.ceil(replicas / gpn), replicas)


@dataclass
class OptimusPolicy:
    name: str = "optimus"
    adaptive_batch: bool = False

    def allocate(self, jobs: Sequence[JobView], cluster: ClusterSpec,
                 current: Mapping[str, tuple[int, ...]], now: float) -> Allocation:
        gpn = cluster.gpus_per_node
        state = NodeState(cluster)
        pinned = pin(jobs, current, state)
        jobs = [j for j in jobs if j.name not in pinned]
        free = state.total_free
        memo: dict[tuple[str, int], float] = {}

        def t(job: JobView, r: int) -> float:
            if (job.name, r) not in memo:
                memo[job.name, r] = _time(job, r, gpn)
            return memo[job.name, r]

        order = sorted(jobs, key=lambda j: (t(j, max(j.min_replicas, 1)),
                                            j.submit_time, j.name))
        counts: dict[str, int] = {}
        for job in order:
            need = max(job.min_replicas, 1)
            if need <= free and need <= job.max_replicas:
                counts[job.name] = need
                free -= need
        views = {j.name: j for j in jobs}
        while free > 0:
            best, gain = None, 0.0
            for name, r in counts.items():
                job = views[name]
                if r < job.max_replicas:
                    g = t(job, r) - t(job, r + 1)
                    if g > gain:
                        best, gain = name, g
            if best is None:
                break
            counts[best] += 1
            free -= 1
        names = sorted(counts, key=lambda n: (-counts[n], n))
        out = keep_or_place(names, counts, current, state)
        for name in names:  # could not be placed at its count: the largest that fits
            r = counts[name] - 1
            while name not in out and r >= max(views[name].min_replicas, 1):
                reps = state.place_and_take(r)
                if reps:
                    out[name] = reps
                r -= 1
        return {**pinned, **out}

"""Cost-aware cluster size: grow while one more node's marginal goodput is worth its cost.

In AdaptDL's spirit, the cluster's *utility* at ``n`` nodes is the sum of the jobs'
speedups (goodput relative to one replica, from each job's own goodput model; linear for a
job without one) when the ``n * gpus_per_node`` accelerators go, one at a time, to the job
that gains most from one more (within its ``[min, max]`` replicas). The target is the
largest ``n`` whose last node still adds at least ``node_cost`` speedup units, and never
fewer nodes than the jobs' minimum replicas need. :func:`request_nodes` asks Ray's
autoscaler for it (``ray.autoscaler.sdk.request_resources``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from stratagem.sched.policy import JobView, PolluxPolicy


@dataclass(frozen=True)
class AutoscaleOptions:
    """``node_cost``: speedup units one node must add to be worth it (e.g. 0.5: half a
    replica's worth of goodput per node); ``min_nodes``/``max_nodes``: bounds;
    ``node_gpus``: accelerators of a node the autoscaler adds, used while the cluster has
    no node with accelerators yet (afterwards its nodes say)."""

    node_cost: float = 1.0
    min_nodes: int = 0
    max_nodes: int = 16
    node_gpus: int = 1


def speedup_table(job: JobView, max_r: int, gpus_per_node: int) -> np.ndarray:
    """Speedup at 0..max_r replicas relative to one replica (the job's goodput model)."""
    return PolluxPolicy(fairness=1.0, restart_delay=0.0).speedups(job, max_r, 1, gpus_per_node)


def utility_curve(jobs: Sequence[JobView], gpus_per_node: int, max_nodes: int) -> list[float]:
    """Cluster utility at 0..max_nodes nodes (greedy marginal allocation of accelerators)."""
    total = max_nodes * gpus_per_node
    tables = {j.name: speedup_table(j, min(j.max_replicas, total), gpus_per_node)
              for j in jobs}
    counts = {j.name: 0 for j in jobs}
    limits = {j.name: min(j.max_replicas, total) for j in jobs}
    floor = {j.name: j.min_replicas for j in jobs}
    curve, utility = [0.0], 0.0
    for gpu in range(1, total + 1):
        best, gain = None, -math.inf
        for name, table in tables.items():
            c = counts[name]
            if c >= limits[name]:
                continue
            step = floor[name] if c == 0 else c + 1  # a job starts at its minimum
            if step > limits[name] or step - c > total - gpu + 1:
                continue
            g = (table[step] - table[c]) / (step - c)
            if g > gain:
                best, gain = name, g
        if best is not None:
            c = counts[best]
            new = floor[best] if c == 0 else c + 1
            utility += float(tables[best][new] - tables[best][c])
            counts[best] = new
        if gpu % gpus_per_node == 0:
            curve.append(utility)
    return curve


def target_nodes(jobs: Sequence[JobView], gpus_per_node: int,
                 options: AutoscaleOptions = AutoscaleOptions()) -> int:
    """The cost-aware number of nodes for ``jobs`` (module doc)."""
    if not jobs:
        return options.min_nodes
    curve = utility_curve(jobs, gpus_per_node, options.max_nodes)
    need = math.ceil(sum(j.min_replicas for j in jobs) / gpus_per_node)
    n = max(options.min_nodes, min(need, options.max_nodes))
    while n < options.max_nodes and curve[n + 1] - curve[n] >= options.node_cost:
        n += 1
    return n


def request_nodes(nodes: int, node_bundle: dict[str, float],
                  request: Callable[..., None] | None = None) -> list[dict[str, float]]:
    """Ask the Ray autoscaler for ``nodes`` nodes of ``node_bundle``; the bundles asked."""
    bundles = [dict(node_bundle) for _ in range(nodes)]
    if request is None:
        from ray.autoscaler.sdk import request_resources as request
    request(bundles=bundles)
    return bundles

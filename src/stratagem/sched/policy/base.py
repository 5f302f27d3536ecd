"""The policy interface: jobs and cluster in, an allocation out, and the rules it must keep.

An allocation maps a job name to the node index of each of its replicas (sorted), e.g.
``{"a": (0, 0, 1, 1)}``: two GPUs on node 0 and two on node 1. A job absent (or with an
empty tuple) gets nothing. :func:`check_allocation` names every broken constraint; the
simulator runs it after each decision, and so do the property tests.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from stratagem.adapt import GoodputFunction

Allocation = dict[str, tuple[int, ...]]


@dataclass(frozen=True)
class ClusterSpec:
    """Nodes and their GPUs; ``share_distributed``: may two multi-node jobs share a node."""

    num_nodes: int = 16
    gpus_per_node: int = 4
    share_distributed: bool = False

    @property
    def total_gpus(self) -> int:
        return self.num_nodes * self.gpus_per_node


@dataclass(frozen=True)
class JobView:
    """What a policy may know about one active job.

    ``min_replicas``/``max_replicas``: an allocated job gets between them (0 is always
    allowed unless the job is non-preemptible and running). ``goodput``: the job's own
    goodput model (throughput model + gradient noise), with the batch limits it optimises
    under. ``requested_replicas``: what the submitter asked for (Tiresias, FIFO).
    ``remaining_time``: oracle seconds to finish on (nodes, replicas) (Optimus).
    ``uncapped_max_replicas``: the bound ``max_replicas`` would have without an exploration
    cap (a new job may grow to at most twice the replicas it has run on); None: no cap
    applies. A policy may plan towards it (keep GPUs for the job's next growth steps).
    """

    name: str
    submit_time: float
    age: float = 0.0
    attained_service: float = 0.0  # GPU-seconds received so far
    num_restarts: int = 0
    min_replicas: int = 1
    max_replicas: int = 64
    preemptible: bool = True
    requested_replicas: int = 1
    goodput: GoodputFunction | None = None
    max_batch_size: int | None = None
    local_bsz_bounds: tuple[int | None, int | None] = (None, None)
    gradient_accumulation: bool = True
    remaining_time: Callable[[int, int], float] | None = None
    uncapped_max_replicas: int | None = None


@runtime_checkable
class Policy(Protocol):
    """A scheduling policy. ``adaptive_batch``: do jobs under it choose their batch size by
    goodput (the goodput-aware policy), or keep the submitted one (the baselines)."""

    name: str
    adaptive_batch: bool

    def allocate(self, jobs: Sequence[JobView], cluster: ClusterSpec,
                 current: Mapping[str, tuple[int, ...]], now: float) -> Allocation:
        """The next allocation of ``jobs`` on ``cluster``, given the ``current`` one."""
        ...


def per_node(replicas: Sequence[int]) -> dict[int, int]:
    """Node index -> replicas there."""
    return dict(Counter(replicas))


def check_allocation(alloc: Mapping[str, Sequence[int]], jobs: Sequence[JobView],
                     cluster: ClusterSpec,
                     current: Mapping[str, Sequence[int]] | None = None) -> list[str]:
    """Every constraint ``alloc`` breaks, as readable lines (empty: valid)."""
    errors: list[str] = []
    views = {j.name: j for j in jobs}
    used: Counter[int] = Counter()
    distributed: Counter[int] = Counter()
    for name, reps in alloc.items():
        if name not in views:
            errors.append(f"{name}: not an active job")
            continue
        job, count = views[name], len(reps)
        if count and not job.min_replicas <= count <= job.max_replicas:
            errors.append(f"{name}: {count} replicas outside [{job.min_replicas}, "
                          f"{job.max_replicas}]")
        nodes = per_node(reps)
        for node in nodes:
            if not 0 <= node < cluster.num_nodes:
                errors.append(f"{name}: node {node} does not exist")
        used.update(nodes)
        if len(nodes) > 1:
            distributed.update(nodes.keys())
    for node, n in used.items():
        if n > cluster.gpus_per_node:
            errors.append(f"node {node}: {n} replicas on {cluster.gpus_per_node} GPUs")
    if not cluster.share_distributed:
        errors += [f"node {node}: {n} distributed jobs share it"
                   for node, n in distributed.items() if n > 1]
    for job in jobs:
        before = tuple(sorted((current or {}).get(job.name, ())))
        if not job.preemptible and before and tuple(sorted(alloc.get(job.name, ()))) != before:
            errors.append(f"{job.name}: non-preemptible job was moved or stopped")
    return errors

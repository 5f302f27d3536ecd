"""Placing a job's replicas on nodes: consolidated, and keeping the distribution rules.

Shared by every policy. A job that fits on one node goes to the fullest node that still has
room (best fit, leaving whole nodes for large jobs); a larger job takes the emptiest nodes
that no other distributed job uses (unless the cluster allows sharing), as few as possible.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from stratagem.sched.policy.base import Allocation, ClusterSpec, JobView, per_node


class NodeState:
    """Free GPUs per node and which nodes host a distributed job."""

    def __init__(self, cluster: ClusterSpec) -> None:
        self.cluster = cluster
        self.free = [cluster.gpus_per_node] * cluster.num_nodes
        self.distributed = [0] * cluster.num_nodes  # distributed jobs on each node

    @property
    def total_free(self) -> int:
        return sum(self.free)

    def can_take(self, replicas: Sequence[int]) -> bool:
        nodes = per_node(replicas)
        if any(self.free[n] < k for n, k in nodes.items()):
            return False
        return len(nodes) <= 1 or self.cluster.share_distributed or not any(
            self.distributed[n] for n in nodes)

    def take(self, replicas: Sequence[int]) -> None:
        nodes = per_node(replicas)
        for n, k in nodes.items():
            self.free[n] -= k
            if len(nodes) > 1:
                self.distributed[n] += 1

    def release(self, replicas: Sequence[int]) -> None:
        """Undo :meth:`take`."""
        nodes = per_node(replicas)
        for n, k in nodes.items():
            self.free[n] += k
            if len(nodes) > 1:
                self.distributed[n] -= 1

    def place(self, count: int) -> tuple[int, ...] | None:
        """Consolidated replicas for a job of ``count`` (not yet taken), or None."""
        if count <= 0:
            return ()
        gpn = self.cluster.gpus_per_node
        if count <= gpn:
            fits = [n for n in range(len(self.free)) if self.free[n] >= count]
            if fits:
                node = min(fits, key=lambda n: (self.free[n], n))
                return (node,) * count
        usable = [n for n in range(len(self.free)) if self.free[n] > 0 and (
            self.cluster.share_distributed or not self.distributed[n])]
        usable.sort(key=lambda n: (-self.free[n], n))
        out: list[int] = []
        for n in usable:
            take = min(self.free[n], count - len(out))
            out += [n] * take
            if len(out) == count:
                return tuple(sorted(out))
        return None

    def place_and_take(self, count: int) -> tuple[int, ...] | None:
        reps = self.place(count)
        if reps:
            self.take(reps)
        return reps


def pin(jobs: Sequence[JobView], current: Mapping[str, Sequence[int]],
        state: NodeState) -> Allocation:
    """Keep every running non-preemptible job where it is (taken from ``state``)."""
    out: Allocation = {}
    for job in jobs:
        before = tuple(sorted(current.get(job.name, ())))
        if not job.preemptible and before:
            state.take(before)
            out[job.name] = before
    return out


def keep_or_place(order: Iterable[str], counts: Mapping[str, int],
                  current: Mapping[str, Sequence[int]], state: NodeState) -> Allocation:
    """Place jobs in ``order`` with ``counts[name]`` replicas: first every job whose count is
    unchanged on its current nodes (no restart), then the rest consolidated."""
    names = [n for n in order if counts.get(n, 0) > 0]
    out: Allocation = {}
    for name in names:
        before = tuple(sorted(current.get(name, ())))
        if len(before) == counts[name] and state.can_take(before):
            state.take(before)
            out[name] = before
    for name in names:
        if name not in out:
            reps = state.place_and_take(counts[name])
            if reps:
                out[name] = reps
    return out


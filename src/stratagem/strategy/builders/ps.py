"""Parameter-server builders: one server, load-balanced, partitioned, unevenly partitioned.

Every builder here sends each parameter's gradient (or each part's) to one owner with a
:class:`PSSynchronizer`. The owners are the *available servers* of the resource spec
(:func:`ps_servers`): its dedicated server devices (``ADDRESS:PS:0``, one per node with
``workers: 0``) when it has any, else the worker replicas themselves (colocated PS: every
worker can own parameters or shards).

Placement is greedy and exact: loads are integer byte counts, ties go to the server listed
first, and parameters are visited largest first (ties in profile order), so the same
profile and spec always give the same strategy. The output lists parameters in profile
order. See docs/reference/ps-builders.md for the rules and how they differ from AutoDist's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from fractions import Fraction

from stratagem.analysis.profile import ModelProfile, ParamInfo
from stratagem.errors import StrategyError
from stratagem.resource import ResourceSpec
from stratagem.strategy.builders.base import register
from stratagem.strategy.schema import (
    GraphConfig,
    NodeConfig,
    Partitioner,
    PSSynchronizer,
    Strategy,
)
from stratagem.strategy.validate import server_devices


# ----------------------------------------------------------------------------- servers
def ps_servers(spec: ResourceSpec) -> list[str]:
    """The devices that may own parameters: dedicated servers if any, else the replicas."""
    return server_devices(spec) or list(spec.replicas)


def ps_capacities(spec: ResourceSpec) -> list[Fraction]:
    """Each :func:`ps_servers` device's share of its node's network bandwidth (Gbit/s).

    A dedicated server has its node's whole link; colocated servers (worker replicas) on one
    node share that node's link equally. PS traffic for a shard is proportional to its bytes,
    so bytes per unit of capacity is the time a server spends moving its shards.
    """
    share: dict[str, Fraction] = {}
    dedicated = bool(server_devices(spec))
    for node in spec.nodes:
        if dedicated:
            devices = [f"{node.address}:PS:0"] if node.workers == 0 else []
        else:
            devices = node.worker_devices()
        for d in devices:
            share[d] = Fraction(node.network_bandwidth) / len(devices)
    return [share[d] for d in ps_servers(spec)]


# ----------------------------------------------------------------------------- options
def check_ps_options(local_proxy_variable: bool, sync: bool, staleness: int) -> None:
    """Constructor checks shared by every builder that emits PS synchronizers."""
    for name, value in (("local_proxy_variable", local_proxy_variable), ("sync", sync)):
        if not isinstance(value, bool):
            raise StrategyError(f"{name} must be true or false, got {value!r}",
                                fix=f"pass {name}=True or {name}=False")
    if not isinstance(staleness, int) or isinstance(staleness, bool):
        raise StrategyError(f"staleness must be an integer, got {staleness!r}",
                            fix="pass a whole number of steps, e.g. staleness=0")
    if staleness < 0:
        raise StrategyError(f"staleness must be >= 0, got {staleness}",
                            fix="use 0 for bulk-synchronous training, or a positive bound")
    if not sync and staleness:
        raise StrategyError(f"staleness={staleness} needs sync=True (asynchronous training "
                            "has no staleness bound)",
                            fix="pass sync=True for bounded staleness, or staleness=0 for "
                                "asynchronous training")


# ----------------------------------------------------------------------------- placement
def partitionable(info: ParamInfo, num_servers: int) -> bool:
    """Whether a parameter can be split along axis 0 over several servers."""
    return num_servers > 1 and len(info.shape) >= 1 and info.shape[0] >= 2 and info.bytes > 0


def largest_first(params: list[ParamInfo]) -> list[ParamInfo]:
    """Visiting order of the greedy placers: bytes descending, then profile order."""
    order = {p.name: i for i, p in enumerate(params)}
    return sorted(params, key=lambda p: (-p.bytes, order[p.name]))


class Placer:
    """Greedy loads (bytes) on the servers, optionally weighted by server capacity.

    With uniform capacity every method keeps the invariant *max load - min load <= the
    largest piece placed so far* (a piece is a whole parameter or one shard), hence
    ``max <= mean + (1 - 1/S) * largest piece`` on ``S`` servers.
    """

    def __init__(self, servers: list[str], capacity: list[Fraction] | None = None) -> None:
        if not servers:
            raise StrategyError("the resource spec has no device to own parameters",
                                fix="give a node 'workers: 1' or more")
        self.servers = servers
        self.capacity = capacity or [Fraction(1)] * len(servers)
        self.load = [0] * len(servers)

    def least_loaded(self, k: int) -> list[int]:
        """Indices of the ``k`` least-loaded servers (by load/capacity, then list order)."""
        return sorted(range(len(self.servers)),
                      key=lambda s: (self.load[s] / self.capacity[s], s))[:k]

    def whole(self, nbytes: int) -> list[tuple[int, int]]:
        """Place an unsplit piece where it ends least loaded: ``[(server, 0)]``."""
        s = min(range(len(self.servers)),
                key=lambda s: ((self.load[s] + nbytes) / self.capacity[s], s))
        self.load[s] += nbytes
        return [(s, 0)]

    def even(self, rows: int, row_bytes: int) -> list[tuple[int, int]]:
        """Split ``rows`` into ``min(S, rows)`` near-equal parts on distinct servers.

        Part lengths follow :meth:`Partitioner.part_sizes` (the first ``rows % k`` parts one
        row longer); the longest part goes to the least-loaded server. Returns
        ``[(server, rows)]`` in part order.
        """
        k = min(len(self.servers), rows)
        sizes = [rows // k + (1 if i < rows % k else 0) for i in range(k)]
        out = []
        for s, n in zip(self.least_loaded(k), sizes, strict=True):
            self.load[s] += n * row_bytes
            out.append((s, n))
        return out

    def level(self, rows: int, row_bytes: int) -> list[tuple[int, int]]:
        """Water-filling: split ``rows`` so load/capacity ends as level as possible.

        The continuous solution raises the least-loaded servers (load/capacity) to one
        common level ``T``; each server's share is rounded down to whole rows and the few
        left-over rows go, one at a time, where they end least loaded. Servers that get no
        row get no part, so small parameters land on one or a few servers. Exact
        (``Fraction``) arithmetic. Returns ``[(server, rows)]`` in server order.
        """
        cap, load = self.capacity, self.load
        total = rows * row_bytes
        order = sorted(range(len(cap)), key=lambda s: (load[s] / cap[s], s))
        sum_load, sum_cap = 0, Fraction(0)
        for i, s in enumerate(order):
            sum_load += load[s]
            sum_cap += cap[s]
            level = (total + sum_load) / sum_cap
            nxt = order[i + 1] if i + 1 < len(order) else None
            if nxt is None or level <= load[nxt] / cap[nxt]:
                active = order[: i + 1]
                break
        share = [0] * len(cap)
        for s in active:  # level >= load[s]/cap[s] for every active server
            share[s] = math.floor((level * cap[s] - load[s]) / row_bytes)
        for _ in range(rows - sum(share)):  # fewer than len(active) rows
            s = min(range(len(cap)),
                    key=lambda s: ((load[s] + (share[s] + 1) * row_bytes) / cap[s], s))
            share[s] += 1
        out = [(s, n) for s, n in enumerate(share) if n]
        for s, n in out:
            load[s] += n * row_bytes
        return out


def ps_node(info: ParamInfo, pieces: list[tuple[int, int]], placer: Placer,
            make: PSSynchronizer, explicit_sizes: bool = False) -> NodeConfig:
    """A NodeConfig for ``info``: one owner, or axis-0 parts ``NAME/part_i`` on their owners."""
    dest = [placer.servers[s] for s, _ in pieces]
    if len(pieces) == 1:
        return NodeConfig(var_name=info.name,
                          synchronizer=replace(make, reduction_destination=dest[0]))
    splits = [1] * len(info.shape)
    splits[0] = len(pieces)
    sizes = tuple(n for _, n in pieces) if explicit_sizes else None
    parts = tuple(NodeConfig(var_name=f"{info.name}/part_{i}",
                             synchronizer=replace(make, reduction_destination=d))
                  for i, d in enumerate(dest))
    return NodeConfig(var_name=info.name, partitioner=Partitioner(tuple(splits), sizes),
                      part_config=parts)


# ----------------------------------------------------------------------------- builders
@dataclass(frozen=True)
class _PSBuilder:
    local_proxy_variable: bool = False
    sync: bool = True
    staleness: int = 0

    def __post_init__(self) -> None:
        check_ps_options(self.local_proxy_variable, self.sync, self.staleness)

    def synchronizer(self, dest: str = "") -> PSSynchronizer:
        return PSSynchronizer(reduction_destination=dest,
                              local_replication=self.local_proxy_variable,
                              sync=self.sync, staleness=self.staleness)

    def placer(self, spec: ResourceSpec) -> Placer:
        return Placer(ps_servers(spec))

    def place(self, info: ParamInfo, placer: Placer) -> NodeConfig:
        raise NotImplementedError

    def build(self, profile: ModelProfile, spec: ResourceSpec) -> Strategy:
        placer = self.placer(spec)
        placed = {info.name: self.place(info, placer)
                  for info in largest_first(list(profile.params))}
        nodes = tuple(placed[info.name] for info in profile.params)
        return Strategy(node_config=nodes, graph_config=GraphConfig(tuple(spec.replicas)),
                        builder=type(self).__name__)


@register("PS")
@dataclass(frozen=True)
class PS(_PSBuilder):
    """Every parameter on one server: the first dedicated server, else the chief's first
    worker replica (colocated)."""

    def place(self, info: ParamInfo, placer: Placer) -> NodeConfig:
        return NodeConfig(var_name=info.name, synchronizer=self.synchronizer(placer.servers[0]))


@register("PSLoadBalancing")
@dataclass(frozen=True)
class PSLoadBalancing(_PSBuilder):
    """Whole parameters spread over the servers: largest first, each onto the server with
    the fewest bytes so far (LPT; max load <= (4/3 - 1/(3S)) x optimal)."""

    def place(self, info: ParamInfo, placer: Placer) -> NodeConfig:
        return ps_node(info, placer.whole(info.bytes), placer, self.synchronizer())


@register("PartitionedPS")
@dataclass(frozen=True)
class PartitionedPS(_PSBuilder):
    """Each parameter split along axis 0 into ``min(servers, rows)`` near-equal parts on
    distinct servers, the longest part onto the least-loaded server. Not split: scalars,
    one-row and empty parameters, and everything when there is a single server."""

    def place(self, info: ParamInfo, placer: Placer) -> NodeConfig:
        if not partitionable(info, len(placer.servers)):
            return ps_node(info, placer.whole(info.bytes), placer, self.synchronizer())
        pieces = placer.even(info.shape[0], info.bytes // info.shape[0])
        return ps_node(info, pieces, placer, self.synchronizer())


@register("UnevenPartitionedPS")
@dataclass(frozen=True)
class UnevenPartitionedPS(_PSBuilder):
    """Each parameter split along axis 0 with explicit ``part_sizes`` chosen by
    water-filling: the rows go where they bring every server's bytes per unit of capacity
    (its share of its node's network bandwidth) to one level. Shards are sized in
    proportion to capacity on a fresh cluster, and shrink on servers already loaded."""

    def placer(self, spec: ResourceSpec) -> Placer:
        return Placer(ps_servers(spec), ps_capacities(spec))

    def place(self, info: ParamInfo, placer: Placer) -> NodeConfig:
        if not partitionable(info, len(placer.servers)):
            return ps_node(info, placer.whole(info.bytes), placer, self.synchronizer())
        pieces = placer.level(info.shape[0], info.bytes // info.shape[0])
        return ps_node(info, pieces, placer, self.synchronizer(), explicit_sizes=True)

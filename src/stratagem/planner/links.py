"""The network as the planner sees it: which device sits on which node, each node's link
(effective bandwidth, per-message latency), and the time a set of transfers takes.

Transfers are *flows* ``(source device, destination device, bytes)`` that run at the same
time. Flows between two nodes cross both nodes' links; a link carries its egress and its
ingress at full rate each (full duplex), so the time is the most loaded direction of the
most loaded link. Flows inside a node (two workers on one machine) go through memory at
``intra_bps`` per sending process. Several nodes sending into one node at once lose some
of their rate to incast (TCP losses in a shallow queue), ``incast_penalty`` per extra
sender.

Constants (see docs/concepts/auto-strategy-history.md for where each comes from):
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

from stratagem.resource import ResourceSpec
from stratagem.strategy.validate import server_devices

GBIT_BYTES = 1e9 / 8
LINK_EFFICIENCY = 0.953
"""Effective / nominal rate: bench/link_rate.py measured 0.953 Gbit/s gloo all-reduce bus
bandwidth (0.958 Gbit/s TCP) on a 1 Gbit/s link."""
INTRA_NODE_GBPS = 40.0
"""Two processes on one node exchange through loopback TCP (gloo): a memory copy on each
side, an estimate of a few GB/s on this class of machine."""
MESSAGE_LATENCY_S = 50e-6
"""One message's fixed cost on the wire and in gloo (a ring step, a point-to-point send):
the order of a loopback/veth TCP round trip."""
MESSAGE_CPU_S = 100e-6
"""Main-thread CPU per parameter-server message (posting sends and receives): bench/README
measured ~25% of a 36 ms PartitionedPS step (about 9 ms) for about 50-90 messages per
worker per step on 4 nodes sharing 2 cores."""
INCAST_PENALTY = 0.02
"""Rate lost per extra sender into one link: PartitionedPS moved the same bytes as
DDP's ring 1-4% slower with three owners sending into each downlink (bench/README,
13,147 TCP retransmissions against 72)."""
SMALL_BYTES = 16 * 2 ** 20
"""The largest all-reduce of the probe's bandwidth fit..."""
BIG_BYTES = 64 * 2 ** 20
"""...and its one large all-reduce (``probe.BIG_MIB``)."""
MEASURED_DIFFERS = 0.10
"""A probed bandwidth replaces the spec's when it is lower by more than this share..."""
MEASURED_FASTER = 1.5
"""...or higher by more than this factor. Between the two, a faster reading is taken for
the probe's own error, not the link's: at 4 nodes on a 1 Gbit/s link the ring formula read
gloo's all-reduces of 0.25-4 MiB as 1.15x the spec's effective rate, which point-to-point
PS traffic cannot reach."""


@dataclass(frozen=True)
class LinkModel:
    """Per-device node, per-node link rate (bytes/s, effective) and the fixed costs."""

    node_of: dict[str, int]
    nic_bps: tuple[float, ...]
    intra_bps: float = INTRA_NODE_GBPS * GBIT_BYTES
    latency_s: float = MESSAGE_LATENCY_S
    message_cpu_s: float = MESSAGE_CPU_S
    incast_penalty: float = INCAST_PENALTY
    names: tuple[str, ...] = ()  # node addresses, for reports
    all_to_all_s: float = 0.0
    """Measured seconds of one small all-to-all in a chain (the sparse rows' exchange); 0:
    not measured, priced as a ring step's latency plus a message per peer."""
    pull_round_s: float = 0.0
    """Measured seconds of one on-demand pull round of the sparse exchange in a chain (an
    embedding call's: two all-to-alls and the work between them); 0: not measured, priced
    as its two all-to-alls."""
    pull_round_one_s: float = 0.0
    """Measured seconds of such a round where the table has one owner (the others ask, it
    serves: no exchange carries rows both ways); 0: not measured, priced as
    ``pull_round_s``."""
    pull_row_one_s: float = 0.0
    """Its measured seconds per row asked (with ``pull_round_one_s``)."""
    sparse_push_s: float = 0.0
    """Measured seconds of the rest of such a sparse step after its closing round (push,
    the owners' sparse update); 0: not measured, priced as its two all-to-alls."""
    closing_s: float = 0.0
    """Measured seconds of the closing pull round (run in the background during backward);
    0: not measured, priced as one all-to-all."""
    pull_row_s: float = 0.0
    """Measured seconds per row a worker asks for in a pull round, beyond its wire time."""
    push_row_s: float = 0.0
    """Measured seconds per row a worker pushes (and its owner applies), beyond its wire
    time."""
    half_rates: tuple[tuple[str, float], ...] = ()
    """Measured (compressor, bytes/s of its all-reduce over fp32's): gloo sums fp16 in
    software, slower per byte than fp32 where the CPU, not the wire, bounds the ring.
    A compressor not listed moves its bytes at fp32's rate."""

    group_fixed_s: float = 0.0
    """Measured fixed seconds of one all-reduce group in the runtime (a small all-reduce
    among queued ones, beyond its wire time); 0: not measured, ``2(n-1)`` latencies."""
    group_period_s: float = 0.0
    """Measured seconds of a small all-reduce among queued ones, its bytes in it: the least
    a queued group takes. Set where the link, not the hosts' cores, bounds the ring (the
    all-reduces' bus rate within ``MEASURED_DIFFERS`` of one link alone): the CPU waits on
    the wire, and the next group is set up while a group's bytes move, so a group takes
    the longer of this and its bytes' time with a collective's latency, plus the
    ``interference`` share of what adding its fixed cost would price more (the share of
    the bytes' time the CPU is busy moving them). 2 nodes at 1 Gbit/s: queued all-reduces
    of 16-64 KiB took 2.3-2.7 ms each, of 256 KiB to 4 MiB their wire time and no more,
    and many_small's partitioned all-reduce was priced 35-40% slow with the two added.
    (0: bytes and fixed cost added, as where the cores bound the ring: at 10 Gbit/s on
    shared cores moving bytes is CPU work beside the backward pass.)"""
    big_rate: float = 0.0
    """Measured bus rate of a ``BIG_BYTES`` all-reduce over the small ones' (0: not
    measured). Rings past ``SMALL_BYTES`` move towards it (see :meth:`size_factor`)."""
    interference: float = 0.0
    """Measured share of a transfer's time that the compute it overlaps loses (0: none,
    the transfer is hidden; 1: the two take turns on the CPU). A ring at 10 Gbit/s on a
    core per worker is CPU work: overlapped with backward it slowed backward by about
    its own time (``probe._interference``); at 1 Gbit/s the wire bounds it and the CPU
    waits. 0: not measured."""

    machine_bps: float = 0.0
    """Measured bytes/s that every inter-node transfer together moves (the sum of the
    nodes' egress; 0: no such bound). Where the nodes share one host's cores, moving bytes
    is CPU work that the links share: at 4 nodes on 2 cores and 10 Gbit/s one link alone
    carried 1.1 GB/s, every node sending at once 0.61-0.66 GB/s each; a parameter server
    pulling 102 MB out of one node ran at the first rate, a ring at the second."""

    def size_factor(self, nbytes: float) -> float:
        """How much longer a ring all-reduce of ``nbytes`` takes than the small buffers'
        rate says: 1 up to ``SMALL_BYTES``, ``1 / big_rate`` from ``BIG_BYTES``, log-linear
        between (1 when not measured, or when big buffers measured no slower)."""
        if not 0 < self.big_rate < 1 or nbytes <= SMALL_BYTES:
            return 1.0
        share = min(1.0, math.log(nbytes / SMALL_BYTES) / math.log(BIG_BYTES / SMALL_BYTES))
        return 1.0 + share * (1.0 / self.big_rate - 1.0)

    def hop_s(self, world: int) -> float:
        """Fixed seconds of one point-to-point hop among queued transfers: a measured
        group's fixed cost shared over the ``2(world-1)`` hops of its ring (a dense PS
        bucket's push or pull is one such hop: priced at the one-element latency, a
        parameter server looked cheaper than a ring for a 20-byte model), else the
        latency."""
        return self.ring_fixed_s(world) / (2 * (world - 1)) if world > 1 else self.latency_s

    def ring_fixed_s(self, world: int) -> float:
        """Fixed seconds of one ring all-reduce among ``world`` workers: the measured
        ``group_fixed_s``, else ``2(world-1)`` latencies."""
        return self.group_fixed_s if self.group_fixed_s > 0 else 2 * (world - 1) * self.latency_s

    def half_rate(self, compressor: str) -> float:
        """Bytes/s of ``compressor``'s all-reduce over fp32's (1.0: not measured)."""
        return dict(self.half_rates).get(compressor, 1.0)

    @classmethod
    def from_spec(cls, spec: ResourceSpec, efficiency: float = LINK_EFFICIENCY,
                  **overrides: float) -> LinkModel:
        """Every worker replica and dedicated server of ``spec`` on its node; each node's
        ``network_bandwidth`` (Gbit/s) times ``efficiency``."""
        node_of: dict[str, int] = {}
        for i, n in enumerate(spec.nodes):
            for d in n.worker_devices():
                node_of[d] = i
        for d in server_devices(spec):
            node_of[d] = next(i for i, n in enumerate(spec.nodes)
                              if d.startswith(f"{n.address}:"))
        nic = tuple(n.network_bandwidth * GBIT_BYTES * efficiency for n in spec.nodes)
        names = tuple(n.address for n in spec.nodes)
        return cls(node_of=node_of, nic_bps=nic, names=names, **overrides)

    def measured(self, probe: Any, spec: ResourceSpec) -> LinkModel:
        """This model with ``probe``'s (:class:`~stratagem.planner.probe.LinkProbe`)
        measured figures: the fixed cost of a collective as the ring's per-message latency,
        that of a queued all-reduce with a payload as an all-reduce group's fixed cost,
        the point-to-point message cost as the PS message cost, a chained all-to-all's as
        the sparse exchange's per collective, a chained pull round's as an embedding
        call's, the rest of that sparse step as a step's push (each with its cost per row),
        half-precision all-reduces' rates over fp32's, and the rates: where the probe
        timed one link alone (``link_bps``), that is every inter-node link's rate where it
        differs from the nominal one (lower by more than ``MEASURED_DIFFERS``, or higher
        by more than ``MEASURED_FASTER`` times), and a bus bandwidth lower than the link's
        by more than ``MEASURED_DIFFERS`` bounds all links together (``machine_bps``: the
        ring's bytes over the nodes at that rate); else (one node, or not timed) the bus
        bandwidth is every link's rate (one node: the intra-node rate) where it differs
        from the nominal one so."""
        n = max(probe.world, 2)
        out = replace(self, latency_s=probe.collective_s / (2 * (n - 1)),
                      message_cpu_s=probe.message_s,
                      all_to_all_s=probe.all_to_all_s, pull_round_s=probe.pull_round_s,
                      pull_round_one_s=probe.pull_round_one_s,
                      pull_row_one_s=probe.pull_row_one_s,
                      sparse_push_s=probe.sparse_push_s, closing_s=probe.closing_s,
                      pull_row_s=probe.pull_row_s,
                      push_row_s=probe.push_row_s,
                      group_fixed_s=probe.group_fixed_s,
                      big_rate=probe.big_rate, interference=probe.interference,
                      half_rates=tuple((c, r) for c, r in (("fp16", probe.fp16_rate),
                                                           ("bf16", probe.bf16_rate)) if r > 0))
        multi = len(spec.nodes) > 1
        link = probe.link_bps
        if multi and link > 0:
            if _differs(link, probe.nominal_bps):
                out = replace(out, nic_bps=tuple(link for _ in self.nic_bps))
            if probe.bus_bps < (1 - MEASURED_DIFFERS) * min(out.nic_bps):
                devices = list(spec.replicas)
                crossing = sum(1 for a, b, _ in ring_flows(devices, 1.0)
                               if not out.same_node(a, b))
                out = replace(out, machine_bps=probe.bus_bps * crossing)
            else:  # the link bounds the ring: a group's fixed cost hides behind bytes
                out = replace(out, group_period_s=probe.group_period_s)
        elif _differs(probe.bus_bps, probe.nominal_bps):
            if multi:
                out = replace(out, nic_bps=tuple(probe.bus_bps for _ in self.nic_bps))
            else:
                out = replace(out, intra_bps=probe.bus_bps)
        return out

    def name(self, node: int) -> str:
        return self.names[node] if node < len(self.names) else f"node{node}"

    def same_node(self, a: str, b: str) -> bool:
        return self.node_of[a] == self.node_of[b]

    def transfer_time(self, flows: Iterable[tuple[str, str, float]]) -> float:
        """Seconds until every flow has arrived (they start together; no latency term)."""
        n = len(self.nic_bps)
        egress, ingress = [0.0] * n, [0.0] * n
        intra: dict[str, float] = {}  # per sending process: its copies run in parallel
        senders: list[set[int]] = [set() for _ in range(n)]
        for src, dst, nbytes in flows:
            if nbytes <= 0 or src == dst:
                continue
            a, b = self.node_of[src], self.node_of[dst]
            if a == b:
                intra[src] = intra.get(src, 0.0) + nbytes
                continue
            egress[a] += nbytes
            ingress[b] += nbytes
            senders[b].add(a)
        worst = max(intra.values(), default=0.0) / self.intra_bps
        if self.machine_bps > 0:
            worst = max(worst, sum(egress) / self.machine_bps)
        for i in range(n):
            incast = 1.0 + self.incast_penalty * max(0, len(senders[i]) - 1)
            worst = max(worst, egress[i] / self.nic_bps[i],
                        ingress[i] * incast / self.nic_bps[i])
        return worst

    def flow_bytes(self, flows: Iterable[tuple[str, str, float]]) -> dict[str, float]:
        """Bytes per link direction (``ADDRESS tx``/``rx``; ``ADDRESS local`` inside a
        node) of ``flows``."""
        out: dict[str, float] = {}
        for src, dst, nbytes in flows:
            if nbytes <= 0 or src == dst:
                continue
            a, b = self.node_of[src], self.node_of[dst]
            if a == b:
                key = f"{self.name(a)} local"
                out[key] = out.get(key, 0.0) + nbytes
                continue
            tx, rx = f"{self.name(a)} tx", f"{self.name(b)} rx"
            out[tx] = out.get(tx, 0.0) + nbytes
            out[rx] = out.get(rx, 0.0) + nbytes
        return out


def _differs(measured: float, nominal: float) -> bool:
    """Whether a measured rate replaces the nominal one: lower by more than
    ``MEASURED_DIFFERS``, or higher by more than ``MEASURED_FASTER`` times."""
    return (measured < (1 - MEASURED_DIFFERS) * nominal
            or measured > MEASURED_FASTER * nominal)


def ring_flows(devices: list[str], nbytes: float) -> list[tuple[str, str, float]]:
    """A ring all-reduce of ``nbytes`` over ``devices`` in that order: each sends
    2(n-1)/n of the buffer to the next (reduce-scatter, then all-gather)."""
    n = len(devices)
    if n < 2:
        return []
    share = 2 * (n - 1) / n * nbytes
    return [(devices[i], devices[(i + 1) % n], share) for i in range(n)]


def ring_bytes_time(links: LinkModel, devices: list[str], nbytes: float,
                    rate: float = 1.0) -> float:
    """Seconds that moving a ring all-reduce's bytes takes, without its fixed costs: its
    flows on the links, slower for a large buffer where measured, at ``rate`` times
    fp32's bytes/s."""
    return (links.transfer_time(ring_flows(devices, nbytes)) * links.size_factor(nbytes)
            / rate)


def ring_allreduce_time(links: LinkModel, devices: list[str], nbytes: float,
                        rounds: int = 1, rate: float = 1.0) -> float:
    """2(n-1)/n * bytes / (slowest link on the ring), slower for a large buffer where
    measured (:meth:`LinkModel.size_factor`) and at ``rate`` times fp32's bytes/s (a
    half-precision ring's, :meth:`LinkModel.half_rate`), + a group's fixed cost each round
    (``rounds``: all-reduces in a row, e.g. PowerSGD's two): the measured
    ``group_fixed_s``, else 2(n-1) messages of latency. Where the link bounds the ring
    (``group_period_s``), the fixed cost hides behind the bytes as far as the CPU is free
    while they move: the longer of that period and the bytes' time with 2(n-1) latencies
    each round, plus ``interference`` times what adding the two would price more."""
    return queued_ring_time(links, len(devices), ring_bytes_time(links, devices, nbytes, rate),
                            rounds)


def queued_ring_time(links: LinkModel, n: int, moving_s: float, rounds: int = 1) -> float:
    """Seconds of a ring all-reduce among ``n`` workers whose bytes take ``moving_s``
    (:func:`ring_bytes_time`), its fixed costs added as :func:`ring_allreduce_time` says."""
    if n < 2:
        return 0.0
    added = moving_s + rounds * links.ring_fixed_s(n)
    if links.group_period_s <= 0:
        return added
    hidden = rounds * max(links.group_period_s,
                          moving_s / rounds + 2 * (n - 1) * links.latency_s)
    # hidden as far as the CPU is free while the bytes move (1 - interference)
    return hidden + links.interference * max(0.0, added - hidden)

"""Cost model pieces against answers worked out by hand."""

from __future__ import annotations

import pytest

from stratagem import env
from stratagem.analysis import AccessStats, ModelProfile, ParamInfo
from stratagem.planner.calibrate import Calibration
from stratagem.planner.cost_model import predict
from stratagem.planner.links import GBIT_BYTES, LinkModel, ring_allreduce_time, ring_flows
from stratagem.planner.timeline import exposed, schedule
from stratagem.resource import ResourceSpec
from stratagem.strategy import (
    AllReduceSynchronizer,
    NodeConfig,
    Partitioner,
    PSSynchronizer,
    Strategy,
)


def spec(nodes: int, workers: int = 1, gbps: float = 1.0) -> ResourceSpec:
    return ResourceSpec.from_dict({"nodes": [
        {"address": f"10.0.0.{i + 1}", "chief": i == 0, "workers": workers,
         "network_bandwidth": gbps, "cpus": [0]} for i in range(nodes)]})


def links(s: ResourceSpec, **kw: float) -> LinkModel:
    return LinkModel.from_spec(s, efficiency=1.0, **kw)


def test_ring_allreduce_two_nodes_known_answer() -> None:
    s = spec(2)
    # 2(n-1)/n * 125 MB / 125 MB/s = 1 s, plus 2(n-1) = 2 messages of 1 ms.
    t = ring_allreduce_time(links(s, latency_s=1e-3), s.replicas, 125e6)
    assert t == pytest.approx(1.0 + 2e-3)


def test_ring_allreduce_four_nodes_and_the_slowest_link() -> None:
    s = spec(4)
    t = ring_allreduce_time(links(s, latency_s=0.0), s.replicas, 100e6)
    assert t == pytest.approx(2 * 3 / 4 * 100e6 / GBIT_BYTES)
    slow = ResourceSpec.from_dict({"nodes": [
        {"address": "10.0.0.1", "chief": True, "network_bandwidth": 10.0},
        {"address": "10.0.0.2", "network_bandwidth": 0.5}]})
    t = ring_allreduce_time(links(slow, latency_s=0.0), slow.replicas, 100e6)
    assert t == pytest.approx(100e6 / (0.5 * GBIT_BYTES))  # the 0.5 Gbit/s node decides


def test_ring_inside_one_node_uses_the_intra_node_rate() -> None:
    s = spec(1, workers=2)
    lm = links(s, latency_s=0.0, intra_bps=1e9)
    assert ring_allreduce_time(lm, s.replicas, 1e9) == pytest.approx(1.0)
    # two nodes of two workers: one ring edge leaves each node
    s4 = spec(2, workers=2)
    flows = ring_flows(s4.replicas, 100e6)
    assert links(s4).flow_bytes(flows)["10.0.0.1 tx"] == pytest.approx(1.5 * 100e6)


def test_per_owner_load_and_incast() -> None:
    s = spec(4)
    lm = links(s, incast_penalty=0.1)
    r = s.replicas
    # every worker sends 10 MB to worker 0: 3 senders into one downlink
    t = lm.transfer_time([(w, r[0], 10e6) for w in r])
    assert t == pytest.approx(30e6 * 1.2 / GBIT_BYTES)
    # spread over the owners: each link carries 3 x 2.5 MB in and out
    t = lm.transfer_time([(w, o, 2.5e6) for w in r for o in r if o != w])
    assert t == pytest.approx(7.5e6 * 1.2 / GBIT_BYTES)


def test_overlap_of_a_given_timeline() -> None:
    # backward ends at 10; groups ready at 2, 5, 9 taking 2, 4, 3
    slots = schedule([("a", 2.0, 2.0), ("b", 5.0, 4.0), ("c", 9.0, 3.0)])
    assert [(s.start_s, s.end_s) for s in slots] == [(2, 4), (5, 9), (9, 12)]
    assert exposed(slots, 10.0) == pytest.approx(2.0)
    # a long first transfer delays the rest: 1 -> 7, then 7 -> 8
    slots = schedule([("a", 1.0, 6.0), ("b", 2.0, 1.0)])
    assert exposed(slots, 10.0) == 0.0 and slots[1].start_s == 7.0


def _profile() -> ModelProfile:
    return ModelProfile(params=(
        ParamInfo("emb", (1000, 125), "float32", 125000, 500000, embedding_like=True),
        ParamInfo("fc", (250, 1000), "float32", 250000, 1000000)))


def _cal(**kw: object) -> Calibration:
    base = dict(batch_size=8, forward_s=0.01, backward_s=0.02, optimizer_s=0.0,
                grad_ready_s={"fc": 0.005, "emb": 0.02}, copy_bps=1e9, flops=1e10)
    base.update(kw)
    return Calibration(**base)


def test_predicted_allreduce_step_adds_the_exposed_tail() -> None:
    s = spec(2)
    strat = Strategy(node_config=(NodeConfig("emb", AllReduceSynchronizer(group=0)),
                                  NodeConfig("fc", AllReduceSynchronizer(group=1))))
    cost = predict(strat.with_replicas(s.replicas), _profile(), s, _cal(),
                   links(s, latency_s=0.0))
    bw = GBIT_BYTES
    fc, emb = 1e6 / bw, 0.5e6 / bw  # 2(n-1)/n = 1 at two workers
    # fc ready at 5 ms, emb at 20 ms (the end of backward) after fc's transfer
    end = max(0.005 + fc, 0.02) + emb
    assert cost.exposed_comm_s == pytest.approx(end - 0.02)
    assert cost.total_s == pytest.approx(0.03 + end - 0.02)
    assert cost.link_bytes["10.0.0.1 tx"] == pytest.approx(1.5e6)


def test_sparse_rows_cost_follows_touched_rows() -> None:
    s = spec(2)
    w0, w1 = s.replicas
    part = Partitioner((2, 1))
    rows = NodeConfig("emb", partitioner=part, part_config=(
        NodeConfig("emb/part_0", PSSynchronizer(reduction_destination=w0)),
        NodeConfig("emb/part_1", PSSynchronizer(reduction_destination=w1))))
    strat = Strategy(node_config=(rows, NodeConfig("fc", AllReduceSynchronizer()))
                     ).with_replicas(s.replicas)
    prof = _profile().with_access([AccessStats("emb", 1000, 100.0, overlap=1.0)])
    cost = predict(strat, prof, s, _cal(), links(s, latency_s=0.0, message_cpu_s=0.0))
    # each worker pulls and pushes the 50 rows (of 100) owned by the other: 50 x 500 B
    # of rows each way, plus 50 ids of 8 B to ask for them
    assert cost.link_bytes["10.0.0.1 tx"] == pytest.approx(1e6 + 50 * 8 + 2 * 50 * 500)
    # in the forward each link carries the rows it serves and the ids it asks for
    assert cost.parts["sparse_pull"] == pytest.approx(50 * (500 + 8) / GBIT_BYTES)
    # a tenth of the rows touched: a tenth of the row traffic
    few = _profile().with_access([AccessStats("emb", 1000, 10.0)])
    cheaper = predict(strat, few, s, _cal(), links(s, latency_s=0.0, message_cpu_s=0.0))
    assert cheaper.parts["sparse_pull"] == pytest.approx(cost.parts["sparse_pull"] / 10)


def _two_owner_rows(s: ResourceSpec) -> Strategy:
    w0, w1 = s.replicas
    rows = NodeConfig("emb", partitioner=Partitioner((2, 1)), part_config=(
        NodeConfig("emb/part_0", PSSynchronizer(reduction_destination=w0)),
        NodeConfig("emb/part_1", PSSynchronizer(reduction_destination=w1))))
    return Strategy(node_config=(rows, NodeConfig("fc", AllReduceSynchronizer()))
                    ).with_replicas(s.replicas)


def test_a_measured_chained_all_to_all_prices_each_collective_of_the_rows_exchange() -> None:
    """Rows pulled on demand, one embedding call: 2 collectives in the forward, the
    closing round's (in the background from the end of forward) and 2 pushing after
    backward; with a measured all-to-all each costs that (its per-peer messages inside
    it), not a ring step's latency plus a message per peer."""
    s = spec(2)
    strat = _two_owner_rows(s)
    prof = _profile().with_access([AccessStats("emb", 1000, 100.0, overlap=1.0)])
    per_message = links(s, latency_s=1e-4, message_cpu_s=5e-5)
    chained = links(s, latency_s=1e-4, message_cpu_s=5e-5, all_to_all_s=2e-3)
    a = predict(strat, prof, s, _cal(), per_message)
    b = predict(strat, prof, s, _cal(), chained)
    assert b.parts["sparse_pull"] - a.parts["sparse_pull"] == pytest.approx(2 * (2e-3 - 1e-4))
    assert b.parts["sparse_push"] - a.parts["sparse_push"] == pytest.approx(2 * (2e-3 - 1e-4))
    assert b.parts["closing_round"] - a.parts["closing_round"] == pytest.approx(2e-3 - 1e-4)
    # the 5 collectives x 1 peer messages are no longer charged one by one
    assert a.overhead_s - b.overhead_s == pytest.approx(5 * 5e-5)
    assert a.parts["messages"] == b.parts["messages"]


def test_every_embedding_call_is_a_pull_round() -> None:
    """A table looked up three times per forward pulls three times: three rounds, each
    the measured chained round's seconds when the probe measured one."""
    s = spec(2)
    strat = _two_owner_rows(s)
    once = _profile().with_access([AccessStats("emb", 1000, 100.0)])
    thrice = _profile().with_access([AccessStats("emb", 1000, 100.0, calls=3)])
    chained = links(s, latency_s=1e-4, message_cpu_s=5e-5, all_to_all_s=2e-3)
    a, b = (predict(strat, p, s, _cal(), chained) for p in (once, thrice))
    assert b.parts["sparse_pull"] - a.parts["sparse_pull"] == pytest.approx(2 * 2 * 2e-3)
    assert b.parts["messages"] - a.parts["messages"] == 2 * 2
    rounds = links(s, latency_s=1e-4, message_cpu_s=5e-5, all_to_all_s=2e-3,
                   pull_round_s=7e-3)
    c, d = (predict(strat, p, s, _cal(), rounds) for p in (once, thrice))
    assert c.parts["sparse_pull"] - a.parts["sparse_pull"] == pytest.approx(7e-3 - 4e-3)
    assert d.parts["sparse_pull"] - c.parts["sparse_pull"] == pytest.approx(2 * 7e-3)
    # the push after backward is the same whatever the forward's calls
    assert d.parts["sparse_push"] == pytest.approx(c.parts["sparse_push"])
    # a measured sparse step's rest prices the push (push, update): its two collectives'
    # price is replaced; a probe that did not time the closing round apart had it in there
    pushed = links(s, latency_s=1e-4, message_cpu_s=5e-5, all_to_all_s=2e-3,
                   pull_round_s=7e-3, sparse_push_s=9e-3)
    e = predict(strat, once, s, _cal(), pushed)
    assert e.parts["sparse_push"] - c.parts["sparse_push"] == pytest.approx(9e-3 - 2 * 2e-3)
    assert (c.parts["closing_round"], e.parts["closing_round"]) == (pytest.approx(2e-3), 0.0)
    # and per row: each worker asks for and pushes the 50 rows (of its 100) the other owns
    per_row = links(s, latency_s=1e-4, message_cpu_s=5e-5, all_to_all_s=2e-3,
                    pull_round_s=7e-3, sparse_push_s=9e-3, pull_row_s=1e-6, push_row_s=3e-6)
    f = predict(strat, once, s, _cal(), per_row)
    assert f.parts["sparse_pull"] - e.parts["sparse_pull"] == pytest.approx(50 * 1e-6)
    assert f.parts["sparse_push"] - e.parts["sparse_push"] == pytest.approx(50 * 3e-6)


def test_a_table_with_one_owner_pays_the_measured_one_owner_round() -> None:
    """A table split over both workers pays the shared round (both ask and serve); the same
    table on one owner pays the one-owner round where the probe measured one, else the
    shared one."""
    s = spec(2)
    w0, w1 = s.replicas
    split = _two_owner_rows(s)
    whole = Strategy(node_config=(
        NodeConfig("emb", PSSynchronizer(reduction_destination=w0)),
        NodeConfig("fc", AllReduceSynchronizer()))).with_replicas(s.replicas)
    prof = _profile().with_access([AccessStats("emb", 1000, 100.0, calls=3)])
    both = links(s, latency_s=1e-4, message_cpu_s=5e-5, all_to_all_s=2e-3,
                 pull_round_s=7e-3, pull_round_one_s=3e-3)
    shared_only = links(s, latency_s=1e-4, message_cpu_s=5e-5, all_to_all_s=2e-3,
                        pull_round_s=7e-3)
    a, b, c = (predict(st, prof, s, _cal(), lk) for st, lk in
               ((split, both), (whole, both), (whole, shared_only)))
    assert c.parts["sparse_pull"] - b.parts["sparse_pull"] == pytest.approx(3 * 4e-3)
    # (the rows' wire time differs a little: one direction carries them all)
    assert a.parts["sparse_pull"] - b.parts["sparse_pull"] == pytest.approx(3 * 4e-3, rel=0.05)
    # a split table's rounds do not use the one-owner price
    assert a.parts["sparse_pull"] == pytest.approx(
        predict(split, prof, s, _cal(), shared_only).parts["sparse_pull"])


def test_the_closing_round_hides_behind_backward_and_delays_the_push_past_it() -> None:
    """The runtime runs a forward's closing pull round in the background while backward
    computes (``PSEngine.after_forward``) and pushes the rows once it is done: a closing
    round shorter than backward (20 ms) costs the step nothing, a 30 ms one delays the
    push by 10 ms."""
    s = spec(2)
    strat = _two_owner_rows(s)
    prof = _profile().with_access([AccessStats("emb", 1000, 100.0)])

    def step(closing_s: float) -> float:
        lk = links(s, latency_s=1e-4, message_cpu_s=5e-5, all_to_all_s=2e-3,
                   pull_round_s=7e-3, sparse_push_s=9e-3, closing_s=closing_s)
        cost = predict(strat, prof, s, _cal(), lk)
        assert cost.parts["closing_round"] == closing_s
        return cost.total_s

    hidden = step(1e-3)
    assert step(19e-3) == pytest.approx(hidden)
    assert step(30e-3) == pytest.approx(hidden + 10e-3)


def test_fp16_halves_the_wire_bytes() -> None:
    s = spec(2)
    mk = lambda c: Strategy(node_config=(  # noqa: E731
        NodeConfig("emb", AllReduceSynchronizer(compressor=c)),
        NodeConfig("fc", AllReduceSynchronizer(compressor=c)))).with_replicas(s.replicas)
    full = predict(mk("none"), _profile(), s, _cal(), links(s))
    half = predict(mk("fp16"), _profile(), s, _cal(), links(s))
    assert half.link_bytes["10.0.0.1 tx"] == pytest.approx(full.link_bytes["10.0.0.1 tx"] / 2)
    assert half.parts["compressor_work"] > 0


def test_a_measured_half_precision_rate_prices_the_compressed_ring() -> None:
    from dataclasses import replace

    from stratagem.planner.cost_model import group_cost, plan_for

    s = spec(2)
    mk = lambda c: Strategy(node_config=(  # noqa: E731
        NodeConfig("emb", AllReduceSynchronizer(compressor=c)),
        NodeConfig("fc", AllReduceSynchronizer(compressor=c)))).with_replicas(s.replicas)
    plain = links(s)
    cpu_bound = replace(plain, half_rates=(("fp16", 0.5), ("bf16", 1.0)))
    assert cpu_bound.half_rate("fp16") == 0.5 and plain.half_rate("fp16") == 1.0

    def wire(compressor: str, lm: LinkModel) -> tuple[float, float]:
        groups = plan_for(mk(compressor), _profile(), s).groups
        costs = [group_cost(g, lm, list(s.replicas), _cal()) for g in groups]
        return sum(c[0] for c in costs), sum(f[2] for c in costs for f in c[2])

    full, full_bytes = wire("none", plain)
    half, half_bytes = wire("fp16", plain)
    assert half_bytes == pytest.approx(full_bytes / 2)
    # half the bytes at half fp32's rate: fp32's wire time again; bf16 at fp32's rate
    slow, slow_bytes = wire("fp16", cpu_bound)
    assert slow_bytes == half_bytes and slow == pytest.approx(full)
    assert wire("bf16", cpu_bound)[0] == pytest.approx(half)
    assert half < 0.6 * full  # the latency terms stay


def test_a_large_ring_runs_at_the_measured_large_buffer_rate() -> None:
    from dataclasses import replace

    s = spec(2)
    plain = links(s)
    slow_big = replace(plain, big_rate=0.5)  # 64 MiB ran at half the small buffers' rate
    mib = 2 ** 20
    assert [slow_big.size_factor(n * mib) for n in (8, 16, 32, 64, 256)] == \
        pytest.approx([1.0, 1.0, 1.5, 2.0, 2.0])
    assert plain.size_factor(256 * mib) == 1.0  # not measured
    assert replace(plain, big_rate=1.2).size_factor(256 * mib) == 1.0  # no slower
    devices = list(s.replicas)
    wire = ring_allreduce_time(plain, devices, 64 * mib) - 2 * plain.latency_s
    assert ring_allreduce_time(slow_big, devices, 64 * mib) - 2 * plain.latency_s == \
        pytest.approx(2 * wire)
    assert ring_allreduce_time(slow_big, devices, mib) == ring_allreduce_time(plain, devices,
                                                                               mib)


def test_measured_links_replace_the_spec_only_where_they_differ() -> None:
    from dataclasses import replace

    from stratagem.planner.links import LinkModel
    from stratagem.planner.probe import LinkProbe
    from stratagem.resource import ResourceSpec

    spec = ResourceSpec.from_dict({"nodes": [
        {"address": "10.0.0.1", "chief": True, "workers": 1, "network_bandwidth": 1},
        {"address": "10.0.0.2", "workers": 1, "network_bandwidth": 1}]})
    base = LinkModel.from_spec(spec)
    nominal = base.nic_bps[0]

    def probe(bus: float) -> LinkProbe:
        return LinkProbe(world=2, collective_s=4e-4, bus_bps=bus, message_s=3e-4,
                         seconds=0.5, nominal_bps=nominal, all_to_all_s=2e-3)

    slow = base.measured(probe(25e6), spec)
    assert slow.nic_bps == (25e6, 25e6)
    assert slow.latency_s == 2e-4 and slow.message_cpu_s == 3e-4  # t0 / (2(n-1)), m
    assert slow.all_to_all_s == 2e-3
    assert slow.half_rates == ()  # not measured: fp32's rate
    both = base.measured(replace(probe(25e6), fp16_rate=0.4, bf16_rate=0.9, big_rate=0.8),
                         spec)
    assert both.half_rate("fp16") == 0.4 and both.half_rate("bf16") == 0.9
    assert both.big_rate == 0.8 and slow.big_rate == 0.0
    # a ring all-reduce of 10 MB at 25 MB/s: 2(n-1)/n * S / bw + 2(n-1) alpha
    assert ring_allreduce_time(slow, ["10.0.0.1:CPU:0", "10.0.0.2:CPU:0"], 10e6) == \
        pytest.approx(10e6 / 25e6 + 2 * 2e-4)
    # measured, a group's fixed cost replaces the 2(n-1) latencies, once per round
    queued = base.measured(replace(probe(25e6), group_fixed_s=3e-3), spec)
    assert queued.group_fixed_s == 3e-3 and slow.group_fixed_s == 0.0
    devices = ["10.0.0.1:CPU:0", "10.0.0.2:CPU:0"]
    assert ring_allreduce_time(queued, devices, 10e6) == pytest.approx(10e6 / 25e6 + 3e-3)
    assert ring_allreduce_time(queued, devices, 10e6, rounds=2) == \
        pytest.approx(10e6 / 25e6 + 2 * 3e-3)
    assert base.measured(probe(0.95 * nominal), spec).nic_bps == base.nic_bps
    assert base.measured(probe(1.2 * nominal), spec).nic_bps == base.nic_bps
    assert base.measured(probe(10 * nominal), spec).nic_bps == (10 * nominal,) * 2


def test_one_link_alone_faster_than_the_ring_bounds_the_links_together() -> None:
    """Four nodes sharing one host's cores: one link alone at its nominal rate N, every
    node at once (the ring's bus rate) at N/2 each. A ring keeps the bus rate; three
    workers pushing into one node move at one link's rate; all pairs at once share the
    host's 4 x N/2."""
    from dataclasses import replace

    from stratagem.planner.probe import LinkProbe

    s = spec(4)
    base = links(s)
    N = base.nic_bps[0]
    probe = LinkProbe(world=4, collective_s=4e-4, bus_bps=N / 2, message_s=3e-4,
                      seconds=0.5, nominal_bps=N, link_bps=0.98 * N)
    m = base.measured(probe, s)
    assert m.nic_bps == base.nic_bps and m.machine_bps == pytest.approx(4 * N / 2)
    devs, B = s.replicas, 60e6
    assert m.transfer_time(ring_flows(devs, B)) == pytest.approx(1.5 * B / (N / 2))
    incast = [(d, devs[0], B) for d in devs[1:]]
    assert m.transfer_time(incast) == pytest.approx(3 * B / N * (1 + 2 * m.incast_penalty))
    pairs = [(a, b, B / 3) for a in devs for b in devs if a != b]
    assert m.transfer_time(pairs) == pytest.approx(4 * B / (2 * N))
    # a slow link alone is every link's rate; the ring at its rate adds no bound
    slow = base.measured(replace(probe, link_bps=N / 2), s)
    assert slow.nic_bps == (N / 2,) * 4 and slow.machine_bps == 0.0
    # not timed: the bus rate is every link's, as before
    old = base.measured(replace(probe, link_bps=0.0), s)
    assert old.nic_bps == (N / 2,) * 4 and old.machine_bps == 0.0


def test_queued_groups_hide_their_fixed_cost_behind_bytes_where_the_link_bounds_them() -> None:
    """2 nodes, the ring at the link's rate: a queued group takes the longer of the
    measured period and its bytes' time with 2(n-1) latencies; 4 nodes on shared cores
    (the ring at half a link's rate): bytes and fixed cost add, as without a period."""
    from dataclasses import replace

    from stratagem.planner.probe import LinkProbe

    s2 = spec(2)
    base = links(s2)
    N = base.nic_bps[0]
    probe = LinkProbe(world=2, collective_s=4e-4, bus_bps=N, message_s=3e-4, seconds=0.5,
                      nominal_bps=N, link_bps=N, group_fixed_s=2e-3, group_period_s=2.5e-3)
    m = base.measured(probe, s2)
    assert m.group_period_s == 2.5e-3 and m.machine_bps == 0.0
    devs = s2.replicas
    small, big = 0.1 * 2.5e-3 * N, 8 * 2.5e-3 * N  # a tenth of the period's bytes, 8x
    assert ring_allreduce_time(m, devs, small) == pytest.approx(2.5e-3)
    assert ring_allreduce_time(m, devs, big) == pytest.approx(8 * 2.5e-3 + 4e-4)
    assert ring_allreduce_time(m, devs, big, rounds=2) == \
        pytest.approx(2 * (4 * 2.5e-3 + 4e-4))
    # adding the two priced a large group 2 ms more (many_small at 1 Gbit/s: 35-40% slow)
    added = replace(m, group_period_s=0.0)
    assert ring_allreduce_time(added, devs, big) == pytest.approx(8 * 2.5e-3 + 2e-3)
    # a CPU busy for half the bytes' time (interference 0.5) hides half of the difference
    busy = base.measured(replace(probe, interference=0.5), s2)
    assert ring_allreduce_time(busy, devs, big) == \
        pytest.approx(8 * 2.5e-3 + 4e-4 + 0.5 * (2e-3 - 4e-4))
    assert ring_allreduce_time(busy, devs, small) == pytest.approx(2.5e-3)  # its period
    s4 = spec(4)
    host = links(s4).measured(replace(probe, world=4, bus_bps=N / 2), s4)
    assert host.machine_bps > 0 and host.group_period_s == 0.0
    assert ring_allreduce_time(host, s4.replicas, big) == \
        pytest.approx(1.5 * big / (N / 2) + 2e-3)


def test_runtime_cost_per_tensor_and_group_is_an_overhead() -> None:
    s = spec(2)
    strat = Strategy(node_config=(NodeConfig("emb", AllReduceSynchronizer(group=0)),
                                  NodeConfig("fc", AllReduceSynchronizer(group=1))))
    strat = strat.with_replicas(s.replicas)
    lm = links(s, latency_s=0.0)
    free = predict(strat, _profile(), s, _cal(), lm)
    paid = predict(strat, _profile(), s, _cal(tensor_s=1e-3, group_s=5e-3), lm)
    assert paid.overhead_s - free.overhead_s == pytest.approx(2 * 1e-3 + 2 * 5e-3)
    assert paid.parts["tensors"] == 2 and paid.compute_s == free.compute_s


def test_the_busiest_owners_work_per_dense_piece_is_an_overhead() -> None:
    s = spec(2)
    w0, w1 = s.replicas
    prof = ModelProfile(params=tuple(ParamInfo(n, (100, 10), "float32", 1000, 4000)
                                     for n in ("a", "b", "c")))
    cal = {n: 0.01 for n in ("a", "b", "c")}
    strat = Strategy(node_config=(
        NodeConfig("a", PSSynchronizer(reduction_destination=w0)),
        NodeConfig("b", PSSynchronizer(reduction_destination=w0)),
        NodeConfig("c", PSSynchronizer(reduction_destination=w1)))).with_replicas(s.replicas)
    lm = links(s, latency_s=0.0)
    free = predict(strat, prof, s, _cal(grad_ready_s=cal), lm)
    paid = predict(strat, prof, s, _cal(grad_ready_s=cal, piece_s=1e-3), lm)
    # the first worker owns two of the three pieces: the values wait for its two updates
    assert paid.overhead_s - free.overhead_s == pytest.approx(2 * 1e-3)
    assert paid.parts["owner_pieces"] == pytest.approx(2e-3)


def test_owner_piece_cost_is_measured_and_small() -> None:
    from stratagem.planner.probe import owner_piece_cost

    assert 0 < owner_piece_cost() < 5e-3


def test_runtime_costs_are_measured_and_small() -> None:
    from stratagem.planner.probe import runtime_costs

    tensor_s, group_s = runtime_costs()
    assert 0 < tensor_s < 5e-3 and 0 <= group_s < 0.05


def test_rows_found_in_a_dense_gradient_cost_a_scan_of_it() -> None:
    s = spec(2)
    w0, _ = s.replicas
    strat = Strategy(node_config=(
        NodeConfig("emb", AllReduceSynchronizer()),
        NodeConfig("fc", PSSynchronizer(reduction_destination=w0, local_replication=True,
                                         row_sparse=True)))).with_replicas(s.replicas)
    prof = _profile().with_access([AccessStats("fc", 250, 10.0)])
    lm = links(s, latency_s=0.0, message_cpu_s=0.0)
    slow = predict(strat, prof, s, _cal(scan_bps=1e6), lm)
    fast = predict(strat, prof, s, _cal(scan_bps=1e12), lm)
    # fc is 1 MB, declared dense: its non-zero rows are found by reading all of it
    assert slow.parts["row_scan"] == pytest.approx(1.0)
    assert slow.overhead_s - fast.overhead_s == pytest.approx(1.0 - 1e-6)


def test_update_is_priced_per_byte_and_sparse_gradients_all_reduced_are_densified() -> None:
    s = spec(2)
    ar = Strategy(node_config=(NodeConfig("emb", AllReduceSynchronizer()),
                               NodeConfig("fc", AllReduceSynchronizer()))
                  ).with_replicas(s.replicas)
    cal = _cal(update_bps=1e8)  # 100 MB/s: the 1.5 MB model takes 15 ms to update
    dense = predict(ar, _profile(), s, cal, links(s))
    assert dense.parts["update"] == pytest.approx(1.5e6 / 1e8)
    # the same table declared sparse: all-reduced, its gradient is first made dense
    sparse = ModelProfile(params=(
        ParamInfo("emb", (1000, 125), "float32", 125000, 500000, embedding_like=True,
                  sparse=True),
        ParamInfo("fc", (250, 1000), "float32", 250000, 1000000)))
    assert predict(ar, sparse, s, cal, links(s)).parts["update"] == pytest.approx(2e6 / 1e8)
    # not measured (0): the calibrated optimizer time, by the share of the model updated
    assert predict(ar, _profile(), s, _cal(optimizer_s=0.03), links(s)).parts["update"] \
        == pytest.approx(0.03)


def test_a_dense_bucket_push_and_pull_each_cost_a_measured_hop() -> None:
    """With a measured group cost ``g`` (a ring's 2(n-1) hops), a dense PS bucket's push
    and its values' pull each cost ``g / 2(n-1)``; an all-reduce group costs ``g``."""
    s = spec(4)
    w = s.replicas
    ps = Strategy(node_config=(NodeConfig("fc", PSSynchronizer(reduction_destination=w[1])),
                               )).with_replicas(w)
    ar = Strategy(node_config=(NodeConfig("fc", AllReduceSynchronizer(group=0)),
                               )).with_replicas(w)
    prof = ModelProfile(params=(ParamInfo("fc", (5,), "float32", 5, 20),))
    cal = _cal(grad_ready_s={"fc": 0.02})
    flat = links(s, latency_s=0.0, message_cpu_s=0.0)
    hops = links(s, latency_s=0.0, message_cpu_s=0.0, group_fixed_s=6e-3)
    assert hops.hop_s(4) == pytest.approx(1e-3) and flat.hop_s(4) == 0.0
    push_pull = predict(ps, prof, s, cal, hops).total_s - predict(ps, prof, s, cal, flat).total_s
    assert push_pull == pytest.approx(2e-3, rel=1e-3)  # a hop each way, after backward
    ring = predict(ar, prof, s, cal, hops).total_s - predict(ar, prof, s, cal, flat).total_s
    assert ring == pytest.approx(6e-3, rel=1e-3)


def test_a_paced_push_costs_a_hop_per_sender(monkeypatch: pytest.MonkeyPatch) -> None:
    """An owner receives a push of at least ``STRATAGEM_PS_PACE_BYTES`` from its three
    senders one at a time (runtime/ps/pacing.py): two hops more than unpaced; the same
    bytes cross its link either way. A push under the threshold is not paced, nor one
    into an owner that pushes a large bucket itself."""
    s = spec(4)
    w = s.replicas
    ps = Strategy(node_config=(NodeConfig("fc", PSSynchronizer(reduction_destination=w[1])),
                               )).with_replicas(w)
    big = ModelProfile(params=(ParamInfo("fc", (2**19,), "float32", 2**19, 2**21),))  # 2 MiB
    cal = _cal(grad_ready_s={"fc": 0.02})
    lk = links(s, latency_s=0.0, message_cpu_s=0.0, group_fixed_s=6e-3)  # hop: 1 ms

    def total(threshold: int) -> float:
        monkeypatch.setenv(env.PS_PACE_BYTES, str(threshold))
        return predict(ps, big, s, cal, lk).total_s

    assert total(2**20) - total(0) == pytest.approx(2e-3, rel=1e-3)
    assert total(2**22) == pytest.approx(total(0))  # 2 MiB < 4 MiB: not paced
    # two owners, each pushing its 2 MiB bucket to the other: neither paces
    two = Strategy(node_config=(
        NodeConfig("fc", PSSynchronizer(reduction_destination=w[1])),
        NodeConfig("fc2", PSSynchronizer(reduction_destination=w[2])))).with_replicas(w)
    both = ModelProfile(params=(ParamInfo("fc", (2**19,), "float32", 2**19, 2**21),
                                ParamInfo("fc2", (2**19,), "float32", 2**19, 2**21)))
    cal2 = _cal(grad_ready_s={"fc": 0.02, "fc2": 0.02})
    monkeypatch.setenv(env.PS_PACE_BYTES, str(2**20))
    paced_two = predict(two, both, s, cal2, lk).total_s
    monkeypatch.setenv(env.PS_PACE_BYTES, "0")
    assert paced_two == pytest.approx(predict(two, both, s, cal2, lk).total_s)


def test_dense_values_hop_waits_out_the_sparse_push_but_not_their_bytes() -> None:
    """The owners post a dense bucket's updated values before they wait for the sparse
    rows' push (runtime/ps/engine.py, ``_update``): the values' hop overlaps that wait;
    their bytes on the link are exposed whatever the push takes."""
    s = spec(2)
    w0, w1 = s.replicas
    rows = NodeConfig("emb", partitioner=Partitioner((2, 1)), part_config=(
        NodeConfig("emb/part_0", PSSynchronizer(reduction_destination=w0)),
        NodeConfig("emb/part_1", PSSynchronizer(reduction_destination=w1))))
    strat = Strategy(node_config=(rows, NodeConfig("fc", PSSynchronizer(
        reduction_destination=w0)))).with_replicas(s.replicas)
    prof = _profile().with_access([AccessStats("emb", 1000, 100.0, overlap=1.0)])
    wire = 1e6 / GBIT_BYTES  # fc's 1 MB of values, from w0 to w1
    hop = 2e-3  # a ring's 4 ms group cost over its 2 hops

    def pull(push_s: float) -> float:
        lk = links(s, latency_s=0.0, message_cpu_s=0.0, group_fixed_s=4e-3,
                   all_to_all_s=1e-4, pull_round_s=1e-3, sparse_push_s=push_s)
        cost = predict(strat, prof, s, _cal(), lk)
        assert cost.parts["sparse_push"] >= push_s
        return cost.parts["ps_pull"]

    assert pull(9e-3) == pytest.approx(wire)  # the hop hides in a long push
    short = pull(0.5e-3)  # a short push hides part of it
    assert short == pytest.approx(wire + hop - (0.5e-3 + 50 * (500 + 0) / GBIT_BYTES), rel=1e-6)
    assert wire < short < wire + hop


def test_measured_interference_adds_its_share_of_the_overlapped_transfers() -> None:
    """fc's all-reduce (8 ms at 1 Gbit/s) runs from 5 to 13 ms, inside backward (20 ms);
    emb's starts when backward ends. With half of an overlapped transfer's byte-moving
    time taken from the compute, the step grows by 4 ms; the exposed tail is emb's alone
    either way."""
    s = spec(2)
    strat = Strategy(node_config=(NodeConfig("emb", AllReduceSynchronizer(group=0)),
                                  NodeConfig("fc", AllReduceSynchronizer(group=1))))
    strat = strat.with_replicas(s.replicas)
    hidden = predict(strat, _profile(), s, _cal(), links(s, latency_s=0.0))
    shared = predict(strat, _profile(), s, _cal(), links(s, latency_s=0.0, interference=0.5))
    fc = 1e6 / GBIT_BYTES
    assert shared.parts["contention"] == pytest.approx(0.5 * fc)
    assert shared.total_s - hidden.total_s == pytest.approx(0.5 * fc)
    assert shared.parts["backward_tail"] == pytest.approx(hidden.parts["backward_tail"])
    assert hidden.parts["contention"] == 0.0
    # a group's fixed cost is a wait, not CPU taken from the compute: fc's slot grows to
    # 5-19 ms with a 6 ms group cost, its contention stays its bytes' share
    waits = predict(strat, _profile(), s, _cal(),
                    links(s, latency_s=0.0, interference=0.5, group_fixed_s=6e-3))
    assert waits.parts["contention"] == pytest.approx(0.5 * fc)


def test_overlapped_time_of_a_given_timeline() -> None:
    from stratagem.planner.timeline import overlapped

    slots = schedule([("a", 0.0, 0.004), ("b", 0.001, 0.010), ("c", 0.030, 0.002)])
    # a: 0-4 ms, b: 4-14 ms (waits for a), c: 30-32 ms; compute ends at 10 ms
    assert overlapped(slots, 0.010) == pytest.approx(0.004 + 0.006)
    assert overlapped(slots, 0.0) == 0.0
    assert overlapped(slots, 1.0) == pytest.approx(0.016)


def test_sparse_probe_fit_known_answers() -> None:
    from stratagem.planner.probe import fit_sparse

    # 2 workers; a round: 1 ms + 2 us per row asked; the rest: 2 ms + 1 us per row pushed
    few = (32, 1e-3 + 2e-6 * 32, 2e-3 + 1e-6 * 100, 100)
    many = (512, 1e-3 + 2e-6 * 512, 2e-3 + 1e-6 * 1600, 1600)
    fit = fit_sparse(2, 0.0, few, many)
    assert fit.round_s == pytest.approx(1e-3) and fit.round_row_s == pytest.approx(2e-6)
    assert fit.push_s == pytest.approx(2e-3) and fit.push_row_s == pytest.approx(1e-6)
    # the wire's share of a row is the link's, not the runtime's
    wired = fit_sparse(2, 0.5e-6, few, many)
    assert wired.push_row_s == pytest.approx(0.5e-6)
    assert wired.push_s == pytest.approx(2e-3 + 0.5e-6 * 100)
    # noise: the few rows' rest measured slower than the many rows' -> no slope, and the
    # fixed cost is at most what the many rows' step took
    noisy = fit_sparse(2, 0.0, (32, 1e-3, 3.9e-3, 100), (512, 2e-3, 1.5e-3, 1600))
    assert noisy.push_row_s == 0.0 and noisy.push_s == pytest.approx(1.5e-3)
    assert noisy.round_s == pytest.approx(1e-3 - 32 * 1e-3 / 480)  # rounds: a slope


def test_half_rates_are_medians_over_both_passes() -> None:
    import torch

    from stratagem.planner.probe import _HalfRates

    f32, f16, b16 = torch.float32, torch.float16, torch.bfloat16
    fixed = 1e-3
    # 10 ms of bytes in fp32; fp16 moves them at 0.6 of its rate, bf16 at 0.8; the second
    # pass caught one stalled fp32 all-reduce (a mean would read fp16 faster than it is)
    one = {f32: [0.011] * 4, f16: [fixed + 0.010 / 0.6] * 4, b16: [fixed + 0.010 / 0.8] * 4}
    two = {f32: [0.011] * 3 + [0.030], f16: one[f16][:], b16: one[b16][:]}
    half = _HalfRates({}, fixed, {dt: one[dt] + two[dt] for dt in one})
    assert half.rates() == pytest.approx((0.6, 0.8))


def test_message_cost_is_the_faster_pass_median() -> None:
    from stratagem.planner.probe import _SmallOps

    # one pass's ping-pongs fell in a stall (2 ms each, not 50 us): the messages a step
    # sends cost their own 50 us, not the stall
    small = _SmallOps(32, 512, pings=[2e-3, 50e-6])
    assert small.message_s() == pytest.approx(50e-6)
    assert _SmallOps(32, 512, pings=[0.0, 0.0]).message_s() == 0.0  # (not rank 0)


@pytest.mark.parametrize(("world", "bus_bps", "many"), [
    (2, 1.2e9, 4096),   # a fast link: 4096 rows of the one peer
    (4, 0.6e9, 1365),   # 4096 in all, a third of each peer (4096 of each took 11 s)
    (4, 0.1e9, 925),    # a slow link: what takes ROUND_WIRE_S on it (2 ms / 72 B / 3)
    (40, 1.0e9, 128),   # many peers: 4 times the few at least
])
def test_many_rows_of_a_timed_round_are_capped_in_all(
        monkeypatch: pytest.MonkeyPatch, world: int, bus_bps: float, many: int) -> None:
    from stratagem.planner import probe

    monkeypatch.setattr(probe, "agreed", lambda value, op=None: value)  # one rank's view
    monkeypatch.setattr(probe.dist, "get_world_size", lambda: world)
    small = probe._SmallOps.rows(bus_bps)
    assert (small.few, small.many) == (32, many)


def test_interference_share_known_answers() -> None:
    from stratagem.planner.probe import interference_share

    # a 50 ms loop took 75 ms beside a 50 ms all-reduce: it lost half the transfer's time
    assert interference_share(0.050, 0.050, 0.075) == pytest.approx(0.5)
    assert interference_share(0.050, 0.050, 0.049) == 0.0  # faster beside it: noise
    assert interference_share(0.050, 0.020, 0.090) == 1.0  # they took turns, and more


def test_steady_part_of_bimodal_waits() -> None:
    from stratagem.planner.probe import TRIM, _steady

    # a third of the passes waited for a late peer: a step pays that a third of the time
    # (a median reads one mode or the other from run to run); one descheduled pass and
    # one unusually quick one do not count
    fast, slow = 0.7e-3, 4.0e-3
    times = [fast] * 5 + [slow] * 3 + [0.1e-3, 50e-3]
    assert TRIM == 2
    kept = sorted(times)[2:-2]  # 0.7 x4, 4.0 x2
    assert _steady(times) == pytest.approx(sum(kept) / len(kept))
    assert fast < _steady(times) < slow
    assert _steady([3e-3, 1e-3]) == pytest.approx(2e-3)  # too few to trim: all of them


SUSPECT_BUS = [
    ((1.0e9,), 1, 1.0e9),          # near the spec's 1.19 GB/s: trusted
    ((1.1e8, 9.0e8), 2, 9.0e8),    # one disturbed fit: timed again, the faster kept
    ((2.4e8, 2.3e8), 2, 2.4e8),    # a link slower than its spec reads slow twice
]
DISTURBED_LINK = [
    (1.0e9, (1.1e9,), 1, 1.1e9),         # alone faster than in the ring: trusted
    (6.4e8, (2.6e8, 1.15e9), 2, 1.15e9),  # read below the bus: timed again, faster kept
    (6.4e8, (2.6e8, 3.0e8), 2, 6.4e8),   # slow twice: not below what the ring carries
    (6.4e8, (6.0e8,), 1, 6.4e8),         # a little below the bus: not retimed, floored
]


@pytest.fixture(scope="module")
def faked_probes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[list[dict]]]:
    """Every case below probed in one pair of spawned workers (a spawn per case took
    4.5 s): each case's results, by rank."""
    import _spawn
    import planner_workers as pw

    setup = _spawn.Setup(args=(2,), local_rank=True, init_group=True)
    bus = _spawn.run(pw.suspect_bus_cases, 2, tmp_path_factory.mktemp("bus"),
                     {"cases": [list(r) for r, _, _ in SUSPECT_BUS]}, setup)
    link = _spawn.run(pw.disturbed_link_cases, 2, tmp_path_factory.mktemp("link"),
                      {"cases": [(b, list(r)) for b, r, _, _ in DISTURBED_LINK]}, setup)
    return {"bus": [list(c) for c in zip(*bus, strict=True)],
            "link": [list(c) for c in zip(*link, strict=True)]}


@pytest.mark.parametrize("case", range(len(SUSPECT_BUS)))
def test_a_bus_rate_far_below_the_spec_is_measured_again(
        faked_probes: dict[str, list[list[dict]]], case: int) -> None:
    _, fits, kept = SUSPECT_BUS[case]
    for r in faked_probes["bus"][case]:
        assert r["fits"] == fits and r["bus_bps"] == pytest.approx(kept), r


@pytest.mark.parametrize("case", range(len(DISTURBED_LINK)))
def test_a_link_alone_read_below_the_bus_rate_is_timed_again(
        faked_probes: dict[str, list[list[dict]]], case: int) -> None:
    _, _, timings, kept = DISTURBED_LINK[case]
    for r in faked_probes["link"][case]:
        assert r["timings"] == timings and r["link_bps"] == pytest.approx(kept), r


def test_link_disturbed_and_settled_known_answers() -> None:
    from stratagem.planner.probe import LINK_BELOW_BUS, link_disturbed, settled_link

    assert link_disturbed(0.5e9, 1e9) and not link_disturbed(LINK_BELOW_BUS * 1e9, 1e9)
    assert not link_disturbed(0.0, 1e9)  # not measured on this rank
    assert settled_link([2e8, 9e8], 1e9) == 1e9 and settled_link([2e8, 1.2e9], 1e9) == 1.2e9
    assert settled_link([0.0], 1e9) == 0.0


def _sparse_profile() -> ModelProfile:
    return ModelProfile(params=(
        ParamInfo("emb", (1000, 125), "float32", 125000, 500000, sparse=True,
                  embedding_like=True),
        ParamInfo("fc", (250, 1000), "float32", 250000, 1000000)))


def test_gathered_rows_known_answer() -> None:
    """A sparse gradient's rows all-gathered: each link carries the other workers' rows
    (values and an int64 index each), and the update touches only the gathered rows."""
    from stratagem.planner.cost_model import GATHER_PASSES, gather_cost
    from stratagem.runtime.allreduce import GATHER_HEADROOM as H
    from stratagem.runtime.plan import GroupPlan, Member

    emb = Member(param="emb", index=0, shape=(1000, 125), offset=0)
    group = GroupPlan(id=7, spec="auto", backend="gloo", compressor="none",
                      powersgd_rank=1, dtype="float32", members=(emb,), gather_rows=True)
    access = {"emb": AccessStats("emb", 1000, 100.0)}
    row = 125 * 4 + 8
    for n in (2, 4):
        s = spec(n)
        wire, work, flows, fixed = gather_cost(group, links(s, latency_s=0.0), s.replicas,
                                               _cal(), access)
        # a ring all-gather: every link carries (n-1) workers' 100 rows, padded to the
        # capacity (H x the rows)
        assert wire == pytest.approx((n - 1) * 100 * H * row / GBIT_BYTES) and fixed == 0.0
        assert [b for _, _, b in flows] == pytest.approx([(n - 1) * 100 * H * row] * n)
        assert work == pytest.approx(GATHER_PASSES * n * 100 * H * row / 1e9)
    # in a step: far less than the dense table's all-reduce, and no dense update of it
    s = spec(2)
    prof = _sparse_profile().with_access([AccessStats("emb", 1000, 100.0)])

    def step(gather: bool) -> object:
        strat = Strategy(node_config=(
            NodeConfig("emb", AllReduceSynchronizer(group=1, gather_rows=gather)),
            NodeConfig("fc", AllReduceSynchronizer(group=0))))
        return predict(strat.with_replicas(s.replicas), prof, s, _cal(update_bps=1e9),
                       links(s, latency_s=0.0))

    gathered, dense = step(True), step(False)
    assert gathered.link_bytes["10.0.0.1 tx"] == pytest.approx(1e6 + 100 * H * row)
    assert dense.link_bytes["10.0.0.1 tx"] == pytest.approx(1.5e6)
    assert gathered.parts["update"] < dense.parts["update"]
    assert gathered.total_s < dense.total_s


def test_replicated_rows_pay_a_pull_rounds_share_per_blocking_all_to_all() -> None:
    """Measured pull rounds of two collectives: each blocking all-to-all between a step's
    own work costs half of one. A replicated table pays it twice in the refresh and once
    more in the push (its rows, announced by no pull, follow the headers); a table pulled
    on demand pays it in neither."""
    s = spec(2)
    w0, _ = s.replicas
    prof = _sparse_profile().with_access([AccessStats("emb", 1000, 10.0)])

    def parts(replicated: bool, round_s: float) -> dict[str, float]:
        strat = Strategy(node_config=(
            NodeConfig("emb", PSSynchronizer(reduction_destination=w0,
                                             local_replication=replicated)),
            NodeConfig("fc", AllReduceSynchronizer(group=0)))).with_replicas(s.replicas)
        lm = links(s, latency_s=0.0, message_cpu_s=0.0, all_to_all_s=1e-3,
                   pull_round_s=round_s, sparse_push_s=5e-3)
        return predict(strat, prof, s, _cal(), lm).parts

    for replicated, per_round in ((True, 3), (False, 0)):
        slow, fast = parts(replicated, 8e-3), parts(replicated, 2e-3)
        # a round's share: 4 ms, then 1 ms
        assert slow["refresh"] - fast["refresh"] == pytest.approx(2 * per_round * 1e-3)
        assert slow["sparse_push"] - fast["sparse_push"] == pytest.approx(per_round * 1e-3)
    # (and its rows' ids on the wire: 10 rows of 8 bytes)
    assert parts(True, 8e-3)["sparse_push"] - parts(False, 8e-3)["sparse_push"] == \
        pytest.approx(4e-3, abs=1e-5)

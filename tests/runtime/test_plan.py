"""compile_plan: group membership, launch order, partition slices and errors (no processes)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from rt_common import make_model

from stratagem.analysis import analyze
from stratagem.errors import StrategyError
from stratagem.resource import ResourceSpec
from stratagem.runtime import Plan, compile_plan, compressor_names
from stratagem.strategy import (
    AllReduce,
    AllReduceSynchronizer,
    GraphConfig,
    NodeConfig,
    PartitionedAR,
    Partitioner,
    PSSynchronizer,
    RandomAxisPartitionAR,
    Strategy,
)

CPU = torch.device("cpu")


def plan_for(builder, model: str = "mlp", world: int = 2, device=CPU) -> tuple[Plan, Strategy]:
    m = make_model(model, 0)
    profile = analyze(m)
    strategy = builder.build(profile, ResourceSpec.local(world))
    return compile_plan(strategy, profile, rank=1, world_size=world, device=device), strategy


def members_by_group(plan: Plan) -> dict[int, list[tuple]]:
    return {g.id: [(m.param, m.axis, m.start, m.length) for m in g.members]
            for g in plan.groups}


def test_allreduce_groups_and_launch_order() -> None:
    plan, _ = plan_for(AllReduce(chunk_size=2))
    assert members_by_group(plan) == {
        2: [("fc3.weight", None, 0, 36), ("fc3.bias", None, 0, 4)],
        1: [("fc2.weight", None, 0, 108), ("fc2.bias", None, 0, 9)],
        0: [("fc1.weight", None, 0, 72), ("fc1.bias", None, 0, 12)],
    }
    assert plan.launch_order == (2, 1, 0)  # gradients of the last layers are ready first
    g = plan.group(1)
    assert [m.offset for m in g.members] == [0, 108]
    assert g.numel == 117 and g.nbytes == 117 * 8 and g.dtype == "float64"
    assert g.backend == "gloo" and g.spec == "auto" and g.compressor == "none"
    assert (plan.rank, plan.world_size, plan.device) == (1, 2, "cpu")


def test_partitioned_slices_follow_the_strategy() -> None:
    for builder in (PartitionedAR(chunk_size=3), RandomAxisPartitionAR(chunk_size=3, seed=1)):
        plan, strategy = plan_for(builder)
        for nc in strategy.node_config:
            pieces = sorted((m.part, m.axis, m.start, m.length, m.shape, g.id)
                            for g in plan.groups for m in g.members if m.param == nc.var_name)
            if nc.partitioner is None:
                assert [p[1] for p in pieces] == [None]
                assert pieces[0][5] == nc.synchronizer.group
                continue
            shape = make_model("mlp", 0).get_parameter(nc.var_name).shape
            axis = nc.partitioner.axis
            sizes = nc.partitioner.part_sizes(tuple(shape))
            start = 0
            for (_part, ax, st, length, sh, gid), size, pc in zip(pieces, sizes, nc.part_config,
                                                                 strict=True):
                assert ax == axis and st == start and length == size
                assert sh[axis] == size and gid == pc.synchronizer.group
                assert sh[:axis] + sh[axis + 1:] == tuple(shape)[:axis] + tuple(shape)[axis + 1:]
                start += size
            assert start == shape[axis]
        for g in plan.groups:  # members packed back to back
            offsets = [m.offset for m in g.members]
            assert offsets == [sum(m.numel for m in g.members[:i]) for i in range(len(offsets))]


def test_random_axis_really_uses_other_axes() -> None:
    plan, _ = plan_for(RandomAxisPartitionAR(chunk_size=3, seed=1))
    assert any(m.axis == 1 for g in plan.groups for m in g.members)


def test_hand_written_uneven_parts() -> None:
    m = make_model("mlp", 0)
    profile = analyze(m)
    ar = AllReduceSynchronizer
    nodes = [NodeConfig(n, synchronizer=ar(group=0)) for n in profile.names
             if n != "fc1.weight"]
    nodes.append(NodeConfig("fc1.weight", partitioner=Partitioner((1, 2), sizes=(2, 4)),
                            part_config=(NodeConfig("fc1.weight/part_0", ar(group=7)),
                                         NodeConfig("fc1.weight/part_1", ar(group=5)))))
    plan = compile_plan(Strategy(tuple(nodes)), profile, rank=0, world_size=2, device=CPU)
    assert members_by_group(plan)[7] == [("fc1.weight", 1, 0, 2)]
    assert members_by_group(plan)[5] == [("fc1.weight", 1, 2, 4)]
    assert plan.group(5).members[0].shape == (12, 4)
    assert plan.launch_order == (0, 5, 7)


def test_tied_weight_appears_once() -> None:
    plan, _ = plan_for(AllReduce(chunk_size=1), model="tied")
    params = [m.param for g in plan.groups for m in g.members]
    assert params.count("emb.weight") == 1 and "out.weight" not in params
    assert plan.params == ("emb.weight", "hidden.weight", "hidden.bias", "out.bias")


def test_auto_spec_picks_nccl_on_cuda() -> None:
    plan, _ = plan_for(AllReduce(), device=torch.device("cuda", 0))
    assert plan.backends == ("nccl",) and plan.device == "cuda:0"
    plan, _ = plan_for(AllReduce(all_reduce_spec="gloo"), device=torch.device("cuda", 0))
    assert plan.backends == ("gloo",)


def test_nccl_on_cpu_is_a_strategy_error() -> None:
    with pytest.raises(StrategyError, match="nccl.*CUDA"):
        plan_for(AllReduce(all_reduce_spec="nccl"))


def _ps_spec(workers: int = 2, servers: int = 2) -> ResourceSpec:
    nodes = [{"address": "10.0.0.1", "chief": True, "workers": workers}]
    nodes += [{"address": f"10.0.1.{i}", "workers": 0} for i in range(servers)]
    return ResourceSpec.from_dict({"nodes": nodes})


def test_ps_pieces_owners_and_buckets() -> None:
    from stratagem.strategy import Parallax, PartitionedPS, validate
    from stratagem.strategy.validate import server_devices

    spec = _ps_spec()
    servers = server_devices(spec)
    profile = analyze(make_model("sparse", 0))
    strategy = validate(PartitionedPS().build(profile, spec), profile, spec)
    plan = compile_plan(strategy, profile, rank=3, world_size=2, device=CPU, servers=servers)
    assert plan.role == "server" and plan.groups == ()
    ps = plan.ps
    assert ps.size == 4 and ps.servers == tuple(servers) and ps.mode == "bsp"
    emb = [p for p in ps.pieces if p.param == "emb.weight"]
    assert [(p.axis, p.start, p.length, p.sparse, p.sparse_grad) for p in emb] == [
        (0, 0, 10, True, True), (0, 10, 10, True, True)]
    assert {p.owner for p in emb} == {2, 3}  # servers are ranks 2 and 3
    for b in ps.buckets:  # one owner and dtype per bucket, pieces packed back to back
        pieces = [ps.pieces[i] for i in b.pieces]
        assert {p.owner for p in pieces} == {b.owner} and not any(p.sparse for p in pieces)
        assert [p.offset for p in pieces] == [sum(q.numel for q in pieces[:i])
                                             for i in range(len(pieces))]
        assert b.size == b.numel + len(pieces)  # presence slots
    dense = {p.param for p in ps.pieces if not p.sparse}
    assert dense == {"fc.weight", "fc.bias"}
    assert "parameter server (bsp)" in plan.summary()
    json.dumps(plan.to_dict())
    # Parallax mixes: dense -> all-reduce groups, the embedding -> PS rows.
    mixed = compile_plan(validate(Parallax().build(profile, spec), profile, spec), profile,
                         rank=0, world_size=2, device=CPU, servers=servers)
    assert {m.param for g in mixed.groups for m in g.members} == {"fc.weight", "fc.bias"}
    assert {p.param for p in mixed.ps.pieces} == {"emb.weight"} and mixed.role == "worker"


def test_dense_declared_embedding_takes_the_row_path() -> None:
    from stratagem.strategy import PS

    profile = analyze(make_model("tied", 0))  # tied: stays dense
    plan = compile_plan(PS().build(profile, ResourceSpec.local(2)), profile, rank=0,
                        world_size=2, device=CPU)
    assert not any(p.sparse for p in plan.ps.pieces)
    profile = analyze(torch.nn.Sequential(torch.nn.Embedding(6, 2), torch.nn.Linear(2, 1)))
    plan = compile_plan(PS().build(profile, ResourceSpec.local(2)), profile, rank=1,
                        world_size=2, device=CPU)
    emb = plan.ps.pieces_of("0.weight")[0]
    assert emb.sparse and not emb.sparse_grad and emb.owner == 0


def test_ps_strategy_errors() -> None:
    m = make_model("mlp", 0)
    profile = analyze(m)
    reps = ("127.0.0.1:CPU:0", "127.0.0.1:CPU:1")
    graph = GraphConfig(reps)

    def strat(nodes):
        return Strategy(tuple(nodes), graph_config=graph)

    ps = [NodeConfig(n, synchronizer=PSSynchronizer(reps[0])) for n in profile.names]
    plan = compile_plan(strat(ps), profile, rank=1, world_size=2, device=CPU)
    assert {p.owner for p in plan.ps.pieces} == {0} and plan.ps.servers == ()
    with pytest.raises(StrategyError, match="replicas lists 0 workers"):
        compile_plan(Strategy(tuple(ps)), profile, rank=0, world_size=2, device=CPU)
    bad = [*ps[:-1], NodeConfig(profile.names[-1], synchronizer=PSSynchronizer(
        reps[0], sync=False))]
    with pytest.raises(StrategyError, match="mix consistency modes"):
        compile_plan(strat(bad), profile, rank=0, world_size=2, device=CPU)
    split = NodeConfig("fc1.weight", partitioner=Partitioner((2, 1)), part_config=(
        NodeConfig("fc1.weight/part_0", AllReduceSynchronizer()),
        NodeConfig("fc1.weight/part_1", PSSynchronizer(reps[1]))))
    with pytest.raises(StrategyError, match="mix AllReduce and PS"):
        compile_plan(strat([split, *ps[1:]]), profile, rank=0, world_size=2, device=CPU)
    with pytest.raises(StrategyError, match="neither a worker replica"):
        compile_plan(strat([NodeConfig(profile.names[0], PSSynchronizer("10.9.9.9:PS:0")),
                            *ps[1:]]), profile, rank=0, world_size=2, device=CPU,
                     servers=())
    with pytest.raises(StrategyError, match="rank 3 is not in a world of size 2 plus 1"):
        compile_plan(strat([NodeConfig(profile.names[0], PSSynchronizer("10.9.9.9:PS:0")),
                            *ps[1:]]), profile, rank=3, world_size=2, device=CPU)


def test_group_mixing_compressors_is_an_error() -> None:
    m = make_model("mlp", 0)
    profile = analyze(m)
    nodes = tuple(NodeConfig(n, synchronizer=AllReduceSynchronizer(
        group=0, compressor="fp16" if i else "none")) for i, n in enumerate(profile.names))
    with pytest.raises(StrategyError, match="group 0 mixes compressor"):
        compile_plan(Strategy(nodes), profile, rank=0, world_size=2, device=CPU)


def test_unknown_and_missing_parameters() -> None:
    m = make_model("mlp", 0)
    profile = analyze(m)
    nodes = [NodeConfig(n, synchronizer=AllReduceSynchronizer()) for n in profile.names]
    with pytest.raises(StrategyError, match="did you mean 'fc1.weight'"):
        compile_plan(Strategy((*nodes[1:], NodeConfig("fc1.weigth", AllReduceSynchronizer()))),
                     profile, rank=0, world_size=2, device=CPU)
    with pytest.raises(StrategyError, match="'fc1.weight' has no config"):
        compile_plan(Strategy(tuple(nodes[1:])), profile, rank=0, world_size=2, device=CPU)
    with pytest.raises(StrategyError, match="rank 2 is not in a world of size 2"):
        compile_plan(Strategy(tuple(nodes)), profile, rank=2, world_size=2, device=CPU)


def test_powersgd_on_sparse_is_an_error() -> None:
    with pytest.raises(StrategyError, match="sparse"):
        plan_for(AllReduce(compressor="powersgd"), model="sparse")
    plan, _ = plan_for(AllReduce(), model="sparse")
    assert plan.densified == ("emb.weight",)


def test_plan_is_printable_data() -> None:
    plan, _ = plan_for(PartitionedAR(chunk_size=3))
    text = plan.summary()
    assert "launch order" in text and "fc1.weight[axis 0: 0:6]" in text
    json.dumps(plan.to_dict())
    assert compressor_names() == ["bf16", "fp16", "none", "powersgd"]


def _gather_strategy(profile, **overrides) -> Strategy:
    """AllReduce of every parameter, the sparse embedding's rows gathered (group 9)."""
    sync = {"emb.weight": AllReduceSynchronizer(gather_rows=True, group=9, **overrides)}
    return Strategy(tuple(NodeConfig(n, synchronizer=sync.get(n, AllReduceSynchronizer()))
                          for n in profile.names))


def test_gathered_rows_get_their_own_group_and_are_not_densified() -> None:
    profile = analyze(make_model("sparse", 0))
    plan = compile_plan(_gather_strategy(profile), profile, rank=0, world_size=2, device=CPU)
    g = plan.group(9)
    assert g.gather_rows and [m.param for m in g.members] == ["emb.weight"]
    assert not plan.group(0).gather_rows and "emb.weight" not in plan.group(0).params
    assert plan.densified == ()  # summed as rows, not made dense
    assert "rows all-gathered" in plan.summary()


def test_gathered_rows_errors_name_the_fix() -> None:
    profile = analyze(make_model("sparse", 0))
    with pytest.raises(StrategyError, match="compressor none"):
        compile_plan(_gather_strategy(profile, compressor="fp16"), profile, rank=0,
                     world_size=2, device=CPU)
    dense = [NodeConfig(n, synchronizer=AllReduceSynchronizer(gather_rows=n == "fc.weight",
                                                             group=int(n == "fc.weight")))
             for n in profile.names]
    with pytest.raises(StrategyError, match="its gradient is dense") as exc:
        compile_plan(Strategy(tuple(dense)), profile, rank=0, world_size=2, device=CPU)
    assert "row_sparse" in exc.value.fix
    shared = [NodeConfig(n, synchronizer=AllReduceSynchronizer(
        gather_rows=n == "emb.weight", group=0)) for n in profile.names]
    with pytest.raises(StrategyError, match="group 0 mixes gather_rows"):
        compile_plan(Strategy(tuple(shared)), profile, rank=0, world_size=2, device=CPU)
    parts = PartitionedAR(chunk_size=3).build(profile, ResourceSpec.local(2))
    emb = next(nc for nc in parts.node_config if nc.var_name == "emb.weight")
    assert emb.partitioner is not None
    from dataclasses import replace
    split = replace(emb, part_config=tuple(
        replace(pc, synchronizer=AllReduceSynchronizer(gather_rows=True, group=50 + i))
        for i, pc in enumerate(emb.part_config)))
    nodes = tuple(split if nc is emb else nc for nc in parts.node_config)
    with pytest.raises(StrategyError, match="gather_rows on a part"):
        compile_plan(replace(parts, node_config=nodes), profile, rank=0, world_size=2,
                     device=CPU)


def test_gather_rows_round_trips_and_is_written_only_when_set() -> None:
    profile = analyze(make_model("sparse", 0))
    s = _gather_strategy(profile)
    again = Strategy.from_dict(json.loads(s.to_json()))
    assert again.config_for("emb.weight").synchronizer.gather_rows
    assert "gather_rows" not in json.dumps(again.config_for("fc.weight").synchronizer.to_dict())


class _ScriptedComm:
    """A two-rank communicator whose peer (rank 1) follows the gathered rows' protocol with
    the rows ``peer`` holds (values 1.0): its count and as many rows as fit in the first
    round, the rest in the second. Records each all-gather's (dtype, numel)."""

    world_size = 2

    def __init__(self) -> None:
        self.peer = torch.zeros(0, dtype=torch.int64)
        self.first = True  # the next int64 all-gather is the first round's
        self.sent = 0  # peer rows sent in earlier rounds of this step
        self.last = 0  # peer rows in the latest round
        self.calls: list[tuple[torch.dtype, int]] = []

    def step(self, rows: list[int]) -> None:
        self.peer = torch.tensor(rows, dtype=torch.int64)
        self.first, self.sent = True, 0

    def all_gather(self, out: list[torch.Tensor], tensor: torch.Tensor) -> None:
        self.calls.append((tensor.dtype, tensor.numel()))
        out[0].copy_(tensor)
        out[1].zero_()
        if tensor.dtype != torch.int64:
            out[1][:self.last] = 1.0
            return
        head = 1 if self.first else 0
        room = tensor.numel() - head
        send = self.peer[self.sent:self.sent + room]
        if self.first:
            out[1][0] = len(self.peer)
        out[1][head:head + len(send)] = send
        self.first, self.last = False, len(send)
        self.sent += len(send)

    def wait(self, work: object) -> None:
        pass


def _gathered_grads(steps: list[tuple[list[int], list[int]]]
                    ) -> tuple[list[torch.Tensor], list[list[tuple[torch.dtype, int]]]]:
    """Each step: (this rank's ids, the peer's rows) -> the summed gradients, and each
    step's all-gathers."""
    from stratagem.runtime.allreduce import _RowsGroupRT

    model = make_model("sparse", 0)
    profile = analyze(model)
    plan = compile_plan(_gather_strategy(profile), profile, rank=0, world_size=2, device=CPU)
    params = dict(model.named_parameters())
    comm = _ScriptedComm()
    g = _RowsGroupRT(plan.group(9), params, comm, CPU)
    grads, calls = [], []
    for mine, peer in steps:
        model.zero_grad(set_to_none=True)
        model(torch.tensor(mine)).sum().backward()
        comm.step(peer)
        comm.calls = []
        g.members[0].capture(0.5)
        g.start_round(0)
        g.finish()
        g.members[0].write_back(lambda *_: None)
        grads.append(params["emb.weight"].grad)
        calls.append(comm.calls)
    return grads, calls


def _gathered_grad(peer_rows: list[int]) -> torch.Tensor:
    return _gathered_grads([([3, 3, 7], peer_rows)])[0][0]


def test_gathered_rows_sum_every_rank_and_refuse_rows_out_of_range() -> None:
    from stratagem.errors import DistributedError

    grad = _gathered_grad([7, 12])  # rank 1 touched rows 7 and 12 (values 1.0)
    assert grad.is_sparse and grad.is_coalesced()
    assert grad.indices()[0].tolist() == [3, 7, 12]
    dense = grad.to_dense()
    # this rank's, scaled by 0.5: row 3 read twice, row 7 once; d(sum)/d(row) = fc's sums
    fc = make_model("sparse", 0).fc.weight.sum(0).detach()
    torch.testing.assert_close(dense[3], 2 * fc * 0.5)
    torch.testing.assert_close(dense[7], fc * 0.5 + 1.0)  # plus rank 1's
    torch.testing.assert_close(dense[12], torch.ones_like(fc))
    assert dense.abs().sum(1).nonzero().flatten().tolist() == [3, 7, 12]
    with pytest.raises(DistributedError, match="rank 1 sent rows of 'emb.weight' outside"):
        _gathered_grad([7, 20])


def test_gathered_rows_fit_one_round_after_the_first_step() -> None:
    """The first step sends counts, then the rows; later steps send up to the last step's
    most rows (with headroom) in the first round, and only the rows beyond it in a second.
    Every step's sum is the two ranks' rows, whichever round carried them."""
    from stratagem.runtime.allreduce import GATHER_HEADROOM

    fc = make_model("sparse", 0).fc.weight.sum(0).detach()
    steps = [([3, 3, 7], [7, 12]),           # counts 2 and 2: capacity then 3 (2 x 1.125)
             ([5], [1, 2, 4]),               # 1 and 3 rows: fit
             ([0, 1, 2, 3, 4], [9, 10, 11, 12, 13, 14, 15])]  # 5 and 7: beyond 4
    grads, calls = _gathered_grads(steps)
    i64, f, d = torch.int64, fc.dtype, fc.numel()
    assert calls[0] == [(i64, 1), (i64, 2), (f, 2 * d)]  # the counts, then the rows
    assert math.ceil(2 * GATHER_HEADROOM) == 3
    assert calls[1] == [(i64, 1 + 3), (f, 3 * d)]  # one round
    cap = math.ceil(3 * GATHER_HEADROOM)
    assert calls[2] == [(i64, 1 + cap), (f, cap * d), (i64, 7 - cap), (f, (7 - cap) * d)]
    for (mine, peer), grad in zip(steps, grads, strict=True):
        want = torch.zeros(20, d, dtype=f)
        for i in mine:
            want[i] += 0.5 * fc
        for i in peer:
            want[i] += 1.0
        assert grad.is_sparse and grad.is_coalesced()
        assert grad.indices()[0].tolist() == sorted(set(mine) | set(peer))
        torch.testing.assert_close(grad.to_dense(), want)

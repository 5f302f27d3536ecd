"""compile_plan: group membership, launch order, partition slices and errors (no processes)."""

from __future__ import annotations

import json

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


def test_ps_synchronizer_is_not_available_yet() -> None:
    m = make_model("mlp", 0)
    profile = analyze(m)
    nodes = tuple(NodeConfig(n, synchronizer=PSSynchronizer("127.0.0.1:CPU:0"))
                  for n in profile.names)
    with pytest.raises(StrategyError, match="parameter-server runtime is not available"):
        compile_plan(Strategy(nodes), profile, rank=0, world_size=2, device=CPU)


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

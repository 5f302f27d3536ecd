"""Builder semantics: AllReduce grouping, PartitionedAR splits, RandomAxisPartitionAR,
and the name registry."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
from torch import nn

from stratagem.analysis import ModelProfile, analyze
from stratagem.errors import StrategyError
from stratagem.resource import ResourceSpec
from stratagem.strategy import (
    AllReduce,
    AllReduceSynchronizer,
    PartitionedAR,
    Partitioner,
    RandomAxisPartitionAR,
    Strategy,
    StrategyBuilder,
    builder_from_name,
    builder_names,
)
from stratagem.strategy.builders.base import smallest_divisor


def groups(s: Strategy) -> list[int]:
    return [leaf.synchronizer.group for nc in s.node_config for leaf in nc.leaves()]


# --------------------------------------------------------------------------- AllReduce
@pytest.mark.parametrize("chunk_size", [1, 2, 3, 4, 128])
def test_allreduce_group_is_index_div_chunk(zoo_profile: ModelProfile, local3: ResourceSpec,
                                            chunk_size: int) -> None:
    s = AllReduce(chunk_size=chunk_size).build(zoo_profile, local3)
    assert [nc.var_name for nc in s.node_config] == zoo_profile.names
    assert groups(s) == [i // chunk_size for i in range(len(zoo_profile.params))]
    assert all(nc.partitioner is None for nc in s.node_config)


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({}, AllReduceSynchronizer("auto", "none", 0, 1)),
        ({"compressor": "fp16", "all_reduce_spec": "nccl"},
         AllReduceSynchronizer("nccl", "fp16", 0, 1)),
        ({"compressor": "powersgd", "powersgd_rank": 4},
         AllReduceSynchronizer("auto", "powersgd", 0, 4)),
    ],
)
def test_allreduce_settings_reach_every_parameter(
    zoo_profile: ModelProfile, local3: ResourceSpec, kwargs: dict, expected: Any
) -> None:
    s = AllReduce(**kwargs).build(zoo_profile, local3)
    assert {nc.synchronizer for nc in s.node_config} == {expected}


@pytest.mark.parametrize("builder", [AllReduce(), PartitionedAR(), RandomAxisPartitionAR()])
def test_builders_fill_replicas_and_name(builder: Any, zoo_profile: ModelProfile,
                                         gpu_cluster: ResourceSpec) -> None:
    s = builder.build(zoo_profile, gpu_cluster)
    assert list(s.graph_config.replicas) == gpu_cluster.replicas
    assert s.builder == type(builder).__name__
    assert isinstance(builder, StrategyBuilder)


@pytest.mark.parametrize("builder", [AllReduce(chunk_size=2), PartitionedAR(chunk_size=3),
                                     RandomAxisPartitionAR(seed=5)])
def test_builders_are_pure(builder: Any, zoo_profile: ModelProfile,
                           local3: ResourceSpec) -> None:
    before = copy.deepcopy(zoo_profile)
    a, b = builder.build(zoo_profile, local3), builder.build(zoo_profile, local3)
    assert a.node_config == b.node_config and a.graph_config == b.graph_config
    assert zoo_profile == before


# ------------------------------------------------------------------------ PartitionedAR
@pytest.mark.parametrize(
    ("n", "d"),
    [(0, 1), (1, 1), (2, 2), (3, 3), (4, 2), (9, 3), (13, 13), (25, 5), (49, 7), (64, 2),
     (97, 97), (1000, 2)],
)
def test_smallest_divisor(n: int, d: int) -> None:
    assert smallest_divisor(n) == d


# zoo: name -> (expected parts along axis 0; 1 means not partitioned)
ZOO_PARTS = {"scale": 1, "prime": 13, "emb.weight": 2, "conv.weight": 3, "conv.bias": 3,
             "lin.weight": 5, "lin.bias": 5, "one.weight": 1, "one.bias": 1}


def test_partitioned_ar_splits_axis0_by_smallest_divisor(zoo_profile: ModelProfile,
                                                         local3: ResourceSpec) -> None:
    s = PartitionedAR().build(zoo_profile, local3)
    assert [nc.var_name for nc in s.node_config] == zoo_profile.names
    for nc, info in zip(s.node_config, zoo_profile.params, strict=True):
        k = ZOO_PARTS[info.name]
        if k == 1:
            assert nc.partitioner is None and nc.part_config == ()
            assert isinstance(nc.synchronizer, AllReduceSynchronizer)
            continue
        assert nc.synchronizer is None
        assert nc.partitioner == Partitioner((k,) + (1,) * (len(info.shape) - 1))
        assert nc.partitioner.axis == 0 and nc.partitioner.sizes is None
        assert [p.var_name for p in nc.part_config] == [f"{info.name}/part_{i}"
                                                        for i in range(k)]
        assert all(p.partitioner is None for p in nc.part_config)


@pytest.mark.parametrize("chunk_size", [1, 3, 128])
def test_partitioned_ar_parts_take_consecutive_group_slots(
    zoo_profile: ModelProfile, local3: ResourceSpec, chunk_size: int
) -> None:
    s = PartitionedAR(chunk_size=chunk_size, compressor="fp16").build(zoo_profile, local3)
    slots = sum(ZOO_PARTS.values())
    assert groups(s) == [slot // chunk_size for slot in range(slots)]
    leaves = [leaf.synchronizer for nc in s.node_config for leaf in nc.leaves()]
    assert {(x.compressor, x.spec) for x in leaves} == {("fp16", "auto")}


# ---------------------------------------------------------------- RandomAxisPartitionAR
def axes(s: Strategy) -> list[int | None]:
    return [nc.partitioner.axis if nc.partitioner else None for nc in s.node_config]


def test_random_axis_is_deterministic_for_a_seed(zoo_profile: ModelProfile,
                                                 local3: ResourceSpec) -> None:
    for seed in range(5):
        a = RandomAxisPartitionAR(seed=seed).build(zoo_profile, local3)
        b = RandomAxisPartitionAR(seed=seed).build(zoo_profile, local3)
        assert a.node_config == b.node_config


def test_random_axis_varies(zoo_profile: ModelProfile, local3: ResourceSpec) -> None:
    built = [RandomAxisPartitionAR(seed=seed).build(zoo_profile, local3) for seed in range(8)]
    # across seeds the choice differs, and within one strategy several axes are used
    assert len({tuple(axes(s)) for s in built}) > 1
    chosen = {a for s in built for a in axes(s) if a is not None}
    assert chosen >= {0, 1}
    assert max(len({a for a in axes(s) if a is not None}) for s in built) > 1


@pytest.mark.parametrize("seed", range(6))
def test_random_axis_splits_chosen_axis_by_smallest_divisor(
    zoo_profile: ModelProfile, local3: ResourceSpec, seed: int
) -> None:
    s = RandomAxisPartitionAR(seed=seed, chunk_size=2).build(zoo_profile, local3)
    slots = 0
    for nc, info in zip(s.node_config, zoo_profile.params, strict=True):
        if nc.partitioner is None:
            # scalars, and axes of size 1, are left whole
            assert not info.shape or any(smallest_divisor(d) == 1 for d in info.shape)
            slots += 1
            continue
        axis, k = nc.partitioner.axis, nc.partitioner.num_parts
        assert k == smallest_divisor(info.shape[axis]) >= 2
        assert nc.partitioner.splits == tuple(k if i == axis else 1
                                              for i in range(len(info.shape)))
        assert [p.var_name for p in nc.part_config] == [f"{info.name}/part_{i}"
                                                        for i in range(k)]
        slots += k
    assert groups(s) == [i // 2 for i in range(slots)]


# ------------------------------------------------------------------------------ registry
def test_builder_names() -> None:
    assert builder_names() == sorted(builder_names())
    assert set(builder_names()) >= {"AllReduce", "PartitionedAR", "RandomAxisPartitionAR"}


@pytest.mark.parametrize(
    ("name", "cls"),
    [("AllReduce", AllReduce), ("allreduce", AllReduce), ("ALLREDUCE", AllReduce),
     ("partitionedar", PartitionedAR), ("PartitionedAR", PartitionedAR),
     ("randomAxisPartitionAR", RandomAxisPartitionAR)],
)
def test_builder_from_name_case_insensitive(name: str, cls: type) -> None:
    b = builder_from_name(name)
    assert type(b) is cls and b == cls()


@pytest.mark.parametrize("name", ["Ring", "", "AllReduce2", "PSX"])
def test_unknown_builder_lists_the_builders(name: str) -> None:
    with pytest.raises(StrategyError) as err:
        builder_from_name(name)
    assert f"unknown strategy builder {name!r}" in str(err.value)
    for known in builder_names():
        assert known in (err.value.fix or "")


@pytest.mark.parametrize("cls", [AllReduce, PartitionedAR, RandomAxisPartitionAR])
@pytest.mark.parametrize(
    ("kwargs", "problem"),
    [({"chunk_size": 0}, "chunk_size must be >= 1, got 0"),
     ({"chunk_size": -3}, "chunk_size must be >= 1, got -3"),
     ({"compressor": "gzip"}, "unknown compressor 'gzip'"),
     ({"all_reduce_spec": "mpi"}, "unknown all_reduce_spec 'mpi'")],
)
def test_bad_builder_arguments(cls: type, kwargs: dict, problem: str) -> None:
    with pytest.raises(StrategyError, match="fix:") as err:
        cls(**kwargs)
    assert err.value.problem == problem


def test_large_prime_dimension_gives_that_many_parts(local3: ResourceSpec) -> None:
    # AutoDist's rule, kept deliberately: a prime dim 0 is split into single rows.
    profile = analyze(nn.Linear(3, 31))
    s = PartitionedAR().build(profile, local3)
    assert s.config_for("weight").partitioner.num_parts == 31
    assert math.prod(s.config_for("bias").partitioner.splits) == 31


def test_allreduce_on_the_ddp_engine_groups_as_ddp_buckets(monkeypatch: Any) -> None:
    """Without chunk_size, AllReduce on the ddp engine cuts its groups where torch's own
    bucket assignment (reverse registration order, closed at the size limit) cuts DDP's
    buckets; on the stratagem engine it keeps 128 parameters a group."""
    import torch
    import torch.distributed as dist

    from stratagem.strategy.builders import allreduce

    monkeypatch.setattr(allreduce, "DDP_BUCKET_BYTES", 400)
    monkeypatch.setattr(allreduce, "DDP_FIRST_BUCKET_BYTES", 100)
    model = nn.Sequential(*[nn.Linear(n, 3) for n in (2, 40, 1, 90, 5, 7, 60)])
    profile = analyze(model)
    spec = ResourceSpec.local(2)
    names = [p.name for p in profile.params]
    tensors = [torch.empty(p.shape) for p in reversed(profile.params)]
    # DDP's own layout: its first bucket (here 100 bytes), then buckets of the size limit;
    # without the first bucket (first_bucket_bytes=0), buckets of the size limit only
    for first, limits in ((None, [100, 400]), (0, [400])):
        strategy = AllReduce(engine="ddp", first_bucket_bytes=first).build(profile, spec)
        groups: dict[int, set[str]] = {}
        for nc in strategy.node_config:
            groups.setdefault(nc.synchronizer.group, set()).add(nc.var_name)
        want, _ = dist._compute_bucket_assignment_by_size(tensors, limits,
                                                           [False] * len(names))
        assert len(want) > 2
        # torch lists buckets in launch order; group ids count in registration order
        assert [groups[g] for g in sorted(groups, reverse=True)] == [
            {names[len(names) - 1 - i] for i in bucket} for bucket in want]
    plain = AllReduce().build(profile, spec)
    assert {nc.synchronizer.group for nc in plain.node_config} == {0}
    assert {nc.synchronizer.group for nc in AllReduce(chunk_size=2, engine="ddp").build(
        profile, spec).node_config} == set(range(7))


@pytest.mark.parametrize("engine", ["ddp", "stratagem"])
def test_allreduce_bucket_bytes_groups_as_ddp_buckets_of_that_size(engine: str) -> None:
    """``bucket_bytes`` (DDP's ``bucket_cap_mb``) cuts the groups where torch's own bucket
    assignment cuts buckets of that size, on either engine; with chunk_size, or below 1,
    it is refused with the fix."""
    import torch
    import torch.distributed as dist

    model = nn.Sequential(*[nn.Linear(n, 3) for n in (2, 40, 1, 90, 5, 7, 60)])
    profile = analyze(model)
    names = [p.name for p in profile.params]
    tensors = [torch.empty(p.shape) for p in reversed(profile.params)]
    # DDP's 1 MiB first bucket holds this whole model: one group, where it applies (the
    # ddp engine's default); first_bucket_bytes=0 or 200 gives the layout it names
    one_group = None  # (limits of the default on the ddp engine: DDP's first bucket, all)
    default = one_group if engine == "ddp" else [300]
    for first, limits in ((0, [300]), (200, [200, 300]), (None, default)):
        strategy = AllReduce(engine=engine, bucket_bytes=300,
                             first_bucket_bytes=first).build(profile, ResourceSpec.local(2))
        groups: dict[int, set[str]] = {}
        for nc in strategy.node_config:
            assert nc.synchronizer.engine == engine
            groups.setdefault(nc.synchronizer.group, set()).add(nc.var_name)
        if limits is one_group:
            assert len(groups) == 1
            continue
        want, _ = dist._compute_bucket_assignment_by_size(tensors, limits,
                                                           [False] * len(names))
        assert len(want) > 3
        assert [groups[g] for g in sorted(groups, reverse=True)] == [
            {names[len(names) - 1 - i] for i in bucket} for bucket in want]
    for bad in ({"bucket_bytes": 0}, {"bucket_bytes": 300, "chunk_size": 4},
                {"bucket_bytes": True}, {"first_bucket_bytes": -1},
                {"first_bucket_bytes": 100, "chunk_size": 4}, {"first_bucket_bytes": 1.5}):
        with pytest.raises(StrategyError, match="fix:"):
            AllReduce(engine=engine, **bad)

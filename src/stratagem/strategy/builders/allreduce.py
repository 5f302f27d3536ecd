"""AllReduce-family builders: plain, partitioned along axis 0, partitioned on a random axis."""

from __future__ import annotations

import random
from dataclasses import dataclass

from stratagem.analysis.profile import ModelProfile, ParamInfo
from stratagem.errors import StrategyError
from stratagem.resource import ResourceSpec
from stratagem.strategy.builders.base import register, smallest_divisor
from stratagem.strategy.compressors import check_compressor
from stratagem.strategy.schema import (
    ALL_REDUCE_SPECS,
    ENGINES,
    AllReduceSynchronizer,
    GraphConfig,
    NodeConfig,
    Partitioner,
    Strategy,
)


def _check_common(chunk_size: int, compressor: str, spec: str) -> None:
    if chunk_size < 1:
        raise StrategyError(f"chunk_size must be >= 1, got {chunk_size}",
                            fix="use a positive number of parameters per group, e.g. 128")
    check_compressor(compressor)
    if spec not in ALL_REDUCE_SPECS:
        raise StrategyError(f"unknown all_reduce_spec {spec!r}",
                            fix=f"use one of {', '.join(ALL_REDUCE_SPECS)}")


@register("AllReduce")
@dataclass(frozen=True)
class AllReduce:
    """Every parameter all-reduced; parameter index // chunk_size gives its fused group.

    ``engine``: ``stratagem`` (this runtime's reducer) or ``ddp`` (torch's DDP reducer, one
    bucket per group; whole dense parameters only)."""

    chunk_size: int = 128
    all_reduce_spec: str = "auto"
    compressor: str = "none"
    powersgd_rank: int = 1
    engine: str = "stratagem"

    def __post_init__(self) -> None:
        _check_common(self.chunk_size, self.compressor, self.all_reduce_spec)
        if self.engine not in ENGINES:
            raise StrategyError(f"unknown engine {self.engine!r}",
                                fix=f"use one of {', '.join(ENGINES)}")

    def sync(self, index: int) -> AllReduceSynchronizer:
        return AllReduceSynchronizer(spec=self.all_reduce_spec, compressor=self.compressor,
                                     group=index // self.chunk_size,
                                     powersgd_rank=self.powersgd_rank, engine=self.engine)

    def build(self, profile: ModelProfile, spec: ResourceSpec) -> Strategy:
        nodes = tuple(NodeConfig(var_name=p.name, synchronizer=self.sync(i))
                      for i, p in enumerate(profile.params))
        return Strategy(node_config=nodes, graph_config=GraphConfig(tuple(spec.replicas)),
                        builder=type(self).__name__)


def _partitioned_node(info: ParamInfo, axis: int, counter: int, make: AllReduce
                      ) -> tuple[NodeConfig, int]:
    """Split ``axis`` of ``info`` into its smallest divisor of parts, one group slot each."""
    if not info.shape:
        return NodeConfig(var_name=info.name, synchronizer=make.sync(counter)), 1
    parts = min(smallest_divisor(info.shape[axis]), info.shape[axis])
    if parts <= 1:
        return NodeConfig(var_name=info.name, synchronizer=make.sync(counter)), 1
    splits = [1] * len(info.shape)
    splits[axis] = parts
    part_nodes = tuple(NodeConfig(var_name=f"{info.name}/part_{i}",
                                  synchronizer=make.sync(counter + i)) for i in range(parts))
    node = NodeConfig(var_name=info.name, partitioner=Partitioner(tuple(splits)),
                      part_config=part_nodes)
    return node, parts


@register("PartitionedAR")
@dataclass(frozen=True)
class PartitionedAR:
    """Split each parameter along axis 0 and all-reduce the parts as separate messages.

    Each part takes one slot of the group counter, so big parameters spread over groups
    and their parts can be reduced as soon as each group is ready.
    """

    chunk_size: int = 128
    all_reduce_spec: str = "auto"
    compressor: str = "none"

    def __post_init__(self) -> None:
        _check_common(self.chunk_size, self.compressor, self.all_reduce_spec)

    def axis_for(self, info: ParamInfo, rng: random.Random) -> int:
        return 0

    def build(self, profile: ModelProfile, spec: ResourceSpec) -> Strategy:
        make = AllReduce(self.chunk_size, self.all_reduce_spec, self.compressor)
        rng = random.Random(getattr(self, "seed", 0))
        nodes, counter = [], 0
        for info in profile.params:
            node, used = _partitioned_node(info, self.axis_for(info, rng), counter, make)
            nodes.append(node)
            counter += used
        return Strategy(node_config=tuple(nodes),
                        graph_config=GraphConfig(tuple(spec.replicas)),
                        builder=type(self).__name__)


@register("RandomAxisPartitionAR")
@dataclass(frozen=True)
class RandomAxisPartitionAR(PartitionedAR):
    """Like PartitionedAR, but each parameter is split along a random axis (seeded)."""

    seed: int = 0

    def axis_for(self, info: ParamInfo, rng: random.Random) -> int:
        return rng.randrange(len(info.shape)) if info.shape else 0

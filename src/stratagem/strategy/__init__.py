"""Strategies (per-parameter distribution plans) and the builders that produce them."""

from stratagem.strategy.builders import (
    PS,
    AllReduce,
    Auto,
    Parallax,
    PartitionedAR,
    PartitionedPS,
    PSLoadBalancing,
    RandomAxisPartitionAR,
    StrategyBuilder,
    UnevenPartitionedPS,
    builder_from_name,
    builder_names,
)
from stratagem.strategy.resolve import resolve_builder
from stratagem.strategy.schema import (
    SCHEMA_VERSION,
    AllReduceSynchronizer,
    GraphConfig,
    NodeConfig,
    Partitioner,
    PSSynchronizer,
    ShardedSynchronizer,
    Strategy,
)
from stratagem.strategy.validate import validate

__all__ = [
    "SCHEMA_VERSION",
    "AllReduce",
    "AllReduceSynchronizer",
    "Auto",
    "GraphConfig",
    "NodeConfig",
    "PSSynchronizer",
    "ShardedSynchronizer",
    "PartitionedAR",
    "Partitioner",
    "RandomAxisPartitionAR",
    "Strategy",
    "StrategyBuilder",
    "builder_from_name",
    "builder_names",
    "resolve_builder",
    "validate",
    "PS",
    "PSLoadBalancing",
    "PartitionedPS",
    "UnevenPartitionedPS",
    "Parallax",
]

"""Strategy builders; importing this package registers them by name."""

from stratagem.strategy.builders.allreduce import AllReduce, PartitionedAR, RandomAxisPartitionAR
from stratagem.strategy.builders.auto import Auto
from stratagem.strategy.builders.base import (
    StrategyBuilder,
    builder_from_name,
    builder_names,
    register,
)
from stratagem.strategy.builders.parallax import Parallax
from stratagem.strategy.builders.ps import (
    PS,
    PartitionedPS,
    PSLoadBalancing,
    UnevenPartitionedPS,
)
from stratagem.strategy.builders.sharded import ZeRO

__all__ = [
    "AllReduce",
    "Auto",
    "PartitionedAR",
    "RandomAxisPartitionAR",
    "StrategyBuilder",
    "builder_from_name",
    "builder_names",
    "register",
    "PS",
    "PSLoadBalancing",
    "PartitionedPS",
    "UnevenPartitionedPS",
    "Parallax",
    "ZeRO",
]

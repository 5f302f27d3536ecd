"""Strategy builders; importing this package registers them by name."""

from stratagem.strategy.builders.allreduce import AllReduce, PartitionedAR, RandomAxisPartitionAR
from stratagem.strategy.builders.base import (
    StrategyBuilder,
    builder_from_name,
    builder_names,
    register,
)

__all__ = [
    "AllReduce",
    "PartitionedAR",
    "RandomAxisPartitionAR",
    "StrategyBuilder",
    "builder_from_name",
    "builder_names",
    "register",
]

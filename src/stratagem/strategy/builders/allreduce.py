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


CHUNK_SIZE = 128
"""Parameters per fused group where ``chunk_size`` is not given (this runtime's engine)."""
DDP_BUCKET_BYTES = 25 * 2**20
"""Group size on the ddp engine where ``chunk_size`` is not given: torch DDP's own default
``bucket_cap_mb`` (25 MiB), so that AllReduce on the ddp engine cuts its buckets as plain
DDP does. By parameter count (128 a group) the 482-tensor ``many_small`` model of
bench/auto_strategy.py had 4 buckets against plain DDP's 2."""
DDP_FIRST_BUCKET_BYTES = 2**20
"""torch DDP's first bucket (1 MiB, its ``_DEFAULT_FIRST_BUCKET_BYTES``): the first gradients
of backward start their all-reduce while backward goes on. A group of its own where
AllReduce cuts DDP's buckets (``first_bucket_bytes``)."""


def size_groups(profile: ModelProfile, cap_bytes: int | None, first_bytes: int = 0
                ) -> list[int]:
    """Group index per parameter (registration order): parameters in reverse registration
    order (the order their gradients are ready) fill groups until one holds ``cap_bytes``
    (None: no limit), the first group until it holds ``first_bytes`` where that is given,
    as DDP fills its buckets; groups numbered in registration order."""
    cuts: list[int] = []  # group count from the end, per parameter in reverse order
    held, count = 0, 0
    for p in reversed(profile.params):
        limit = first_bytes if count == 0 and first_bytes else cap_bytes
        if limit is not None and held >= limit:
            count, held = count + 1, 0
        cuts.append(count)
        held += p.bytes
    return [count - c for c in reversed(cuts)]


@register("AllReduce")
@dataclass(frozen=True)
class AllReduce:
    """Every parameter all-reduced; parameter index // chunk_size gives its fused group.

    ``engine``: ``stratagem`` (this runtime's reducer) or ``ddp`` (torch's DDP reducer, one
    bucket per group; whole dense parameters only). ``chunk_size`` not given: 128
    parameters a group on ``stratagem``; on ``ddp``, groups of DDP's own bucket size
    (:data:`DDP_BUCKET_BYTES`, filled in reverse registration order as DDP does).
    ``bucket_bytes``: groups of that many bytes instead, filled the same way (DDP's
    ``bucket_cap_mb``; not with ``chunk_size``). ``first_bucket_bytes``: the first group
    in that order closes at this size instead (DDP's first bucket); not given, DDP's
    1 MiB where groups are cut in bytes on the ddp engine (the plain-DDP layout), none
    otherwise; 0: none (the first group is as big as the others)."""

    chunk_size: int | None = None
    all_reduce_spec: str = "auto"
    compressor: str = "none"
    powersgd_rank: int = 1
    engine: str = "stratagem"
    bucket_bytes: int | None = None
    first_bucket_bytes: int | None = None

    def __post_init__(self) -> None:
        _check_common(CHUNK_SIZE if self.chunk_size is None else self.chunk_size,
                      self.compressor, self.all_reduce_spec)
        if self.bucket_bytes is not None and (
                not isinstance(self.bucket_bytes, int) or isinstance(self.bucket_bytes, bool)
                or self.bucket_bytes < 1 or self.chunk_size is not None):
            raise StrategyError(
                f"bucket_bytes must be an integer >= 1 and not given with chunk_size, got "
                f"bucket_bytes={self.bucket_bytes!r}, chunk_size={self.chunk_size!r}",
                fix="give either bucket_bytes (bytes a group, e.g. 2**20) or chunk_size "
                    "(parameters a group)")
        if self.engine not in ENGINES:
            raise StrategyError(f"unknown engine {self.engine!r}",
                                fix=f"use one of {', '.join(ENGINES)}")
        first = self.first_bucket_bytes
        if first is not None and (not isinstance(first, int) or isinstance(first, bool)
                                  or first < 0 or (first and self.chunk_size is not None)):
            raise StrategyError(
                f"first_bucket_bytes must be an integer >= 0 and not given with chunk_size, "
                f"got first_bucket_bytes={first!r}, chunk_size={self.chunk_size!r}",
                fix="give first_bucket_bytes (e.g. 2**20, DDP's first bucket; 0 for none) "
                    "with groups cut in bytes (bucket_bytes, or the ddp engine's default)")

    def sync(self, index: int, group: int | None = None) -> AllReduceSynchronizer:
        """The synchronizer of parameter ``index`` (group ``index // chunk_size`` unless
        ``group`` is given)."""
        if group is None:
            group = index // (CHUNK_SIZE if self.chunk_size is None else self.chunk_size)
        return AllReduceSynchronizer(spec=self.all_reduce_spec, compressor=self.compressor,
                                     group=group, powersgd_rank=self.powersgd_rank,
                                     engine=self.engine)

    def build(self, profile: ModelProfile, spec: ResourceSpec) -> Strategy:
        cap = self.bucket_bytes or (DDP_BUCKET_BYTES if self.chunk_size is None
                                    and self.engine == "ddp" else None)
        first = self.first_bucket_bytes
        if first is None:
            first = DDP_FIRST_BUCKET_BYTES if cap and self.engine == "ddp" else 0
        groups = (size_groups(profile, cap, first) if cap or first
                  else [None] * len(profile.params))
        nodes = tuple(NodeConfig(var_name=p.name, synchronizer=self.sync(i, groups[i]))
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

"""ZeRO: every parameter sharded across the workers at one stage (docs/concepts/sharding.md).

At stage 3 the unit of sharding is chosen from the parameter names: the shortest prefix
that ends in an item of a module list (``blocks.0`` for ``blocks.0.attn.weight``: one
transformer block), else the top-level module (``emb`` for ``emb.weight``). A parameter of
the root module itself (no dot in its name) cannot be a stage-3 unit without taking the
whole model with it, so it is sharded at stage 2.
"""

from __future__ import annotations

from dataclasses import dataclass

from stratagem.analysis.profile import ModelProfile
from stratagem.errors import StrategyError
from stratagem.resource import ResourceSpec
from stratagem.strategy.builders.base import register
from stratagem.strategy.schema import (
    MAX_PREFETCH,
    SHARD_STAGES,
    GraphConfig,
    NodeConfig,
    ShardedSynchronizer,
    Strategy,
)


def block_unit(name: str) -> str | None:
    """The stage-3 unit :class:`ZeRO` gives parameter ``name`` (None: a root parameter)."""
    parts = name.split(".")[:-1]
    if not parts:
        return None
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return parts[0]


@register("ZeRO")
@dataclass(frozen=True)
class ZeRO:
    """Every parameter sharded at ``stage`` (1: optimizer state, 2: + gradients, 3: +
    parameters, per block); ``reshard_after_forward`` and ``prefetch`` as in
    :class:`~stratagem.strategy.schema.ShardedSynchronizer`."""

    stage: int = 3
    reshard_after_forward: bool = True
    prefetch: int = 0
    """0: no explicit forward prefetch, FSDP2's own default (its backward still gathers one
    unit ahead). On CPU workers the early all-gather competes with the compute: measured
    2-5% slower per step than FSDP2 used directly (bench/sharding.py)."""

    def __post_init__(self) -> None:
        if self.stage not in SHARD_STAGES:
            raise StrategyError(f"unknown sharding stage {self.stage!r}",
                                where="strategy builder ZeRO", fix="use stage 1, 2 or 3")
        if not 0 <= self.prefetch <= MAX_PREFETCH:
            raise StrategyError(f"prefetch {self.prefetch!r} out of range",
                                where="strategy builder ZeRO",
                                fix=f"use 0 to {MAX_PREFETCH} units")

    def sync_for(self, name: str) -> ShardedSynchronizer:
        unit = block_unit(name) if self.stage == 3 else None
        if unit is None:
            return ShardedSynchronizer(stage=min(self.stage, 2))
        return ShardedSynchronizer(stage=3, unit=unit,
                                   reshard_after_forward=self.reshard_after_forward,
                                   prefetch=self.prefetch)

    def build(self, profile: ModelProfile, spec: ResourceSpec) -> Strategy:
        if any(p.sparse for p in profile.params):
            sparse = next(p.name for p in profile.params if p.sparse)
            raise StrategyError(f"{sparse!r} has a sparse gradient, which is not sharded",
                                where="strategy builder ZeRO",
                                fix="use Auto or AllReduce for models with sparse embeddings")
        syncs = {p.name: self.sync_for(p.name) for p in profile.params}
        units = {s.unit for s in syncs.values() if s.stage == 3}
        # Stage 2 instead for a unit that would take in another unit (``blocks`` around
        # ``blocks.0``), and for the units of a tied parameter whose names lie in two.
        demoted = {u for u in units if any(v.startswith(u + ".") for v in units)}
        for p in profile.params:
            names_units = {block_unit(n) for n in (p.name, *p.aliases)}
            if len(names_units) > 1:
                demoted |= {u for u in names_units if u is not None}
        nodes = []
        for p in profile.params:
            sync = syncs[p.name]
            if sync.stage == 3 and sync.unit in demoted:
                sync = ShardedSynchronizer(stage=2)
            nodes.append(NodeConfig(var_name=p.name, synchronizer=sync))
        return Strategy(node_config=tuple(nodes),
                        graph_config=GraphConfig(tuple(spec.replicas)),
                        builder=f"ZeRO-{self.stage}")

"""Sharded synchronizers (ZeRO 1-3) in the schema, the ZeRO builder and validation."""

from __future__ import annotations

import pytest
from torch import nn

from stratagem.analysis import analyze
from stratagem.errors import StrategyError
from stratagem.resource import ResourceSpec
from stratagem.strategy import (
    AllReduceSynchronizer,
    NodeConfig,
    ShardedSynchronizer,
    Strategy,
    validate,
)
from stratagem.strategy.builders import ZeRO
from stratagem.strategy.builders.sharded import block_unit


class Tiny(nn.Module):
    """Embedding, two blocks in a list, a head: the shape of a small transformer."""

    def __init__(self, tied: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
                                    for _ in range(2))
        self.head = nn.Linear(4, 10)
        if tied:
            self.head.weight = self.emb.weight


SPEC = ResourceSpec.from_dict({"nodes": [{"address": "127.0.0.1", "workers": 2}]})


def strategy(**syncs: object) -> Strategy:
    names = analyze(Tiny()).names
    default = ShardedSynchronizer(stage=3, unit="blocks.0")
    return Strategy(node_config=tuple(
        NodeConfig(var_name=n, synchronizer=syncs.get(n.replace(".", "_"),
                                                        default if n.startswith("blocks.0.")
                                                        else AllReduceSynchronizer()))
        for n in names))


def test_round_trip_yaml_and_json(tmp_path) -> None:
    s = ZeRO(stage=3, prefetch=2, reshard_after_forward=False).build(analyze(Tiny()), SPEC)
    for suffix in (".json", ".yaml"):
        back = Strategy.load(s.save(tmp_path / f"s{suffix}"))
        assert back.to_dict() == s.to_dict()
    sync = back.config_for("blocks.1.0.weight").synchronizer
    assert sync == ShardedSynchronizer(stage=3, unit="blocks.1", reshard_after_forward=False,
                                       prefetch=2)
    assert "Sharded(stage=3, unit=blocks.1" in back.summary()


def test_zero_builder_units() -> None:
    assert block_unit("blocks.0.1.weight") == "blocks.0"
    assert block_unit("emb.weight") == "emb"
    assert block_unit("scale") is None
    s = ZeRO(stage=3).build(analyze(Tiny()), SPEC)
    assert validate(s, analyze(Tiny()), SPEC) is not None
    assert {nc.synchronizer.unit for nc in s.node_config} == {"emb", "blocks.0", "blocks.1",
                                                              "head"}
    tied = ZeRO(stage=3).build(analyze(Tiny(tied=True)), SPEC)  # emb/head tied: stage 2
    validate(tied, analyze(Tiny(tied=True)), SPEC)
    assert tied.config_for("emb.weight").synchronizer.stage == 2
    assert tied.config_for("head.bias").synchronizer.stage == 2
    for stage in (1, 2):
        s = ZeRO(stage=stage).build(analyze(Tiny()), SPEC)
        validate(s, analyze(Tiny()), SPEC)
        assert {nc.synchronizer.stage for nc in s.node_config} == {stage}


def test_mixed_with_all_reduce_validates() -> None:
    s = strategy(head_weight=ShardedSynchronizer(stage=1),
                 emb_weight=ShardedSynchronizer(stage=2))
    assert validate(s, analyze(Tiny()), SPEC).sharded_parameters == [
        "blocks.0.0.bias", "blocks.0.0.weight", "blocks.0.1.bias", "blocks.0.1.weight",
        "emb.weight", "head.weight"]


def test_parameter_in_a_unit_owned_by_another_synchronizer_is_refused() -> None:
    s = strategy(blocks_0_1_bias=AllReduceSynchronizer())
    with pytest.raises(StrategyError, match=r"'blocks\.0\.1\.bias' is inside the sharded "
                                            r"unit 'blocks\.0'.*AllReduce") as err:
        validate(s, analyze(Tiny()), SPEC)
    assert "blocks.0.1.bias" in err.value.where


@pytest.mark.parametrize("sync, match", [
    (ShardedSynchronizer(stage=3, unit="blocks.0", prefetch=0), "prefetch=0"),
    (ShardedSynchronizer(stage=2), "stage 2"),
    (ShardedSynchronizer(stage=3, unit="blocks"), "unit 'blocks'"),  # nested units
])
def test_inconsistent_units_are_refused(sync: ShardedSynchronizer, match: str) -> None:
    with pytest.raises(StrategyError, match=match):
        validate(strategy(blocks_0_1_bias=sync), analyze(Tiny()), SPEC)


def test_tied_parameter_across_units_is_refused() -> None:
    names = analyze(Tiny(tied=True)).names
    s = Strategy(node_config=tuple(
        NodeConfig(var_name=n, synchronizer=ShardedSynchronizer(stage=3, unit="emb")
                   if n == "emb.weight" else AllReduceSynchronizer()) for n in names))
    with pytest.raises(StrategyError, match="tied"):
        validate(s, analyze(Tiny(tied=True)), SPEC)


@pytest.mark.parametrize("field, value, match", [
    ("stage", 4, "too large"), ("stage", 0, "unknown sharding stage"),
    ("prefetch", -1, "prefetch -1"), ("unit", "head", "does not contain"),
    ("stage", "3", "expected int"),
])
def test_bad_fields_are_refused(field: str, value: object, match: str) -> None:
    d = strategy().to_dict()
    d["node_config"][1]["synchronizer"] = {"type": "Sharded", "stage": 3, "unit": "blocks.0",
                                           field: value}
    d["node_config"][1]["var_name"] = "blocks.0.0.weight"
    with pytest.raises(StrategyError, match=match):
        validate(Strategy.from_dict(d), analyze(Tiny()), SPEC)


def test_unit_at_stage_one_and_parts_are_refused() -> None:
    with pytest.raises(StrategyError, match="units apply to stage 3"):
        validate(strategy(head_weight=ShardedSynchronizer(stage=1, unit="head")),
                 analyze(Tiny()), SPEC)
    d = strategy().to_dict()
    d["node_config"][-2] = {"var_name": "head.weight", "partitioner": "2,1", "part_config": [
        {"var_name": f"head.weight/part_{i}", "synchronizer": {"type": "Sharded"}}
        for i in range(2)]}
    with pytest.raises(StrategyError, match="a part of 'head.weight'"):
        validate(Strategy.from_dict(d), analyze(Tiny()), SPEC)

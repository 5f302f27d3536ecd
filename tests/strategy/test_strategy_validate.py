"""validate(): a strategy must fit the model profile and the resource spec."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from torch import nn

from stratagem.analysis import ModelProfile, analyze
from stratagem.errors import StrategyError
from stratagem.resource import ResourceSpec
from stratagem.strategy import (
    AllReduce,
    AllReduceSynchronizer,
    NodeConfig,
    PartitionedAR,
    PSSynchronizer,
    RandomAxisPartitionAR,
    Strategy,
    validate,
)
from stratagem.strategy.validate import server_devices

ROOT = Path(__file__).resolve().parents[2]
MIXED = ROOT / "examples" / "strategies" / "mlp-mixed.yaml"


@pytest.fixture(scope="module")
def example() -> dict[str, Any]:
    return Strategy.load(MIXED).to_dict()


def check(d: dict[str, Any], profile: ModelProfile, spec: ResourceSpec) -> Strategy:
    return validate(Strategy.from_dict(d), profile, spec)


# ---------------------------------------------------------------------------- valid
def test_example_strategy_validates(example: dict, mlp_profile: ModelProfile,
                                    two_node: ResourceSpec) -> None:
    s = Strategy.from_dict(example)
    assert validate(s, mlp_profile, two_node) is s


@pytest.mark.parametrize("builder", [AllReduce(), AllReduce(compressor="bf16", chunk_size=2),
                                     PartitionedAR(), RandomAxisPartitionAR(seed=1)])
@pytest.mark.parametrize("spec", ["two_node", "gpu_cluster", "local3"])
def test_builder_output_validates(builder: Any, spec: str, zoo_profile: ModelProfile,
                                  request: pytest.FixtureRequest) -> None:
    resources = request.getfixturevalue(spec)
    s = builder.build(zoo_profile, resources)
    assert validate(s, zoo_profile, resources) is s


def test_powersgd_builder_validates_on_dense_model(dense_profile: ModelProfile,
                                                   local3: ResourceSpec) -> None:
    s = AllReduce(compressor="powersgd", powersgd_rank=2).build(dense_profile, local3)
    validate(s, dense_profile, local3)


def test_empty_replicas_are_filled_from_spec(example: dict, mlp_profile: ModelProfile,
                                             two_node: ResourceSpec) -> None:
    d = copy.deepcopy(example)
    d["graph_config"]["replicas"] = []
    s = Strategy.from_dict(d)
    out = validate(s, mlp_profile, two_node)
    assert list(out.graph_config.replicas) == two_node.replicas
    assert out.node_config == s.node_config
    assert out.id == Strategy.from_dict(out.to_dict()).id != s.id  # the replicas are content
    assert s.graph_config.replicas == ()  # the input is not modified


def test_alias_of_tied_parameter_is_accepted(local3: ResourceSpec) -> None:
    profile = analyze(Tied())
    s = Strategy(node_config=(NodeConfig("head.weight", AllReduceSynchronizer()),))
    validate(s, profile, local3)


def test_dedicated_server_destination(zoo_profile: ModelProfile,
                                      gpu_cluster: ResourceSpec) -> None:
    assert server_devices(gpu_cluster) == ["10.0.0.3:PS:0"]
    s = AllReduce().build(zoo_profile, gpu_cluster)
    nodes = (NodeConfig("prime", PSSynchronizer("10.0.0.3:PS:0")),
             NodeConfig("scale", PSSynchronizer("10.0.0.2:GPU:3", sync=False)),
             *s.node_config[2:])
    validate(Strategy(nodes, s.graph_config), zoo_profile, gpu_cluster)


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight


# ------------------------------------------------------------------- invalid: mlp example
Mutation = Callable[[dict], None]


def nodes(d: dict) -> list[dict]:
    return d["node_config"]


def part(d: dict, i: int) -> dict:
    return nodes(d)[0]["part_config"][i]


def sync(d: dict, name: str) -> dict:
    return next(n for n in nodes(d) if n["var_name"] == name)["synchronizer"]


BAD: dict[str, tuple[Mutation, str, str]] = {
    "unknown-parameter": (
        lambda d: nodes(d)[1].update(var_name="0.bais"),
        "unknown parameter '0.bais'", "did you mean '0.bias'?"),
    "missing-parameter": (
        lambda d: nodes(d).pop(3),
        "parameter '2.bias' has no config", "add a node_config entry"),
    "duplicate-entry": (
        lambda d: nodes(d).append(copy.deepcopy(nodes(d)[1])),
        "parameter '0.bias' is configured twice", "keep one entry per parameter"),
    "axis-count-mismatch": (
        lambda d: nodes(d)[0].update(partitioner="2"),
        "partitioner 2 has 1 axes but the parameter has shape [64, 32]",
        "one split count per axis"),
    "more-parts-than-rows": (
        lambda d: nodes(d)[3].update(
            synchronizer=None, partitioner="11",
            part_config=[{"var_name": f"2.bias/part_{i}", "synchronizer": {
                "type": "AllReduce"}} for i in range(11)]),
        "cannot split axis 0 of size 10 into 11 parts", "use at most 10 parts"),
    "part-sizes-sum": (
        lambda d: nodes(d)[0].update(part_sizes=[40, 20]),
        "part_sizes [40, 20] must be 2 positive lengths summing to 64", "fix part_sizes"),
    "part-sizes-zero": (
        lambda d: nodes(d)[0].update(part_sizes=[64, 0]),
        "part_sizes [64, 0] must be 2 positive lengths summing to 64", "fix part_sizes"),
    "part-sizes-count": (
        lambda d: nodes(d)[0].update(part_sizes=[30, 20, 14]),
        "part_sizes [30, 20, 14] must be 2 positive lengths", "fix part_sizes"),
    "part-config-count": (
        lambda d: nodes(d)[0]["part_config"].pop(),
        "2 parts but 1 part_config entries", "one config per part"),
    "part-misnamed": (
        lambda d: part(d, 1).update(var_name="0.weight/part_7"),
        "part 1 is named '0.weight/part_7'", "name it 0.weight/part_1"),
    "parts-swapped": (
        lambda d: nodes(d)[0]["part_config"].reverse(),
        "part 0 is named '0.weight/part_1'", "name it 0.weight/part_0"),
    "nested-partition": (
        lambda d: part(d, 0).update(synchronizer=None, partitioner="1,2", part_config=[
            {"var_name": f"0.weight/part_0/part_{i}", "synchronizer": {"type": "AllReduce"}}
            for i in range(2)]),
        "nested partitioning", "partition the parameter once"),
    "partitioned-with-own-sync": (
        lambda d: nodes(d)[0].update(synchronizer={"type": "AllReduce"}),
        "a partitioned parameter has a synchronizer of its own", "put the synchronizers in "
        "part_config"),
    "unknown-compressor": (
        lambda d: sync(d, "0.bias").update(compressor="zstd"),
        "unknown compressor 'zstd'", "use one of none, fp16, bf16, powersgd"),
    "unknown-spec": (
        lambda d: sync(d, "2.bias").update(spec="mpi"),
        "unknown all-reduce spec 'mpi'", "use one of auto, nccl, gloo"),
    "negative-group": (
        lambda d: sync(d, "0.bias").update(group=-1),
        "negative group -1", "group >= 0"),
    "powersgd-rank-zero": (
        lambda d: sync(d, "0.bias").update(compressor="powersgd", powersgd_rank=0),
        "powersgd_rank must be >= 1, got 0", "small positive rank"),
    "unknown-ps-destination": (
        lambda d: sync(d, "2.weight").update(reduction_destination="192.168.1.12:CPU:0"),
        "unknown reduction_destination '192.168.1.12:CPU:0'",
        "'192.168.1.10:CPU:0', '192.168.1.10:CPU:1', '192.168.1.11:CPU:0'"),
    "ps-destination-not-a-server": (
        lambda d: part(d, 1)["synchronizer"].update(reduction_destination="192.168.1.10:PS:0"),
        "unknown reduction_destination '192.168.1.10:PS:0'", "worker replica or server"),
    "ps-destination-empty": (
        lambda d: sync(d, "2.weight").update(reduction_destination=""),
        "unknown reduction_destination ''", "worker replica or server"),
    "negative-staleness": (
        lambda d: sync(d, "2.weight").update(staleness=-1),
        "negative staleness -1", "use 0 for bulk-synchronous"),
    "async-with-staleness": (
        lambda d: sync(d, "2.weight").update(sync=False, staleness=3),
        "staleness applies only to synchronous PS", "staleness: 0"),
    "replicas-reordered": (
        lambda d: d["graph_config"]["replicas"].reverse(),
        "do not match the resource spec's workers", "rebuild the strategy"),
    "replicas-fewer": (
        lambda d: d["graph_config"]["replicas"].pop(),
        "do not match the resource spec's workers", "empty graph_config.replicas"),
    "replicas-other-cluster": (
        lambda d: d["graph_config"].update(replicas=["127.0.0.1:CPU:0"]),
        "graph_config.replicas ['127.0.0.1:CPU:0'] do not match", "rebuild"),
}


@pytest.mark.parametrize(("mutate", "problem", "fix"), BAD.values(), ids=BAD.keys())
def test_validation_errors(example: dict, mlp_profile: ModelProfile, two_node: ResourceSpec,
                           mutate: Mutation, problem: str, fix: str) -> None:
    d = copy.deepcopy(example)
    mutate(d)
    with pytest.raises(StrategyError) as err:
        check(d, mlp_profile, two_node)
    msg = str(err.value)
    assert problem in err.value.problem, msg
    assert err.value.where, msg  # names the strategy or the node_config entry
    assert fix in (err.value.fix or ""), msg
    assert msg.count("fix:") == 1


@pytest.mark.parametrize(
    ("name", "where"),
    [("0.weight", "node_config[0.weight]"), ("0.bias", "node_config[0.bias]")],
)
def test_node_errors_name_the_parameter(example: dict, mlp_profile: ModelProfile,
                                        two_node: ResourceSpec, name: str, where: str) -> None:
    d = copy.deepcopy(example)
    target = next(n for n in nodes(d) if n["var_name"] == name)
    for leaf in target.get("part_config", [target]):
        leaf["synchronizer"] = {"type": "AllReduce", "compressor": "zip"}
    with pytest.raises(StrategyError) as err:
        check(d, mlp_profile, two_node)
    assert err.value.where is not None and err.value.where.startswith(where)


def test_frozen_parameter_is_unknown(local3: ResourceSpec) -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    model[0].requires_grad_(False)
    profile = analyze(model)
    s = AllReduce().build(analyze(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))), local3)
    with pytest.raises(StrategyError, match="unknown parameter '0.weight'") as err:
        validate(s, profile, local3)
    assert "trainable ones only" in (err.value.fix or "")


def test_tied_parameter_configured_under_both_names(local3: ResourceSpec) -> None:
    profile = analyze(Tied())
    s = Strategy(node_config=(
        NodeConfig("emb.weight", AllReduceSynchronizer()),
        NodeConfig("head.weight", PSSynchronizer("127.0.0.1:CPU:0")),
    ))
    with pytest.raises(StrategyError, match="configured twice .*emb.weight and head.weight"):
        validate(s, profile, local3)


def test_powersgd_on_sparse_embedding(zoo_profile: ModelProfile, local3: ResourceSpec) -> None:
    s = AllReduce(compressor="powersgd").build(zoo_profile, local3)
    with pytest.raises(StrategyError, match="powersgd cannot compress a sparse") as err:
        validate(s, zoo_profile, local3)
    assert err.value.where == "node_config[emb.weight]"


def test_part_config_without_partitioner_built_in_python(mlp_profile: ModelProfile,
                                                         two_node: ResourceSpec) -> None:
    s = Strategy.load(MIXED)
    bias = s.config_for("0.bias")
    broken = NodeConfig("0.bias", bias.synchronizer, part_config=(bias,))
    s = Strategy(tuple(broken if n.var_name == "0.bias" else n for n in s.node_config),
                 s.graph_config)
    with pytest.raises(StrategyError, match="part_config without a partitioner"):
        validate(s, mlp_profile, two_node)


@pytest.mark.parametrize(("name", "sync", "problem"), [
    ("2.weight", PSSynchronizer("192.168.1.10:CPU:1", staleness=10**30),
     "staleness 1000000000000000000000000000000 is too large"),
    ("2.bias", AllReduceSynchronizer(group=10**12), "group 1000000000000 or powersgd_rank 1"),
])
def test_bounds_hold_for_strategies_built_in_python(
        example: dict, mlp_profile: ModelProfile, two_node: ResourceSpec, name: str,
        sync: PSSynchronizer | AllReduceSynchronizer, problem: str) -> None:
    """A builder's Strategy never went through the file parser's bounds: validate checks."""
    s = Strategy.from_dict(example)
    s = Strategy(tuple(NodeConfig(name, sync) if n.var_name == name else n
                       for n in s.node_config), s.graph_config)
    with pytest.raises(StrategyError, match=problem) as err:
        validate(s, mlp_profile, two_node)
    assert "at most" in (err.value.fix or "") or "up to" in (err.value.fix or "")

"""Strategy schema: lossless JSON/YAML round trips, version check, strict parsing."""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml

from stratagem.analysis import ModelProfile
from stratagem.errors import StrategyError
from stratagem.resource import ResourceSpec
from stratagem.strategy import (
    SCHEMA_VERSION,
    AllReduce,
    AllReduceSynchronizer,
    GraphConfig,
    NodeConfig,
    PartitionedAR,
    Partitioner,
    PSSynchronizer,
    RandomAxisPartitionAR,
    Strategy,
    StrategyBuilder,
)
from stratagem.strategy.compressors import compressor_names
from stratagem.strategy.diff import differences
from stratagem.strategy.schema import content_id

MIXED = Path(__file__).resolve().parents[2] / "examples" / "strategies" / "mlp-mixed.yaml"

BUILDERS = {
    **{f"AllReduce-{c}": AllReduce(compressor=c) for c in compressor_names()},
    "AllReduce-chunk2-gloo": AllReduce(chunk_size=2, all_reduce_spec="gloo"),
    "AllReduce-powersgd-rank4": AllReduce(compressor="powersgd", powersgd_rank=4),
    "AllReduce-fp16-rank4": AllReduce(compressor="fp16", powersgd_rank=4),
    "PartitionedAR": PartitionedAR(),
    "PartitionedAR-bf16-chunk3": PartitionedAR(chunk_size=3, compressor="bf16"),
    "RandomAxisPartitionAR": RandomAxisPartitionAR(),
    "RandomAxisPartitionAR-seed7-nccl": RandomAxisPartitionAR(seed=7, all_reduce_spec="nccl"),
}


def mixed() -> Strategy:
    """Hand-written: PS (colocated, server, async, stale) and AllReduce, uneven parts."""
    ps = PSSynchronizer
    return Strategy(
        node_config=(
            NodeConfig("scale", AllReduceSynchronizer(spec="gloo", group=3)),
            NodeConfig("prime", partitioner=Partitioner((3, 1), sizes=(6, 4, 3)), part_config=(
                NodeConfig("prime/part_0", ps("10.0.0.3:PS:0")),
                NodeConfig("prime/part_1", ps("10.0.0.1:GPU:0", local_replication=True)),
                NodeConfig("prime/part_2", AllReduceSynchronizer(compressor="powersgd",
                                                                 powersgd_rank=2)),
            )),
            NodeConfig("emb.weight", ps("10.0.0.3:PS:0", sync=False)),
            NodeConfig("conv.weight", partitioner=Partitioner((1, 3, 1, 1)), part_config=tuple(
                NodeConfig(f"conv.weight/part_{i}", AllReduceSynchronizer(group=i))
                for i in range(3))),
            NodeConfig("conv.bias", ps("10.0.0.2:GPU:3", staleness=4)),
            *(NodeConfig(n, AllReduceSynchronizer(compressor="bf16", group=9))
              for n in ("lin.weight", "lin.bias", "one.weight", "one.bias")),
        ),
        graph_config=GraphConfig(("10.0.0.1:GPU:0", "10.0.0.2:GPU:0")),
        builder="hand-written",
    )


def strategies(profile: ModelProfile, spec: ResourceSpec) -> dict[str, Strategy]:
    out = {k: b.build(profile, spec) for k, b in BUILDERS.items()}
    out["mixed"] = mixed()
    out["example"] = Strategy.load(MIXED)
    return out


CASES = [*BUILDERS, "mixed", "example"]


@pytest.fixture(scope="module")
def built(zoo_profile: ModelProfile, gpu_cluster: ResourceSpec) -> dict[str, Strategy]:
    return strategies(zoo_profile, gpu_cluster)


# ------------------------------------------------------------------------ round trips
@pytest.mark.parametrize("case", CASES)
def test_json_round_trip_is_lossless(built: dict[str, Strategy], case: str) -> None:
    s = built[case]
    text = s.to_json()
    back = Strategy.from_dict(json.loads(text))
    assert back == s
    assert back.to_json() == text


@pytest.mark.parametrize("case", CASES)
def test_yaml_round_trip_is_lossless(built: dict[str, Strategy], case: str) -> None:
    s = built[case]
    text = s.to_yaml()
    back = Strategy.from_dict(yaml.safe_load(text))
    assert back == s
    assert back.to_yaml() == text


@pytest.mark.parametrize("suffix", [".json", ".yaml", ".yml"])
@pytest.mark.parametrize("case", ["mixed", "PartitionedAR", "AllReduce-powersgd"])
def test_save_load(built: dict[str, Strategy], tmp_path: Path, case: str, suffix: str
                   ) -> None:
    s = built[case]
    path = s.save(tmp_path / f"s{suffix}")
    text = path.read_text()
    if suffix == ".json":
        assert json.loads(text) == s.to_dict()
    else:
        assert text == s.to_yaml()
    assert Strategy.load(path) == s


def test_to_dict_layout() -> None:
    d = mixed().to_dict()
    assert list(d) == ["version", "id", "builder", "graph_config", "node_config"]
    assert d["version"] == SCHEMA_VERSION == 1
    assert d["graph_config"] == {"replicas": ["10.0.0.1:GPU:0", "10.0.0.2:GPU:0"]}
    assert d["node_config"][0] == {"var_name": "scale", "synchronizer": {
        "type": "AllReduce", "spec": "gloo", "compressor": "none", "group": 3}}
    prime = d["node_config"][1]
    assert prime["partitioner"] == "3,1" and prime["part_sizes"] == [6, 4, 3]
    assert prime["part_config"][0] == {"var_name": "prime/part_0", "synchronizer": {
        "type": "PS", "reduction_destination": "10.0.0.3:PS:0", "local_replication": False,
        "sync": True, "staleness": 0}}
    assert prime["part_config"][2]["synchronizer"]["powersgd_rank"] == 2
    assert "synchronizer" not in prime
    assert "part_sizes" not in d["node_config"][3]  # even split: no sizes written


def test_example_file_matches_its_comments() -> None:
    s = Strategy.load(MIXED)
    assert (s.builder, s.version) == ("manual", 1)
    written = yaml.safe_load(MIXED.read_text())["id"]
    assert s.id == content_id(s) == written  # the file's id is the hash of what it says
    w = s.config_for("0.weight")
    assert w.partitioner == Partitioner((2, 1), sizes=(40, 24))
    assert [p.var_name for p in w.leaves()] == ["0.weight/part_0", "0.weight/part_1"]
    assert [p.synchronizer for p in w.leaves()] == [
        PSSynchronizer("192.168.1.10:CPU:0", staleness=1),
        PSSynchronizer("192.168.1.11:CPU:0", staleness=1)]
    assert s.config_for("0.bias").synchronizer == AllReduceSynchronizer(compressor="fp16",
                                                                        group=1)
    assert s.config_for("2.weight").synchronizer == PSSynchronizer(
        "192.168.1.10:CPU:1", sync=True, staleness=1)
    assert s.config_for("2.bias").synchronizer == AllReduceSynchronizer()


def test_minimal_hand_written_strategy_gets_defaults() -> None:
    s = Strategy.from_dict({"node_config": [{"var_name": "w", "synchronizer": {
        "type": "AllReduce"}}, {"var_name": "b", "synchronizer": {"type": "PS"}}]})
    assert s.version == SCHEMA_VERSION and s.builder == "manual" and len(s.id) == 12
    assert s.graph_config.replicas == ()
    assert s.config_for("w").synchronizer == AllReduceSynchronizer("auto", "none", 0, 1)
    assert s.config_for("b").synchronizer == PSSynchronizer("", False, True, 0)


def test_the_id_is_a_hash_of_the_content(zoo_profile: ModelProfile,
                                         local3: ResourceSpec) -> None:
    """Issue 49: the same plan has the same id in every run (it was a random uuid), and any
    change of the plan changes it; the builder's name is a label, not content."""
    a, b = (AllReduce(chunk_size=2).build(zoo_profile, local3) for _ in range(2))
    assert a.id == b.id and len(a.id) == 12 and int(a.id, 16) >= 0
    assert Strategy.from_dict(a.to_dict()).id == a.id
    assert replace(a, builder="renamed").id == a.id
    assert replace(a, graph_config=GraphConfig(("x:CPU:0",))).id != a.id
    first = a.node_config[0]
    edited = replace(a, node_config=(replace(first, synchronizer=AllReduceSynchronizer(
        group=first.synchronizer.group, compressor="fp16")), *a.node_config[1:]))
    assert edited.id != a.id


def test_an_old_file_with_a_random_id_still_loads() -> None:
    """Files written before ids were hashes carry a uuid: it is read, and the id becomes
    the content's hash."""
    data = {"version": 1, "id": "7a13d82db2ae", "builder": "AllReduce",
            "node_config": [{"var_name": "w", "synchronizer": {"type": "AllReduce"}}]}
    s = Strategy.from_dict(data)
    assert s.id == content_id(s) != "7a13d82db2ae"
    assert s.config_for("w").synchronizer == AllReduceSynchronizer()


def test_differences_name_what_changed(zoo_profile: ModelProfile, local3: ResourceSpec
                                       ) -> None:
    a = AllReduce(chunk_size=2).build(zoo_profile, local3)
    assert differences(a, Strategy.from_dict(a.to_dict())) == []
    name = a.node_config[0].var_name
    b = replace(a, node_config=(NodeConfig(name, PSSynchronizer("h:CPU:0")),
                                *a.node_config[1:]))
    (line,) = differences(a, b)
    assert line.startswith(f"{name}: AllReduce(") and line.endswith("-> PS(dest=h:CPU:0, "
                                                                   "staleness=0)")
    c = replace(b, graph_config=GraphConfig(("h:CPU:0",)))
    assert differences(a, c)[0] == f"replicas: {len(local3.replicas)} -> 1"


# ----------------------------------------------------------------------------- helpers
def test_strategy_is_its_own_builder(zoo_profile: ModelProfile, local3: ResourceSpec
                                     ) -> None:
    s = mixed()
    assert isinstance(s, StrategyBuilder)
    assert s.build(zoo_profile, local3) is s and s.name == "hand-written"
    assert s.with_replicas(["a:CPU:0"]).graph_config.replicas == ("a:CPU:0",)
    with pytest.raises(KeyError):
        s.config_for("nope")


def test_leaves() -> None:
    s = mixed()
    assert s.config_for("scale").leaves() == [s.config_for("scale")]
    assert [p.var_name for p in s.config_for("prime").leaves()] == [
        "prime/part_0", "prime/part_1", "prime/part_2"]


def test_summary_lists_every_parameter() -> None:
    lines = mixed().summary().splitlines()
    assert lines[0] == f"strategy {mixed().id} (builder hand-written, 2 replicas)"
    assert lines[1] == "  scale: AllReduce(group=3, compressor=none, spec=gloo)"
    assert lines[2] == ("  prime: partitioned 3,1 -> PS(dest=10.0.0.3:PS:0, staleness=0); "
                        "PS(dest=10.0.0.1:GPU:0, staleness=0, replicated); "
                        "AllReduce(group=0, compressor=powersgd, rank=2)")
    assert lines[3] == "  emb.weight: PS(dest=10.0.0.3:PS:0, async)"
    assert len(lines) == 1 + 9


@pytest.mark.parametrize(
    ("text", "sizes", "shape", "axis", "parts", "lengths"),
    [
        ("4,1", None, (10, 3), 0, 4, [3, 3, 2, 2]),
        ("1,3", None, (2, 7), 1, 3, [3, 2, 2]),
        ("2", [5, 1], (6,), 0, 2, [5, 1]),
        ("1,1", None, (4, 4), 0, 1, [4]),
        (" 2 , 1 ", None, (4, 4), 0, 2, [2, 2]),
    ],
)
def test_partitioner(text: str, sizes: list[int] | None, shape: tuple[int, ...], axis: int,
                     parts: int, lengths: list[int]) -> None:
    p = Partitioner.parse(text, sizes)
    assert (p.axis, p.num_parts, p.part_sizes(shape)) == (axis, parts, lengths)
    assert str(p) == text.replace(" ", "")


# ------------------------------------------------------------------------ version check
@pytest.mark.parametrize("version", [0, 2, "1", None])
def test_unsupported_version(version: Any) -> None:
    d = mixed().to_dict()
    d["version"] = version
    with pytest.raises(StrategyError) as err:
        Strategy.from_dict(d, source="s.json")
    msg = str(err.value)
    assert msg.startswith(f"s.json: version: unsupported schema version {version!r}")
    assert f"this Stratagem reads version {SCHEMA_VERSION}" in msg


def test_missing_version_means_current() -> None:
    d = mixed().to_dict()
    del d["version"]
    assert Strategy.from_dict(d) == mixed()


# ---------------------------------------------------------------------- strict parsing
def _set(path: str, value: Any) -> Any:
    """A mutation of mixed().to_dict(): set the item at a dotted path (ints index lists)."""
    def apply(d: dict) -> None:
        *parents, last = [int(k) if k.isdigit() else k for k in path.split(".")]
        for k in parents:
            d = d[k]
        if value is _DELETE:
            del d[last]
        else:
            d[last] = value
    return apply


_DELETE = object()

BAD = {
    "top-level-unknown": (_set("nodes", []), "(top level).nodes", "unknown field",
                          "allowed fields are version, id, builder"),
    "node-unknown": (_set("node_config.0.sync", True), "node_config[0].sync",
                     "unknown field", "allowed fields are var_name, synchronizer"),
    "sync-unknown": (_set("node_config.0.synchronizer.grp", 1),
                     "node_config[0].synchronizer.grp", "unknown field",
                     "allowed fields are type, spec, compressor, group, powersgd_rank"),
    "ps-field-on-allreduce": (_set("node_config.0.synchronizer.staleness", 1),
                              "node_config[0].synchronizer.staleness", "unknown field",
                              "type, spec"),
    "graph-unknown": (_set("graph_config.devices", []), "graph_config.devices",
                      "unknown field", "allowed fields are replicas"),
    "group-str": (_set("node_config.0.synchronizer.group", "1"),
                  "node_config[0].synchronizer.group", "expected int, got '1'",
                  "write group as a int"),
    "group-bool": (_set("node_config.0.synchronizer.group", True),
                   "node_config[0].synchronizer.group", "expected int, got True", "int"),
    "group-float": (_set("node_config.0.synchronizer.group", 1.5),
                    "node_config[0].synchronizer.group", "expected int, got 1.5", "int"),
    "compressor-int": (_set("node_config.0.synchronizer.compressor", 16),
                       "node_config[0].synchronizer.compressor", "expected str, got 16",
                       "str"),
    "sync-str": (_set("node_config.2.synchronizer.sync", "yes"),
                 "node_config[2].synchronizer.sync", "expected bool, got 'yes'", "bool"),
    "sync-int": (_set("node_config.2.synchronizer.sync", 1),
                 "node_config[2].synchronizer.sync", "expected bool, got 1", "bool"),
    "staleness-float": (_set("node_config.4.synchronizer.staleness", 0.5),
                        "node_config[4].synchronizer.staleness", "expected int", "int"),
    "destination-list": (_set("node_config.2.synchronizer.reduction_destination", ["a"]),
                         "node_config[2].synchronizer.reduction_destination",
                         "expected str", "str"),
    "part-sync-type": (_set("node_config.1.part_config.0.synchronizer.type", "Ring"),
                       "node_config[1].part_config[0].synchronizer.type",
                       "unknown synchronizer type 'Ring'", "use one of AllReduce, PS"),
    "sync-type-missing": (_set("node_config.0.synchronizer.type", _DELETE),
                          "node_config[0].synchronizer.type",
                          "unknown synchronizer type None", "AllReduce, PS"),
    "sync-not-mapping": (_set("node_config.0.synchronizer", "AllReduce"),
                         "node_config[0].synchronizer", "expected a mapping, got str",
                         "strategy-schema.md"),
    "partitioner-two-axes": (_set("node_config.1.partitioner", "2,2"),
                             "node_config[1].partitioner",
                             "more than one axis is split in '2,2'", "split at most one axis"),
    "partitioner-zero": (_set("node_config.1.partitioner", "0,1"),
                         "node_config[1].partitioner",
                         "split counts must be >= 1, got '0,1'", "use 1 for unsplit axes"),
    "partitioner-text": (_set("node_config.1.partitioner", "x"),
                         "node_config[1].partitioner", "cannot parse 'x'", "splits per axis"),
    "partitioner-empty": (_set("node_config.1.partitioner", ""),
                          "node_config[1].partitioner", "cannot parse ''", "splits per axis"),
    "partitioner-list": (_set("node_config.1.partitioner", [3, 1]),
                         "node_config[1].partitioner", "cannot parse [3, 1]",
                         "splits per axis"),
    "part-sizes-str": (_set("node_config.1.part_sizes", "6,4,3"), "node_config[1].part_sizes",
                       "expected a list of integers, got '6,4,3'", "one length per part"),
    "part-sizes-item": (_set("node_config.1.part_sizes", [6, "4", 3]),
                        "node_config[1].part_sizes", "expected a list of integers",
                        "one length per part"),
    "part-sizes-no-partitioner": (_set("node_config.0.part_sizes", [1]),
                                  "node_config[0].part_sizes", "given without a partitioner",
                                  "add a partitioner"),
    "part-config-no-partitioner": (_set("node_config.0.part_config", []),
                                   "node_config[0].part_config",
                                   "given without a partitioner", "add a partitioner"),
    "part-config-not-list": (_set("node_config.1.part_config", {"a": 1}),
                             "node_config[1].part_config", "expected a list",
                             "one config per part"),
    "var-name-missing": (_set("node_config.0.var_name", _DELETE), "node_config[0].var_name",
                         "missing or not a string", "named_parameters()"),
    "var-name-int": (_set("node_config.0.var_name", 3), "node_config[0].var_name",
                     "missing or not a string", "named_parameters()"),
    "no-sync-no-partitioner": (_set("node_config.0.synchronizer", _DELETE), "node_config[0]",
                               "parameter 'scale' has neither a synchronizer nor a "
                               "partitioner", "add a synchronizer"),
    "node-not-mapping": (_set("node_config.0", "scale"), "node_config[0]",
                         "expected a mapping, got str", "strategy-schema.md"),
    "node-config-missing": (_set("node_config", _DELETE), "node_config",
                            "expected a list of per-parameter configs", "one entry per"),
    "node-config-mapping": (_set("node_config", {}), "node_config",
                            "expected a list of per-parameter configs", "one entry per"),
    "replicas-str": (_set("graph_config.replicas", "10.0.0.1:GPU:0"), "graph_config.replicas",
                     "expected a list of device strings", "10.0.0.1:GPU:0"),
    "replicas-items": (_set("graph_config.replicas", [0, 1]), "graph_config.replicas",
                       "expected a list of device strings", "GPU"),
    "graph-not-mapping": (_set("graph_config", ["a"]), "graph_config",
                          "expected a mapping, got list", "strategy-schema.md"),
}


@pytest.mark.parametrize(("mutate", "field", "problem", "fix"), BAD.values(), ids=BAD.keys())
def test_strict_parsing_errors(mutate: Any, field: str, problem: str, fix: str) -> None:
    d = copy.deepcopy(mixed().to_dict())
    Strategy.from_dict(copy.deepcopy(d))  # the unmutated dict is fine
    mutate(d)
    with pytest.raises(StrategyError) as err:
        Strategy.from_dict(d, source="plan.yaml")
    msg = str(err.value)
    head, _, hint = msg.partition("\n  fix: ")
    assert head == f"plan.yaml: {field}: {err.value.problem}", msg
    assert problem in err.value.problem, msg
    assert fix in hint, msg


@pytest.mark.parametrize("data", [[], "text", 3, None])
def test_top_level_must_be_mapping(data: Any) -> None:
    with pytest.raises(StrategyError, match=r"^s: \(top level\): expected a mapping"):
        Strategy.from_dict(data, source="s")


def test_load_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "none.json"
    with pytest.raises(StrategyError) as err:
        Strategy.load(path)
    assert str(err.value).startswith(f"{path}: file not found\n  fix: ")


def test_load_malformed_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text('{"version": 1, "node_config": [')
    with pytest.raises(StrategyError) as err:
        Strategy.load(path)
    assert str(err.value).startswith(f"{path}: malformed YAML")
    assert "fix:" in str(err.value)


def test_load_reports_the_file_and_field(tmp_path: Path) -> None:
    path = tmp_path / "plan.yaml"
    path.write_text("node_config:\n  - var_name: w\n    synchronizer: {type: Ring}\n")
    with pytest.raises(StrategyError, match=rf"^{path}: node_config\[0\]\.synchronizer\.type: "
                       "unknown synchronizer type 'Ring'"):
        Strategy.load(path)


# -- hostile input: bounded values, depth and size -------------------------------------
def _ps(**fields: Any) -> dict[str, Any]:
    return {"node_config": [{"var_name": "w", "synchronizer": {"type": "PS", **fields}}]}


@pytest.mark.parametrize(("fields", "problem"), [
    ({"staleness": 10**30}, "staleness 1000000000000000000000000000000 is too large"),
])
def test_integer_fields_are_bounded(fields: dict[str, Any], problem: str) -> None:
    with pytest.raises(StrategyError, match=problem) as err:
        Strategy.from_dict(_ps(**fields))
    assert "at most 1000000" in (err.value.fix or "")


def test_all_reduce_group_and_rank_are_bounded() -> None:
    for key, value in (("group", 10**7), ("powersgd_rank", 10**5)):
        data = {"node_config": [{"var_name": "w", "synchronizer": {
            "type": "AllReduce", key: value}}]}
        with pytest.raises(StrategyError, match=f"{key} {value} is too large"):
            Strategy.from_dict(data)


def test_deeply_nested_part_config_is_refused_without_recursion() -> None:
    node: dict[str, Any] = {"var_name": "w", "synchronizer": {"type": "AllReduce"}}
    for _ in range(100_000):
        node = {"var_name": "w", "partitioner": "2", "part_config": [node]}
    with pytest.raises(StrategyError, match="nested partitioning"):
        Strategy.from_dict({"node_config": [node]})


@pytest.mark.parametrize("text", ['{"node_config": ' + "[" * 100_000,
                                  "node_config:\n  - " + "{a: " * 100_000])
def test_deeply_nested_file_is_a_strategy_error(tmp_path: Path, text: str) -> None:
    path = tmp_path / "deep.json"
    path.write_text(text)
    with pytest.raises(StrategyError, match="nested deeper than 64 levels") as err:
        Strategy.load(path)
    assert err.value.fix


def test_aliases_are_refused_in_strategy_files(tmp_path: Path) -> None:
    path = tmp_path / "alias.yaml"
    path.write_text("node_config:\n  - &n {var_name: w, synchronizer: {type: AllReduce}}\n"
                    "  - *n\n")
    with pytest.raises(StrategyError, match="alias"):
        Strategy.load(path)

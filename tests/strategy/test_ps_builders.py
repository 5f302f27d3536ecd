"""Parameter-server builders (PS, PSLoadBalancing, PartitionedPS, UnevenPartitionedPS) and
Parallax: placement rules, balance bounds, validation, serialization, the name registry.

Balance bound used throughout: every greedy placer here keeps, on servers of equal capacity,
``max load - min load <= largest piece placed`` (a piece is a whole parameter or one
shard; the proof is one line per placer step, see ``Placer`` in builders/ps.py). Since
``max - mean <= (1 - 1/S) * (max - min)``, that gives
``max / mean <= 1 + (1 - 1/S) * largest piece / mean``. PSLoadBalancing is LPT scheduling,
so it is also checked against the brute-force optimum: ``max <= (4/3 - 1/(3S)) * OPT``.
"""

from __future__ import annotations

import itertools
import json
import random
import re
from collections import Counter
from fractions import Fraction
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn

from stratagem.analysis import ModelProfile, ParamInfo, analyze
from stratagem.errors import StrategyError
from stratagem.resource import ResourceSpec
from stratagem.strategy import (
    PS,
    AllReduceSynchronizer,
    Parallax,
    PartitionedPS,
    PSLoadBalancing,
    PSSynchronizer,
    Strategy,
    UnevenPartitionedPS,
    builder_from_name,
    builder_names,
    validate,
)
from stratagem.strategy.builders.parallax import sparse_access
from stratagem.strategy.builders.ps import ps_capacities, ps_servers

ROOT = Path(__file__).resolve().parents[2]
BUILDERS = {"PS": PS, "PSLoadBalancing": PSLoadBalancing, "PartitionedPS": PartitionedPS,
            "UnevenPartitionedPS": UnevenPartitionedPS, "Parallax": Parallax}
PS_ONLY = [PS, PSLoadBalancing, PartitionedPS, UnevenPartitionedPS]
BALANCED = [PSLoadBalancing, PartitionedPS, UnevenPartitionedPS]


# ------------------------------------------------------------------------------ fixtures
class Net(nn.Module):
    """Dense layers of many sizes, a scalar, a prime row count, a 1-row weight, a sparse
    embedding and an untied dense embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))       # ()         never split
        self.emb = nn.Embedding(100, 16, sparse=True)   # sparse     -> PS in Parallax
        self.table = nn.Embedding(37, 8)                # untied     -> PS in Parallax
        self.prime = nn.Parameter(torch.zeros(13, 4))
        self.conv = nn.Conv2d(3, 9, 3)
        self.l1 = nn.Linear(16, 33)
        self.l2 = nn.Linear(33, 5)
        self.one = nn.Linear(5, 1)                      # (1, 5)     never split


class TiedLM(nn.Module):
    """An embedding tied to the output head: its gradient is dense."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(50, 8)
        self.ids = nn.Embedding(20, 4, sparse=True)
        self.body = nn.Linear(8, 8)
        self.head = nn.Linear(8, 50, bias=False)
        self.head.weight = self.wte.weight


@pytest.fixture(scope="module")
def net() -> ModelProfile:
    return analyze(Net())


@pytest.fixture(scope="module")
def tied() -> ModelProfile:
    return analyze(TiedLM())


def spec_of(*nodes: dict) -> ResourceSpec:
    return ResourceSpec.from_dict({"nodes": list(nodes)})


@pytest.fixture(scope="module")
def colocated() -> ResourceSpec:
    """(a) this machine, two CPU workers, no server node: the workers own the parameters."""
    return spec_of({"address": "127.0.0.1", "workers": 2})


@pytest.fixture(scope="module")
def dedicated() -> ResourceSpec:
    """(b) two worker nodes (two workers each) and two server-only nodes."""
    return spec_of({"address": "10.0.0.1", "chief": True, "workers": 2},
                   {"address": "10.0.0.2", "workers": 2},
                   {"address": "10.0.0.3", "workers": 0},
                   {"address": "10.0.0.4", "workers": 0})


@pytest.fixture(scope="module")
def one_server() -> ResourceSpec:
    return spec_of({"address": "10.0.0.1", "chief": True, "workers": 2},
                   {"address": "10.0.0.9", "workers": 0})


@pytest.fixture(scope="module")
def hetero() -> ResourceSpec:
    """Two server nodes whose links differ 1:3."""
    return spec_of({"address": "10.0.0.1", "chief": True, "workers": 1},
                   {"address": "10.0.0.3", "workers": 0, "network_bandwidth": 10},
                   {"address": "10.0.0.4", "workers": 0, "network_bandwidth": 30})


@pytest.fixture(params=["colocated", "dedicated"])
def spec(request: pytest.FixtureRequest) -> ResourceSpec:
    return request.getfixturevalue(request.param)


def param(name: str, shape: tuple[int, ...], itemsize: int = 4, **kw: object) -> ParamInfo:
    numel = 1
    for n in shape:
        numel *= n
    return ParamInfo(name=name, shape=shape, dtype="float32", numel=numel,
                     bytes=numel * itemsize, **kw)


def profile_of(*params: ParamInfo) -> ModelProfile:
    return ModelProfile(params=tuple(params))


# ------------------------------------------------------------------------------ helpers
def pieces(s: Strategy, profile: ModelProfile) -> list[tuple[str, str, int]]:
    """(parameter, destination, bytes) for every PS-synchronized piece."""
    out = []
    for nc in s.node_config:
        info = profile.get(nc.var_name)
        if nc.partitioner is None:
            if isinstance(nc.synchronizer, PSSynchronizer):
                out.append((nc.var_name, nc.synchronizer.reduction_destination, info.bytes))
            continue
        row = info.bytes // info.shape[0]
        for pc, n in zip(nc.part_config, nc.partitioner.part_sizes(info.shape), strict=True):
            out.append((nc.var_name, pc.synchronizer.reduction_destination, n * row))
    return out


def loads(s: Strategy, profile: ModelProfile, spec: ResourceSpec) -> dict[str, int]:
    total = dict.fromkeys(ps_servers(spec), 0)
    for _, dest, nbytes in pieces(s, profile):
        total[dest] += nbytes
    return total


def assert_balanced(s: Strategy, profile: ModelProfile, spec: ResourceSpec) -> None:
    per = loads(s, profile, spec)
    biggest = max(b for _, _, b in pieces(s, profile))
    assert max(per.values()) - min(per.values()) <= biggest, per
    mean = Fraction(sum(per.values()), len(per))
    assert max(per.values()) <= mean + (1 - Fraction(1, len(per))) * biggest


def body(s: Strategy) -> list[str]:
    return s.summary().splitlines()[1:]


# ------------------------------------------------------------------------------ all builders
@pytest.mark.parametrize("name", list(BUILDERS))
def test_builds_a_valid_strategy(net: ModelProfile, spec: ResourceSpec, name: str) -> None:
    s = BUILDERS[name]().build(net, spec)
    assert validate(s, net, spec) is s
    assert s.builder == name
    assert list(s.graph_config.replicas) == spec.replicas
    assert [nc.var_name for nc in s.node_config] == net.names


@pytest.mark.parametrize("name", list(BUILDERS))
def test_json_and_yaml_round_trip(net: ModelProfile, spec: ResourceSpec, name: str,
                                  tmp_path: Path) -> None:
    s = BUILDERS[name]().build(net, spec)
    assert Strategy.from_dict(json.loads(s.to_json())) == s
    assert Strategy.from_dict(yaml.safe_load(s.to_yaml())) == s
    for suffix in (".json", ".yaml"):
        assert Strategy.load(s.save(tmp_path / f"s{suffix}")) == s


@pytest.mark.parametrize("name", list(BUILDERS))
def test_deterministic(net: ModelProfile, spec: ResourceSpec, name: str) -> None:
    a, b = BUILDERS[name]().build(net, spec), BUILDERS[name]().build(net, spec)
    assert a.node_config == b.node_config
    assert a.to_dict() | {"id": 0} == b.to_dict() | {"id": 0}


@pytest.mark.parametrize("name", list(BUILDERS))
def test_registered_by_name(name: str) -> None:
    assert name in builder_names()
    for spelled in (name, name.lower(), name.upper()):
        built = builder_from_name(spelled)
        assert type(built) is BUILDERS[name]
        assert built == BUILDERS[name]()


@pytest.mark.parametrize("cls", PS_ONLY + [Parallax])
def test_options_reach_every_ps_synchronizer(net: ModelProfile, spec: ResourceSpec,
                                             cls: type) -> None:
    for kw in ({"local_proxy_variable": True, "sync": True, "staleness": 3},
               {"local_proxy_variable": False, "sync": False, "staleness": 0}):
        s = cls(**kw).build(net, spec)
        validate(s, net, spec)
        syncs = [leaf.synchronizer for nc in s.node_config for leaf in nc.leaves()
                 if isinstance(leaf.synchronizer, PSSynchronizer)]
        assert syncs
        assert {(x.local_replication, x.sync, x.staleness) for x in syncs} == {
            (kw["local_proxy_variable"], kw["sync"], kw["staleness"])}


@pytest.mark.parametrize("cls", PS_ONLY + [Parallax])
@pytest.mark.parametrize(
    ("kw", "words"),
    [({"staleness": -1}, "staleness must be >= 0"),
     ({"sync": False, "staleness": 2}, "needs sync=True"),
     ({"staleness": True}, "staleness must be an integer"),
     ({"staleness": 1.5}, "staleness must be an integer"),
     ({"sync": "yes"}, "sync must be true or false"),
     ({"local_proxy_variable": 1}, "local_proxy_variable must be true or false")],
)
def test_constructor_errors(cls: type, kw: dict, words: str) -> None:
    with pytest.raises(StrategyError, match=re.escape(words)) as err:
        cls(**kw)
    assert err.value.fix


@pytest.mark.parametrize("chunk_size", [0, -3, 1.5, True, "8"])
def test_parallax_chunk_size_error(chunk_size: object) -> None:
    with pytest.raises(StrategyError, match="chunk_size must be an integer >= 1"):
        Parallax(chunk_size=chunk_size)


def test_positional_arguments_follow_autodist() -> None:
    assert PSLoadBalancing(True, True, 2) == PSLoadBalancing(
        local_proxy_variable=True, sync=True, staleness=2)
    assert Parallax(64, False, False, 0) == Parallax(chunk_size=64, sync=False)


# ------------------------------------------------------------------------------ servers
def test_available_servers(colocated: ResourceSpec, dedicated: ResourceSpec) -> None:
    assert ps_servers(colocated) == ["127.0.0.1:CPU:0", "127.0.0.1:CPU:1"]
    assert ps_servers(dedicated) == ["10.0.0.3:PS:0", "10.0.0.4:PS:0"]


def test_capacities(colocated: ResourceSpec, hetero: ResourceSpec) -> None:
    two_nodes = spec_of({"address": "10.0.0.1", "chief": True, "workers": 2,
                         "network_bandwidth": 10},
                        {"address": "10.0.0.2", "workers": 1, "network_bandwidth": 4})
    assert ps_capacities(colocated) == [Fraction(1, 2)] * 2   # 1 Gbit/s shared by 2
    assert ps_capacities(two_nodes) == [5, 5, 4]
    assert ps_capacities(hetero) == [10, 30]


# ------------------------------------------------------------------------------ PS
@pytest.mark.parametrize(("fixture", "server"),
                         [("colocated", "127.0.0.1:CPU:0"), ("dedicated", "10.0.0.3:PS:0"),
                          ("one_server", "10.0.0.9:PS:0")])
def test_ps_puts_everything_on_one_server(net: ModelProfile, fixture: str, server: str,
                                          request: pytest.FixtureRequest) -> None:
    spec = request.getfixturevalue(fixture)
    s = PS().build(net, spec)
    assert all(nc.partitioner is None for nc in s.node_config)
    assert {nc.synchronizer.reduction_destination for nc in s.node_config} == {server}
    assert all(nc.synchronizer == PSSynchronizer(server) for nc in s.node_config)


# ------------------------------------------------------------------------------ PSLoadBalancing
def test_load_balancing_is_lpt_on_a_hand_example(colocated: ResourceSpec) -> None:
    # bytes 12, 20, 28, 16, 12 -> largest first: 28->CPU:0, 20->CPU:1, 16->CPU:1 (36),
    # 12 (b, first in profile order)->CPU:0 (40), 12 (e)->CPU:1 (48)
    prof = profile_of(param("a", (3,)), param("b", (5,)), param("c", (7,)),
                      param("d", (4,)), param("e", (3,)))
    s = PSLoadBalancing().build(prof, colocated)
    dest = {nc.var_name: nc.synchronizer.reduction_destination[-5:] for nc in s.node_config}
    assert dest == {"c": "CPU:0", "b": "CPU:1", "d": "CPU:1", "a": "CPU:0", "e": "CPU:1"}
    assert loads(s, prof, colocated) == {"127.0.0.1:CPU:0": 40, "127.0.0.1:CPU:1": 48}


def test_load_balancing_places_whole_parameters(net: ModelProfile, spec: ResourceSpec) -> None:
    s = PSLoadBalancing().build(net, spec)
    assert all(nc.partitioner is None for nc in s.node_config)
    assert {nc.synchronizer.reduction_destination for nc in s.node_config} == set(
        ps_servers(spec))
    assert_balanced(s, net, spec)


def optimum(sizes: list[int], servers: int) -> int:
    best = sum(sizes)
    for assignment in itertools.product(range(servers), repeat=len(sizes)):
        per = [0] * servers
        for size, s in zip(sizes, assignment, strict=True):
            per[s] += size
        best = min(best, max(per))
    return best


@pytest.mark.parametrize("seed", range(8))
def test_load_balancing_within_lpt_bound_of_optimum(seed: int) -> None:
    rng = random.Random(seed)
    servers = rng.choice([2, 3])
    spec = spec_of({"address": "127.0.0.1", "workers": servers})
    prof = profile_of(*(param(f"p{i}", (rng.randint(1, 40),)) for i in range(7)))
    s = PSLoadBalancing().build(prof, spec)
    worst = max(loads(s, prof, spec).values())
    opt = optimum([p.bytes for p in prof.params], servers)
    assert worst <= (Fraction(4, 3) - Fraction(1, 3 * servers)) * opt


# ------------------------------------------------------------------------------ PartitionedPS
def test_partitioned_ps_shards(net: ModelProfile, spec: ResourceSpec) -> None:
    s = PartitionedPS().build(net, spec)
    servers = ps_servers(spec)
    for nc in s.node_config:
        info = net.get(nc.var_name)
        if not info.shape or info.shape[0] < 2:
            assert nc.partitioner is None, nc.var_name
            continue
        k = min(len(servers), info.shape[0])
        assert str(nc.partitioner) == ",".join([str(k)] + ["1"] * (len(info.shape) - 1))
        assert nc.partitioner.sizes is None          # even split, the schema's default rule
        sizes = nc.partitioner.part_sizes(info.shape)
        assert sum(sizes) == info.shape[0] and max(sizes) - min(sizes) <= 1
        assert [p.var_name for p in nc.part_config] == [
            f"{nc.var_name}/part_{i}" for i in range(k)]
        dests = [p.synchronizer.reduction_destination for p in nc.part_config]
        assert len(set(dests)) == k and set(dests) <= set(servers)
    assert_balanced(s, net, spec)


def test_partitioned_ps_longest_part_to_least_loaded(colocated: ResourceSpec) -> None:
    # "big" (8 rows, 32 B) splits 4/4; "odd" (3 rows, 12 B): 2 rows to the least loaded
    # server, CPU:0 (a tie with CPU:1, first listed wins); "s" (2 rows) splits 1/1.
    prof = profile_of(param("big", (8,)), param("odd", (3,)), param("s", (2,)))
    s = PartitionedPS().build(prof, colocated)
    odd = s.config_for("odd")
    assert odd.partitioner.part_sizes((3,)) == [2, 1]
    assert [p.synchronizer.reduction_destination for p in odd.part_config] == [
        "127.0.0.1:CPU:0", "127.0.0.1:CPU:1"]
    assert loads(s, prof, colocated) == {"127.0.0.1:CPU:0": 16 + 8 + 4,
                                         "127.0.0.1:CPU:1": 16 + 4 + 4}


@pytest.mark.parametrize("cls", [PartitionedPS, UnevenPartitionedPS, Parallax])
def test_single_server_means_no_partitioning(net: ModelProfile, one_server: ResourceSpec,
                                             cls: type) -> None:
    s = cls().build(net, one_server)
    validate(s, net, one_server)
    assert all(nc.partitioner is None for nc in s.node_config)


def test_more_servers_than_rows() -> None:
    spec = spec_of({"address": "127.0.0.1", "workers": 5})
    prof = profile_of(param("w", (3, 2)), param("v", (7,)))
    s = PartitionedPS().build(prof, spec)
    validate(s, prof, spec)
    assert str(s.config_for("w").partitioner) == "3,1"
    assert s.config_for("v").partitioner.part_sizes((7,)) == [2, 2, 1, 1, 1]


# ------------------------------------------------------------------------------ Uneven
def test_uneven_part_sizes_are_explicit(net: ModelProfile, spec: ResourceSpec) -> None:
    s = UnevenPartitionedPS().build(net, spec)
    for nc in s.node_config:
        if nc.partitioner is None:
            continue
        info = net.get(nc.var_name)
        assert nc.partitioner.sizes is not None
        assert sum(nc.partitioner.sizes) == info.shape[0] and min(nc.partitioner.sizes) >= 1
        assert len(nc.part_config) == len(nc.partitioner.sizes) == nc.partitioner.num_parts
        assert "part_sizes" in nc.to_dict()
    assert_balanced(s, net, spec)


def test_uneven_fills_the_less_loaded_servers() -> None:
    # three servers; "row" (1 x 10, 40 B) cannot be split and lands on CPU:0. "w" (9 rows of
    # 4 B) then raises CPU:1 and CPU:2 to one level (18 B each, 4.5 rows) and leaves CPU:0
    # out: 4 + 4 rows, the left-over row to CPU:1 -> parts of 5 and 4 rows.
    spec = spec_of({"address": "127.0.0.1", "workers": 3})
    prof = profile_of(param("row", (1, 10)), param("w", (9,)))
    s = UnevenPartitionedPS().build(prof, spec)
    w = s.config_for("w")
    assert w.partitioner.sizes == (5, 4)
    assert [p.synchronizer.reduction_destination for p in w.part_config] == [
        "127.0.0.1:CPU:1", "127.0.0.1:CPU:2"]
    assert list(loads(s, prof, spec).values()) == [40, 20, 16]
    # PartitionedPS splits evenly over all three and ends less balanced
    even = PartitionedPS().build(prof, spec)
    assert even.config_for("w").partitioner.part_sizes((9,)) == [3, 3, 3]
    assert list(loads(even, prof, spec).values()) == [52, 12, 12]


def test_uneven_rounding_and_small_parameters(colocated: ResourceSpec) -> None:
    # "big" (10 rows) is split 5/5 and the servers are level; "tail" (3 rows) gets one row
    # each (level 26 B) and the left-over row goes to the first server: 2/1.
    prof = profile_of(param("big", (10,)), param("tail", (3,)), param("bias", (1,)))
    s = UnevenPartitionedPS().build(prof, colocated)
    assert s.config_for("tail").partitioner.sizes == (2, 1)
    # "bias" has one row and goes whole to the lighter server.
    assert s.config_for("bias").synchronizer.reduction_destination == "127.0.0.1:CPU:1"
    # a parameter smaller than the gap goes whole: only the lighter server is below level
    prof2 = profile_of(param("row", (1, 10)), param("w", (4,)))
    s2 = UnevenPartitionedPS().build(prof2, colocated)
    assert s2.config_for("w").partitioner is None
    assert s2.config_for("w").synchronizer.reduction_destination == "127.0.0.1:CPU:1"


def test_uneven_follows_capacity(hetero: ResourceSpec) -> None:
    prof = profile_of(param("emb", (100, 16)))
    s = UnevenPartitionedPS().build(prof, hetero)
    validate(s, prof, hetero)
    emb = s.config_for("emb")
    assert emb.partitioner.sizes == (25, 75)             # links 10 : 30 Gbit/s
    assert [p.synchronizer.reduction_destination for p in emb.part_config] == [
        "10.0.0.3:PS:0", "10.0.0.4:PS:0"]


def test_uneven_load_per_capacity_is_level(net: ModelProfile, hetero: ResourceSpec) -> None:
    s = UnevenPartitionedPS().build(net, hetero)
    validate(s, net, hetero)
    per = loads(s, net, hetero)
    biggest = max(b for _, _, b in pieces(s, net))
    # bytes per Gbit/s within one piece's worth of each other
    assert abs(Fraction(per["10.0.0.3:PS:0"], 10) - Fraction(per["10.0.0.4:PS:0"], 30)) \
        <= Fraction(biggest, 10)


# ------------------------------------------------------------------------------ Parallax
def test_parallax_sparse_on_ps_dense_on_allreduce(net: ModelProfile, spec: ResourceSpec
                                                  ) -> None:
    s = Parallax(chunk_size=2).build(net, spec)
    on_ps = {"emb.weight", "table.weight"}
    assert {p.name for p in net.params if sparse_access(p)} == on_ps
    dense = [n for n in net.names if n not in on_ps]
    for nc in s.node_config:
        if nc.var_name in on_ps:
            assert all(isinstance(leaf.synchronizer, PSSynchronizer) for leaf in nc.leaves())
        else:
            assert nc.synchronizer == AllReduceSynchronizer(
                group=dense.index(nc.var_name) // 2)
    # two servers: both embeddings are split along axis 0, one part per server
    for name in on_ps:
        nc = s.config_for(name)
        assert str(nc.partitioner) == "2,1"
        assert {p.synchronizer.reduction_destination for p in nc.part_config} == set(
            ps_servers(spec))
    assert_balanced(s, net, spec)


@pytest.mark.parametrize("chunk_size", [1, 2, 3, 128])
def test_parallax_groups_count_dense_parameters_only(net: ModelProfile,
                                                     colocated: ResourceSpec,
                                                     chunk_size: int) -> None:
    s = Parallax(chunk_size=chunk_size).build(net, colocated)
    got = [nc.synchronizer.group for nc in s.node_config
           if isinstance(nc.synchronizer, AllReduceSynchronizer)]
    assert got == [i // chunk_size for i in range(len(net.params) - 2)]


def test_parallax_tied_embedding_is_dense(tied: ModelProfile, dedicated: ResourceSpec) -> None:
    info = tied.get("wte.weight")
    assert info.embedding_like and not info.sparse and info.aliases == ("head.weight",)
    s = Parallax().build(tied, dedicated)
    validate(s, tied, dedicated)
    assert isinstance(s.config_for("wte.weight").synchronizer, AllReduceSynchronizer)
    assert s.config_for("ids.weight").partitioner is not None  # sparse: on the servers
    assert [nc.synchronizer.group for nc in s.node_config
            if isinstance(nc.synchronizer, AllReduceSynchronizer)] == [0, 0, 0]


def test_parallax_dense_model_is_all_reduce(colocated: ResourceSpec) -> None:
    prof = analyze(nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 1)))
    s = Parallax().build(prof, colocated)
    assert all(isinstance(nc.synchronizer, AllReduceSynchronizer) for nc in s.node_config)


def test_parallax_balances_several_sparse_tables(dedicated: ResourceSpec) -> None:
    prof = profile_of(param("dense", (8, 8)),
                      param("t1", (9, 4), sparse=True, embedding_like=True),
                      param("t2", (1, 64), sparse=True, embedding_like=True),
                      param("t3", (1, 32), sparse=True, embedding_like=True))
    s = Parallax().build(prof, dedicated)
    validate(s, prof, dedicated)
    # t2 (one row) whole -> 10.0.0.3; t1 split 5/4 rows, the 5 onto 10.0.0.4; t3 -> .4
    assert s.config_for("t2").synchronizer.reduction_destination == "10.0.0.3:PS:0"
    assert loads(s, prof, dedicated) == {"10.0.0.3:PS:0": 256 + 64, "10.0.0.4:PS:0": 80 + 128}
    assert_balanced(s, prof, dedicated)


# ------------------------------------------------------------------------------ properties
@pytest.mark.parametrize("seed", range(12))
def test_random_models_validate_and_balance(seed: int) -> None:
    rng = random.Random(seed)
    servers = rng.randint(1, 5)
    nodes = [{"address": "10.1.0.1", "chief": True, "workers": 2}]
    nodes += [{"address": f"10.1.1.{i}", "workers": 0} for i in range(servers)]
    spec = spec_of(*nodes) if seed % 2 else spec_of(
        {"address": "127.0.0.1", "workers": servers})
    params = []
    for i in range(rng.randint(1, 14)):
        shape = tuple(rng.randint(0 if rng.random() < 0.05 else 1, 40)
                      for _ in range(rng.randint(0, 3)))
        sparse = rng.random() < 0.2
        params.append(param(f"p{i}", shape, itemsize=rng.choice([2, 4]), sparse=sparse,
                            embedding_like=sparse))
    prof = profile_of(*params)
    for cls in BUILDERS.values():
        s = cls().build(prof, spec)
        assert validate(s, prof, spec) is s
        assert Strategy.from_dict(yaml.safe_load(s.to_yaml())) == s
        if cls in BALANCED and any(p.bytes for p in prof.params):
            assert_balanced(s, prof, spec)
        got = Counter(name for name, _, _ in pieces(s, prof))
        for nc in s.node_config:   # every PS parameter's pieces add up to its bytes
            info = prof.get(nc.var_name)
            if got[nc.var_name]:
                assert sum(b for n, _, b in pieces(s, prof) if n == nc.var_name) == info.bytes


# ------------------------------------------------------------------------------ docs
def doc_blocks() -> list[str]:
    text = (ROOT / "docs" / "reference" / "ps-builders.md").read_text()
    return re.findall(r"^```text\n(.*?)^```", text, re.S | re.M)


class DocNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4, sparse=True)
        self.fc = nn.Linear(4, 6)
        self.out = nn.Linear(6, 1)


DOC_CASES = [PS(), PSLoadBalancing(), PartitionedPS(), UnevenPartitionedPS(),
             Parallax(chunk_size=2)]


@pytest.mark.parametrize("index", range(len(DOC_CASES)))
def test_doc_summaries_are_what_the_builders_write(dedicated: ResourceSpec, index: int
                                                   ) -> None:
    prof = analyze(DocNet())
    block = doc_blocks()[index].strip().splitlines()
    s = DOC_CASES[index].build(prof, dedicated)
    assert block[0].endswith(f"(builder {s.builder}, 4 replicas)")
    assert block[1:] == body(s)

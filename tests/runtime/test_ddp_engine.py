"""The ddp engine (runtime/ddp_engine.py): torch's DDP reducer running a strategy's
all-reduce groups, against single-process plain torch, and the schema and validation of
the ``engine`` field. (Equality on the tied and plain models at 2 and 4 ranks is in
test_distributed.py, builder ``AllReduceDDP``; the scaler and a mixed PS + all-reduce model
in test_amp.py; the 2 -> 1 -> 2 rescale in tests/elastic/test_inprocess_rescale.py.)"""

from __future__ import annotations

from typing import Any

import ddp_workers
import pytest
import torch
from rt_common import check, reference, spawn
from torch import nn

from stratagem.analysis import analyze
from stratagem.errors import StrategyError
from stratagem.resource import ResourceSpec
from stratagem.runtime import compile_plan
from stratagem.strategy import (
    AllReduce,
    AllReduceSynchronizer,
    NodeConfig,
    Parallax,
    PartitionedAR,
    Strategy,
    validate,
)

RTOL = 1e-5


@pytest.fixture(scope="module")
def w2(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("ddp_w2")
    return spawn(ddp_workers.suite, 2, out, ckpt_dir=str(out / "ckpt"))


def close(got: dict, want: dict, rtol: float = RTOL, atol: float = 1e-8) -> None:
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=rtol, atol=atol, msg=k)


def test_gradient_accumulation_equals_the_big_batch(w2: list[dict]) -> None:
    per_rank = [check(r["no_sync"]) for r in w2]
    for r in per_rank:
        assert r["synced_inside_no_sync"] == 0 and r["steps"] == 10
    close(per_rank[1]["state"], per_rank[0]["state"], rtol=0, atol=0)
    close(per_rank[0]["state"], reference("mlp", "sgd", steps=10))


def test_grad_weight_uneven_batches(w2: list[dict]) -> None:
    per_rank = [check(r["grad_weight"]) for r in w2]
    close(per_rank[1], per_rank[0], rtol=0, atol=0)
    close(per_rank[0], reference("mlp", "sgd", steps=10))


def test_buffers_follow_rank0_and_eval_stays_local(w2: list[dict]) -> None:
    per_rank = [check(r["batchnorm"]) for r in w2]
    close(per_rank[1]["final"], per_rank[0]["final"], rtol=0, atol=0)
    assert per_rank[0]["eval_out"] is not None  # (rank 1 never joined: nothing was sent)


def test_one_bucket_per_group_seen_by_observers(w2: list[dict]) -> None:
    """DDP cuts its buckets with the groups' sizes as limits, in launch order; after the
    first step it re-cuts them once, in the order gradients arrived (its own
    optimization): here that is the plan's order, so from then on the buckets are the
    groups. Every step reduces every parameter once, in as many buckets as groups."""
    for r in (check(r["buckets"]) for r in w2):
        groups = sorted(r["groups"])
        params = sorted(p for g in groups for p in g)
        for i, seen in enumerate(r["seen"]):
            local = sorted(p for e, p in seen if e == "local")
            reduced = sorted(p for e, p in seen if e == "reduced")
            assert local == reduced
            if i > 0:
                assert local == groups
            assert len(local) == len(groups) and sorted(p for b in local for p in b) == params
            # every bucket's local statistics before any reduced one (as on Stratagem's)
            assert [e for e, _ in seen] == ["local"] * len(groups) + ["reduced"] * len(groups)
        assert r["steps"] == 3 and r["collectives"] == 3 * len(groups)
        assert "DDP bucket" in r["summary"] and "gradient_as_bucket_view" in r["summary"]


def test_the_first_group_sends_its_first_bytes_in_a_bucket_of_their_own(
        w2: list[dict]) -> None:
    """As plain DDP's 1 MiB first bucket (here a 100-byte limit): the last-registered
    parameters up to the limit are a group and a bucket of their own, reduced apart from
    the rest, and training still equals one process with the global batch."""
    for r in (check(r["first_bucket"]) for r in w2):
        assert sorted(r["groups"]) == [["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"],
                                       ["fc3.bias", "fc3.weight"]]
        assert r["last_step_buckets"] == [["fc3.bias", "fc3.weight"],
                                          ["fc1.bias", "fc1.weight", "fc2.bias",
                                           "fc2.weight"]]
        close(r["final"], reference("mlp", "sgd"))


def test_bucket_bytes_cuts_ddp_buckets_of_that_size_and_trains_exactly(
        w2: list[dict]) -> None:
    """AllReduce(engine="ddp", bucket_bytes=150) (DDP's bucket_cap_mb, as Auto's
    ``AllReduceDDP@<size>`` candidates use it): three groups in reverse registration
    order, each reduced as one DDP bucket, and training equals one process with the
    global batch on the Python hook and on DDP's C++ reducer alike."""
    want = [["fc3.bias", "fc3.weight"], ["fc2.bias", "fc2.weight"],
            ["fc1.bias", "fc1.weight"]]
    for r in (check(r["bucket_bytes"]) for r in w2):
        assert sorted(r["python"]["groups"]) == sorted(want)
        assert r["python"]["last_step_buckets"] == want
        assert r["cpp"]["last_step_buckets"] == []
        assert r["cpp"]["hook"] == "c++ reducer, no hook" and r["python"]["hook"].startswith(
            "python")
        for key in ("python", "cpp"):
            close(r[key]["final"], reference("mlp", "sgd"))


def test_cpp_reducer_until_an_observer_needs_python(w2: list[dict]) -> None:
    """Nothing needs Python: DDP's own C++ reducer, no comm hook (as plain DDP). An
    observer added on every rank brings a new DDP with the Python hook; the tied model
    trains exactly as one process with the global batch throughout, and every synced
    step is counted on both paths."""
    per_rank = [check(r["hook"]) for r in w2]
    close(per_rank[1]["state"], per_rank[0]["state"], rtol=0, atol=0)
    close(per_rank[0]["state"], reference("tied", "sgd"))
    for r in per_rank:
        assert r["hooks"][:5] == ["c++ reducer, no hook"] * 5
        assert all(h.startswith("python (") for h in r["hooks"][5:])
        assert r["observed"] > 0 and r["steps"] == len(r["hooks"])
        assert r["collectives"] >= r["steps"]
        assert "engine=ddp (python (" in r["repr"]
        assert "no comm hook (as plain DDP)" in r["summary"]


def test_fp16_on_the_builtin_cpp_hook_equals_torchs_python_hook(w2: list[dict]) -> None:
    for r in (check(r["fp16_hooks"]) for r in w2):
        assert r["cpp"]["hook"] == "c++ FP16_COMPRESS hook"
        assert r["python"]["hook"].startswith("python (")
        assert r["cpp"]["bytes"] == r["python"]["bytes"]
        close(r["cpp"]["state"], r["python"]["state"], rtol=0, atol=0)


def test_bucket_caps_are_the_groups_in_launch_order() -> None:
    """One DDP bucket per group: the size limits are the groups' sizes, in launch order,
    DDP's first bucket included where the strategy has it as a group."""
    from stratagem.runtime.ddp_engine import bucket_caps

    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4))
    profile = analyze(model)
    spec = ResourceSpec.local(2)

    def plan(**kw: Any) -> Any:
        return compile_plan(AllReduce(engine="ddp", **kw).build(profile, spec), profile,
                            rank=0, world_size=2, device=torch.device("cpu"))

    total = sum(p.numel() for p in model.parameters()) * 4
    assert bucket_caps(plan()) == [total]  # (DDP's 1 MiB first bucket holds it all)
    # reverse registration: bias 4 (16 B), weight 8x4 (128 B) -> 144 >= 100
    assert bucket_caps(plan(first_bucket_bytes=100)) == [144, total - 144]
    assert bucket_caps(plan(first_bucket_bytes=16)) == [16, total - 16]
    two = plan(chunk_size=2)
    assert bucket_caps(two) == [g.nbytes for g in two.groups] and len(two.groups) == 3


def test_a_parameter_without_gradient_is_refused_with_the_fix(w2: list[dict]) -> None:
    for r in w2:
        msg = check(r["unused"])
        assert "without a gradient" in msg and "engine: stratagem" in msg, msg


def test_replan_between_engines_keeps_training_exact(w2: list[dict]) -> None:
    per_rank = [check(r["replan"]) for r in w2]
    assert per_rank[0]["engines"] == ["DDPReducer"] * 3 + ["AllReduceReducer"] * 3 + \
        ["DDPReducer"] * 3
    assert per_rank[0]["steps"] == 3  # (counted since the last replan)
    close(per_rank[1]["state"], per_rank[0]["state"], rtol=0, atol=0)
    close(per_rank[0]["state"], reference("mlp", "sgd", steps=9))


def distance(a: dict, b: dict) -> float:
    return sum(float((a[k] - b[k]).abs().sum()) for k in a)


def test_powersgd_state_roundtrip(w2: list[dict]) -> None:
    """Restored state (error feedback, warm-start factors, step) carries on: the resumed
    run stays closer to the uninterrupted one than a run without the state. (Not
    exactly equal: the new DDP's first step is reduced uncompressed, its first buckets
    not being those the state was saved for.)"""
    for r in (check(r["powersgd_roundtrip"]) for r in w2):
        assert r["keys"] and all(k.startswith("ddp.powersgd.") for k in r["keys"])
        assert any(k.startswith("ddp.powersgd.error:") for k in r["keys"])
        close(r["reloaded"], r["continued"], rtol=0.05, atol=5e-3)
        assert distance(r["reloaded"], r["continued"]) < distance(r["fresh"],
                                                                    r["continued"])


def test_checkpoint_resumes_powersgd_exactly(w2: list[dict]) -> None:
    for r in (check(r["checkpoint"]) for r in w2):
        assert "sync-rank0.pt" in r["files"] and "sync-rank1.pt" in r["files"]
        close(r["resumed"], r["continued"], rtol=0.05, atol=5e-3)


# -- schema and validation -----------------------------------------------------------------
class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4, sparse=True)
        self.fc = nn.Linear(4, 6)
        self.out = nn.Linear(6, 2)


def test_engine_written_only_when_ddp_and_old_files_load_unchanged() -> None:
    plain = AllReduceSynchronizer(group=1)
    assert "engine" not in plain.to_dict()
    assert AllReduceSynchronizer(engine="ddp").to_dict()["engine"] == "ddp"
    old = {"node_config": [{"var_name": "w", "synchronizer": {
        "type": "AllReduce", "spec": "auto", "compressor": "none", "group": 0}}]}
    loaded = Strategy.from_dict(old)
    assert loaded.node_config[0].synchronizer.engine == "stratagem"
    assert loaded.to_dict()["node_config"] == old["node_config"]  # byte-for-byte the same
    ddp = Strategy(node_config=(NodeConfig("w", AllReduceSynchronizer(engine="ddp")),))
    assert Strategy.from_dict(ddp.to_dict()).node_config == ddp.node_config


def test_plan_says_which_engine_and_options() -> None:
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
    profile = analyze(model)
    spec = ResourceSpec.local(2)
    plan = compile_plan(AllReduce(chunk_size=2, engine="ddp").build(profile, spec), profile,
                        rank=0, world_size=2, device=torch.device("cpu"))
    assert plan.engine == "ddp" and all(g.engine == "ddp" for g in plan.groups)
    assert "torch DistributedDataParallel" in plan.summary()
    base = compile_plan(AllReduce(chunk_size=2).build(profile, spec), profile, rank=0,
                        world_size=2, device=torch.device("cpu"))
    assert base.engine == "stratagem" and "DistributedDataParallel" not in base.summary()


def _refused(strategy: Strategy, profile, spec, *words: str) -> None:
    for run in (lambda: validate(strategy, profile, spec),
                lambda: compile_plan(strategy, profile, rank=0, world_size=2,
                                     device=torch.device("cpu"))):
        with pytest.raises(StrategyError) as err:
            run()
        text = str(err.value)
        assert all(w in text for w in words), text
        assert err.value.fix


def test_validation_refuses_what_ddp_cannot_run() -> None:
    net = Net()
    profile = analyze(net)
    spec = ResourceSpec.local(2)
    dense = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
    dprofile = analyze(dense)
    # a part of a partitioned parameter
    parts = PartitionedAR(chunk_size=1).build(dprofile, spec)
    nodes = tuple(NodeConfig(nc.var_name, partitioner=nc.partitioner, part_config=tuple(
        NodeConfig(p.var_name, AllReduceSynchronizer(group=p.synchronizer.group,
                                                     engine="ddp"))
        for p in nc.part_config)) if nc.partitioner else NodeConfig(
        nc.var_name, AllReduceSynchronizer(group=nc.synchronizer.group, engine="ddp"))
        for nc in parts.node_config)
    _refused(Strategy(node_config=nodes), dprofile, spec, "engine ddp on a part", "0.weight")
    # a sparse gradient
    _refused(AllReduce(engine="ddp").build(profile, spec), profile, spec, "sparse",
             "emb.weight")
    # two engines in one model
    mixed = AllReduce(chunk_size=1, engine="ddp").build(dprofile, spec)
    first = mixed.node_config[0]
    mixed = Strategy(node_config=(NodeConfig(first.var_name, AllReduceSynchronizer()),
                                  *mixed.node_config[1:]))
    _refused(mixed, dprofile, spec, "engine 'stratagem'", "same engine", "0.weight")
    # two compressors on ddp
    two = AllReduce(chunk_size=1, engine="ddp").build(dprofile, spec)
    two = Strategy(node_config=(NodeConfig(first.var_name, AllReduceSynchronizer(
        compressor="fp16", engine="ddp")), *two.node_config[1:]))
    _refused(two, dprofile, spec, "compressor", "one compressor")
    # an unknown engine
    with pytest.raises(StrategyError, match="unknown engine"):
        AllReduce(engine="nccl")


def test_parameter_servers_beside_the_ddp_engine_validate() -> None:
    profile = analyze(Net())
    spec = ResourceSpec.local(2)
    strategy = validate(Parallax(engine="ddp").build(profile, spec), profile, spec)
    plan = compile_plan(strategy, profile, rank=0, world_size=2, device=torch.device("cpu"))
    assert plan.engine == "ddp" and plan.ps is not None
    assert {m.param for g in plan.groups for m in g.members} == {
        "fc.weight", "fc.bias", "out.weight", "out.bias"}

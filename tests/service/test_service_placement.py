"""Placement pinned to nodes: not-spot nodes fill first, spot nodes are used last, a drain
moves the work off the noticed node. The rule alone, then on a local multi-node Ray cluster
(``ray.cluster_utils.Cluster``: three raylets on this machine, fake GPUs, one spot node)."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator

import pytest
from _ray_service import FAKE_GPU

from stratagem.service import store as st
from stratagem.service.cluster import RAY_DEFAULTS
from stratagem.service.jobfile import parse_job
from stratagem.service.ray_backend import Launched, NodeInfo, choose_nodes
from stratagem.service.scheduler import Scheduler, SchedulerOptions

GPU = {FAKE_GPU: 1.0}


def node(name: str, free: float, spot: bool = False) -> NodeInfo:
    return NodeInfo(name, "10.0.0.1", spot, {FAKE_GPU: 4.0}, {FAKE_GPU: free})


def ids(nodes: list[NodeInfo] | None) -> list[str] | None:
    return None if nodes is None else [n.node_id for n in nodes]


def test_not_spot_nodes_fill_first_and_jobs_pack():
    nodes = [node("spot", 4, spot=True), node("a", 4), node("b", 1)]
    # the fullest not-spot node that fits first (b), then the job stays together on a
    assert ids(choose_nodes(nodes, 3, GPU, FAKE_GPU)) == ["b", "a", "a"]
    assert ids(choose_nodes(nodes, 6, GPU, FAKE_GPU)) == ["b", "a", "a", "a", "a", "spot"]
    assert choose_nodes(nodes, 10, GPU, FAKE_GPU) is None  # does not fit
    # a grow prefers the nodes the job already runs on
    assert ids(choose_nodes(nodes, 1, GPU, FAKE_GPU, near=("a",))) == ["a"]
    assert ids(choose_nodes([node("spot", 2, spot=True)], 2, GPU, FAKE_GPU)) == ["spot"] * 2


def test_bundles_chosen_by_a_start_in_flight_are_not_chosen_again(monkeypatch):
    """Starts run side by side: a node chosen for a group Ray has not placed yet counts as
    taken, so a second start does not pick the same free accelerator; once Ray lists the
    group as placed it is not counted twice."""
    pytest.importorskip("ray", reason="Ray is an optional extra")
    import importlib
    import threading

    pgs = importlib.import_module("ray.util.placement_group")  # the module, not the function
    from stratagem.service.ray_backend import RayBackend

    table: dict[str, dict] = {}
    monkeypatch.setattr(pgs, "placement_group_table", lambda: table)
    ray_node = {"NodeID": "n0", "Alive": True, "NodeManagerAddress": "10.0.0.1",
                "Resources": {FAKE_GPU: 2.0}}
    be = RayBackend.__new__(RayBackend)  # no Ray connection: only the placement state
    be.__dict__.update(gpu_resource=FAKE_GPU, ray=type("R", (), {"nodes": lambda: [ray_node]}),
                       _placing=threading.Lock(), _reserved={})
    with be._reserve(["a.g0.r0"], 1, GPU) as nodes:
        assert ids(nodes) == ["n0"]
        assert be.place(2, GPU) is None and ids(be.place(1, GPU)) == ["n0"]
        with be._reserve(["b.g0.r0", "b.g0.r1"], 2, GPU) as two:
            assert two is None  # only one accelerator is left
        table["x"] = {"name": "a.g0.r0", "state": "CREATED", "bundles": {0: GPU},
                      "bundles_to_node_id": {0: "n0"}}  # Ray placed it: counted once
        assert ids(be.place(1, GPU)) == ["n0"]
    del table["x"]
    assert ids(be.place(2, GPU)) == ["n0", "n0"] and be._reserved == {}


def test_a_replica_slow_to_answer_a_poll_is_running_not_lost():
    """A poll that times out (a busy node) is no lost replica: restarting the job from its
    checkpoint would throw its progress away. Only many unanswered polls in a row, or an
    actor that is gone, count as lost."""
    pytest.importorskip("ray", reason="Ray is an optional extra")
    from ray.exceptions import GetTimeoutError

    from stratagem.service import ray_backend as rb

    answers: list[object] = []

    def get(ref, timeout):
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    actor = type("A", (), {"poll": type("M", (), {"remote": staticmethod(lambda: "ref")})})
    fake = type("R", (), {"get": staticmethod(get),
                          "get_actor": staticmethod(lambda name, namespace: actor)})
    be = rb.RayBackend.__new__(rb.RayBackend)  # no Ray connection: only poll's rule
    be.__dict__.update(ray=fake, _unanswered={})
    job = Launched("j.g0", ("j.g0.r0",))
    answers[:] = [GetTimeoutError("busy"), None, 0]
    assert [be.poll(job) for _ in range(3)] == [[None], [None], [0]]
    answers[:] = [GetTimeoutError("busy")] * rb.MAX_UNANSWERED
    codes = [be.poll(job)[0] for _ in range(rb.MAX_UNANSWERED)]
    assert codes == [None] * (rb.MAX_UNANSWERED - 1) + [rb.LOST] and be._unanswered == {}
    answers[:] = [RuntimeError("the actor died")]
    assert be.poll(job) == [rb.LOST]
    # a replica whose actor is gone is lost, and its count of missed polls goes with it
    answers[:] = [GetTimeoutError("busy")]
    assert be.poll(job) == [None] and be._unanswered == {"j.g0.r0": 1}

    def missing(name, namespace):
        raise ValueError(f"no actor {name}")

    be.ray = type("R", (), {"get": staticmethod(get), "get_actor": staticmethod(missing)})
    assert be.poll(job) == [rb.LOST] and be._unanswered == {}


@pytest.fixture(scope="module")
def multinode() -> Iterator[tuple[object, dict[str, str]]]:
    ray = pytest.importorskip("ray", reason="Ray is an optional extra")
    from ray.cluster_utils import Cluster

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    for key, value in RAY_DEFAULTS.items():  # Ray as `cluster up` starts it
        os.environ.setdefault(key, value)
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "include_dashboard": False, "object_store_memory": 80 * 2**20})
    names = {}
    try:
        for name, labels in (("spot", {"ray.io/market-type": "spot"}), ("steady", {})):
            n = cluster.add_node(num_cpus=2, resources={FAKE_GPU: 2},
                                 object_store_memory=80 * 2**20, labels=labels)
            names[name] = n.node_id
        ray.init(address=cluster.address, log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(sys.path)}})
        yield ray, names
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.mark.slow
def test_spot_nodes_are_used_last_and_a_drain_moves_the_job(multinode, tmp_path):
    ray, names = multinode
    script = tmp_path / "idle.py"
    script.write_text("import time\ntime.sleep(120)\n")
    opts = SchedulerOptions(interval=0.5, gpu_resource=FAKE_GPU, grace=2.0, min_runtime=0.0)
    sched = Scheduler(tmp_path, opts)
    spec = parse_job({"name": "x", "script": str(script), "min_replicas": 2,
                      "max_replicas": 2, "resources": {"CPU": 0, "GPU": 1},
                      "adaptive": False})
    sched.store.add_job(spec)

    def where() -> set[str]:
        alloc = sched.store.allocations()["x"]
        return sched.backend.actor_nodes(Launched(alloc.group_name or "", alloc.actors))

    def start() -> None:  # a step starts x in the background
        sched.step()
        sched.finish_starts(timeout=120)
        assert sched.store.job("x").state == st.RUNNING

    start()
    assert where() == {names["steady"]}  # both replicas on the not-spot node
    assert sched.drain(names["steady"]) == ["x"]
    assert sched.store.job("x").state == st.PENDING
    start()
    assert where() == {names["spot"]}  # moved off the drained node, onto the spot one
    sched.undrain(names["steady"])
    sched.store.request_delete("x")
    sched.step()
    assert sched.store.job("x").state == st.DELETED
    deadline = time.monotonic() + 30
    while sched.backend.node_infos() and any(
            n.free.get(FAKE_GPU, 0) != n.total.get(FAKE_GPU, 0)
            for n in sched.backend.node_infos()):
        assert time.monotonic() < deadline, "the bundles were not freed"
        time.sleep(0.5)

"""End to end on a local Ray cluster: real adaptive jobs shared, rescaled (in-process and by
checkpoint-restart), restarted, failed. One module, so the tests share one Ray start."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
from _load import patience
from _ray_service import CRASH_SCRIPT, FAKE_GPU, JOB_SCRIPT

from stratagem.service import store as st
from stratagem.service.jobfile import parse_job
from stratagem.service.ray_backend import Launched, RayBackend, store_name
from stratagem.service.scheduler import Scheduler, SchedulerOptions, job_dirs, job_env

pytestmark = pytest.mark.slow
OPTS = SchedulerOptions(policy="pollux", interval=0.5, restart_delay=1.0, backoff=0.5,
                        max_failures=2, grace=patience(20.0), start_timeout=patience(60.0),
                        gpu_resource=FAKE_GPU, min_runtime=0.0)
INPROCESS_ARGS = ("--epochs", "4", "--step-sleep", "0.25")


class Loop:
    """A scheduler stepping in a background thread."""

    def __init__(self, directory: Path) -> None:
        self.scheduler = Scheduler(directory, OPTS)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.scheduler.run, args=(self.stop,),
                                       daemon=True)
        self.thread.start()

    def close(self, stop_jobs: bool = False) -> None:
        """Stop stepping; with ``stop_jobs``, also stop every job still holding workers (a
        failed test must not leave replicas on the fake GPUs the next test needs)."""
        self.stop.set()
        self.thread.join(timeout=patience(120))
        try:
            assert not self.thread.is_alive()
        finally:
            if stop_jobs:
                for alloc in self.scheduler.store.allocations().values():
                    self.scheduler.backend.stop(Launched(alloc.group_name or "",
                                                         alloc.actors), grace=0.0)


def job(tmp: Path, name: str, *args: str, low: int = 1, high: int = 2,
        rescale: str = "auto", script: Path = JOB_SCRIPT) -> object:
    return parse_job({"name": name, "script": str(script),
                      "args": [*args, "--out", str(tmp / f"{name}.json")],
                      "min_replicas": low, "max_replicas": high,
                      "resources": {"CPU": 1, "GPU": 1}, "adaptive": True,
                      "rescale": rescale})


def wait_for(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + patience(timeout)  # a bound against hangs, not a timing
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def state(store: st.Store, name: str) -> str:
    return store.job(name).state


def accuracy_alone(tmp: Path, *args: str) -> float:
    out = tmp / "alone.json"
    subprocess.run([sys.executable, str(JOB_SCRIPT), *args, "--out", str(out)], check=True,
                   capture_output=True, timeout=patience(120))
    return json.loads(out.read_text())["accuracy"]


def test_two_adaptive_jobs_share_the_cluster_and_survive_a_scheduler_restart(ray_cluster,
                                                                             tmp_path):
    args = ("--epochs", "8", "--step-sleep", "0.06", "--adaptive")
    store = st.Store(tmp_path)
    store.add_job(job(tmp_path, "a", *args))
    loop = Loop(tmp_path)
    try:
        wait_for(lambda: len(store.allocations().get("a", st.AllocationRow(
            "a", 0, (), None, ())).replicas) == 2, 90, "a on both fake GPUs")
        hints = tmp_path / "jobs" / "a" / "ckpt" / "hints.json"
        wait_for(hints.is_file, 90, "a's first hints")
        a_logs = tmp_path / "jobs" / "a" / "logs"
        # hints can come before the first step: on a loaded machine b would otherwise
        # shrink a before it ever trained on 2 replicas
        wait_for(lambda: "training on 2 replicas" in replica_logs(a_logs), 90,
                 "a's first step")
        store.add_job(job(tmp_path, "b", *args))
        wait_for(lambda: state(store, "b") == st.RUNNING, 120, "b to start")
        # (from the history: on a loaded machine a may even have finished meanwhile)
        assert [n for _, n in store.allocation_history("a")][:2] == [2, 1], \
            "a was not shrunk to start b"
        # restart the scheduler mid-run: nothing lost, running jobs left alone
        loop.close()
        before = store.allocations()
        restarts = {n: store.job(n).restarts for n in ("a", "b")}
        # a new scheduler: only the database carries over. In its first decision the jobs
        # keep their replicas (min_runtime), so any change is the restart's doing, not the
        # policy's (which may grow b into the GPU that a frees when it finishes)
        fresh = Scheduler(tmp_path, replace(OPTS, min_runtime=3600.0))
        fresh.step()
        after = {n: state(store, n) for n in ("a", "b")}
        # a running job keeps its workers. On a loaded machine a can finish its training
        # while b's workers start (issue 47: b took 87-300 s at loads of 11-20): the new
        # scheduler then finds a's workers done and marks it succeeded -- not restarted
        assert after["b"] == st.RUNNING and after["a"] in (st.RUNNING, st.SUCCEEDED), after
        kept = {n: alloc for n, alloc in before.items() if after[n] == st.RUNNING}
        assert store.allocations() == kept, "the new scheduler restarted a running job"
        assert {n: store.job(n).restarts for n in ("a", "b")} == restarts
        loop = Loop(tmp_path)
        wait_for(lambda: all(state(store, n) in st.FINAL for n in ("a", "b")), 180,
                 "both jobs to finish")
    finally:
        loop.close(stop_jobs=True)
    assert [state(store, n) for n in ("a", "b")] == [st.SUCCEEDED, st.SUCCEEDED]
    sizes = [count for _, count in store.allocation_history("a")]
    assert sizes[:2] == [2, 1], sizes
    shrink = [t for _, _, t in store.events("a") if "2 -> 1" in t]
    assert shrink and "(in-process)" in shrink[0], shrink  # a kept training: no restart
    reference = accuracy_alone(tmp_path, *args)
    assert reference > 0.85
    for n in ("a", "b"):
        acc = json.loads((tmp_path / f"{n}.json").read_text())["accuracy"]
        assert abs(acc - reference) < 0.03, (n, acc, reference)
    log = replica_logs(a_logs)
    assert "on 2 replicas" in log and "on 1 replicas" in log
    assert "rescaled 2 -> 1 workers" in log


def test_a_crashing_job_is_backed_off_then_failed_while_another_finishes(ray_cluster,
                                                                         tmp_path):
    store = st.Store(tmp_path)
    store.add_job(job(tmp_path, "crash", high=1, script=CRASH_SCRIPT))
    # checkpoint-restart form (torch.distributed's environment, no rescale store)
    store.add_job(job(tmp_path, "good", "--epochs", "2", high=1, rescale="restart"))
    loop = Loop(tmp_path)
    try:
        wait_for(lambda: all(state(store, n) in st.FINAL for n in ("crash", "good")), 150,
                 "both jobs to end")
    finally:
        loop.close(stop_jobs=True)
    assert state(store, "crash") == st.FAILED
    assert state(store, "good") == st.SUCCEEDED
    assert store.job("crash").failures == OPTS.max_failures
    texts = [t for _, _, t in store.events("crash")]
    assert any("retry in" in t for t in texts), texts
    assert "crashed" in texts[-1] and "failed after 2 crashes" in texts[-1]
    assert "crashing on purpose" in (tmp_path / "jobs" / "crash" / "logs"
                                     / "rank-0.log").read_text()
    assert json.loads((tmp_path / "good.json").read_text())["accuracy"] > 0.5


def test_the_autoscaler_request_reaches_ray(ray_cluster):
    from stratagem.service.autoscale import request_nodes

    # a live cluster accepts the request (locally no autoscaler acts on it); 0 withdraws it
    assert len(request_nodes(2, {"CPU": 1.0})) == 2
    assert request_nodes(0, {"CPU": 1.0}) == []


def test_a_drained_node_checkpoints_its_jobs_which_resume_after(ray_cluster, tmp_path):
    store = st.Store(tmp_path)
    store.add_job(job(tmp_path, "d", "--epochs", "3", "--step-sleep", "0.03", high=1))
    loop = Loop(tmp_path)
    try:
        hints = tmp_path / "jobs" / "d" / "ckpt" / "hints.json"
        wait_for(lambda: state(store, "d") == st.RUNNING and hints.is_file(), 90,
                 "d to train")
        node = ray_cluster.get_runtime_context().get_node_id()
        assert loop.scheduler.drain(node) == ["d"]
        assert state(store, "d") == st.PENDING and "d" not in store.allocations()
        saved = [p for p in (tmp_path / "jobs" / "d" / "ckpt").rglob("*")
                 if p.is_file() and p.name != "hints.json"]
        assert saved, "no checkpoint written on the drain notice"
        time.sleep(1.5)  # decisions while drained: nothing placed on the node
        assert state(store, "d") == st.PENDING
        loop.scheduler.undrain(node)
        wait_for(lambda: state(store, "d") in st.FINAL, 120, "d to finish")
    finally:
        loop.close(stop_jobs=True)
    assert state(store, "d") == st.SUCCEEDED and store.job("d").restarts == 1
    assert any("node drained" in t for _, _, t in store.events("d"))
    log = (tmp_path / "jobs" / "d" / "logs" / "rank-0.log").read_text()
    assert log.count("start d.g") == 2  # started, drained, started again


def replica_logs(directory: Path) -> str:
    return "\n".join(p.read_text() for p in sorted(directory.glob("rank-*.log")))


def wait_logged(cond, timeout: float, what: str, directory: Path) -> None:
    deadline = time.monotonic() + patience(timeout)
    while not cond():
        assert time.monotonic() < deadline, \
            f"timed out waiting for {what}:\n{replica_logs(directory)}"
        time.sleep(0.1)


def test_a_job_shrinks_and_grows_in_process_and_trains_as_alone(ray_cluster, tmp_path):
    ids = tmp_path / "ids"
    ids.mkdir()
    spec = parse_job({"name": "ip", "script": str(JOB_SCRIPT), "min_replicas": 1,
                      "max_replicas": 2, "resources": {"CPU": 1, "GPU": 1},
                      "args": [*INPROCESS_ARGS, "--ids", str(ids),
                               "--out", str(tmp_path / "ip.json")]})
    assert spec.in_process_rescale
    ckpt, log_dir = job_dirs(tmp_path, spec)
    backend = RayBackend(FAKE_GPU, start_timeout=patience(60.0), grace=patience(30.0))
    env = job_env(spec, ckpt)
    launched = backend.launch(spec, 2, 0, env, log_dir, in_process=True)
    try:
        assert backend.in_process(launched)
        wait_logged(lambda: "training on 2 replicas" in replica_logs(log_dir), 90,
                    "2 replicas", log_dir)
        launched = backend.resize(spec, launched, 1, env, log_dir)
        assert launched is not None and len(launched.actors) == 1
        wait_logged(lambda: "training on 1 replicas" in replica_logs(log_dir), 60,
                    "1 replica", log_dir)
        launched = backend.resize(spec, launched, 2, env, log_dir)
        assert launched is not None and len(launched.actors) == 2
        wait_logged(lambda: replica_logs(log_dir).count("training on 2 replicas") == 2, 90,
                 "the joiner", log_dir)
        wait_logged(lambda: all(c is not None for c in backend.poll(launched)), 120,
                 "the end", log_dir)
        assert backend.poll(launched) == [0, 0], replica_logs(log_dir)
    finally:
        backend.stop(launched, grace=0.0)
    assert backend._actor(store_name(launched)) is None  # the store went with the job
    text = replica_logs(log_dir)
    assert text.count("--- ") == 3, text  # two replicas started, one added: no restart
    assert "niceness" not in text, text  # normal priority, as `cluster up` starts Ray
    assert "rescaled 2 -> 1 workers" in text and "rescaled 1 -> 2 workers" in text, text
    # every sample exactly once per epoch, whatever the world size at each step
    seen: dict[int, list[int]] = {}
    worlds = set()
    for f in ids.glob("ids-*.jsonl"):
        for line in f.read_text().splitlines():
            rec = json.loads(line)
            seen.setdefault(rec["epoch"], []).extend(rec["ids"])
            worlds.add(rec["world"])
    assert worlds == {1, 2}
    assert sorted(seen) == [0, 1, 2, 3]
    for epoch, got in seen.items():
        assert sorted(got) == list(range(1024)), f"epoch {epoch}: a sample lost or repeated"
    # the same parameters as one process training alone at the same global batch
    alone = tmp_path / "alone.json"
    subprocess.run([sys.executable, str(JOB_SCRIPT), "--epochs", "4", "--out", str(alone)],
                   check=True, capture_output=True, timeout=patience(120))
    want, got = (json.loads(p.read_text()) for p in (alone, tmp_path / "ip.json"))
    assert len(got["params"]) == len(want["params"]) == 420
    assert max(abs(a - b) for a, b in zip(got["params"], want["params"], strict=True)) < 1e-4
    assert got["accuracy"] == pytest.approx(want["accuracy"], abs=0.005)


GPU_VIEW = """
import json, os
from types import SimpleNamespace
import torch
from stratagem import env
from stratagem.autodist import AutoDist
from stratagem.resource import ResourceSpec

visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
torch.cuda.is_available = lambda: bool(visible)  # Ray's GPUs here are declared, not real:
torch.cuda.device_count = lambda: len(visible.split(","))  # see what a real one would show
torch.cuda.set_device = lambda index: None
world = int(os.environ["WORLD_SIZE"])
spec = ResourceSpec.of_job(world, env.job_nodes(world))
device = AutoDist._pick_device(SimpleNamespace(resource_spec=spec,
                                               local_rank=int(os.environ["LOCAL_RANK"])))
print("view", json.dumps({"visible": visible, "nodes": len(spec.nodes), "device": str(device),
                          "node": env.job_node_rank(int(os.environ["RANK"]), world,
                                                    len(spec.nodes))}), flush=True)
"""


def test_replicas_on_real_gpus_each_train_on_the_gpu_ray_gave_them(ray_cluster, tmp_path):
    """With the cluster's GPU resource, Ray shows each replica only its own GPU; the worker
    counts as a node of its own with one worker, so it trains on that GPU (``cuda:0``)
    rather than on the CPU of "one machine with one GPU and two workers"."""
    script = tmp_path / "view.py"
    script.write_text(GPU_VIEW)
    spec = parse_job({"name": "gpus", "script": str(script), "min_replicas": 2,
                      "max_replicas": 2, "resources": {"CPU": 1, "GPU": 1}})
    ckpt, log_dir = job_dirs(tmp_path, spec)
    backend = RayBackend("GPU", start_timeout=patience(60.0), grace=5.0)
    launched = backend.launch(spec, 2, 0, job_env(spec, ckpt), log_dir)
    try:
        wait_logged(lambda: all(c is not None for c in backend.poll(launched)), 90,
                    "the end", log_dir)
        assert backend.poll(launched) == [0, 0], replica_logs(log_dir)
    finally:
        backend.stop(launched, grace=0.0)
    views = [json.loads(line.split(" ", 1)[1]) for line in replica_logs(log_dir).splitlines()
             if line.startswith("view ")]
    assert sorted(v["visible"] for v in views) == ["0", "1"], views
    assert sorted(v["node"] for v in views) == [0, 1]
    assert all(v["nodes"] == 2 and v["device"] == "cuda:0" for v in views), views

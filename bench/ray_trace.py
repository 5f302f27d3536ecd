"""A small trace of real adaptive jobs on a local Ray cluster: goodput-aware vs FIFO.

``--jobs`` short jobs (examples/cluster/classify.py, 1-``--max-replicas`` replicas, epochs
2-4) arrive every ``--gap`` seconds on a local Ray cluster whose ``--gpus`` CPU workers are
presented as fake GPUs (a custom resource). The same trace runs under the ``pollux`` policy
with in-process rescale where it applies (``rescale: auto``, the default), under ``pollux``
with every resize a checkpoint-restart (``rescale: restart``, the baseline), and under
``fifo`` (each job gets the replicas it asks for, first come first served).
Reported: mean and max job completion time, and the scheduler's overhead: for every resize
or start, the seconds from the decision until the job's first training step at the new
size (its rank 0 prints that moment), split by how it was done: ``in-process`` shrink and
grow, ``restart`` (checkpoint-restart) and ``start`` (a job's first start).

Then a direct probe of the two ways to resize (``--probe-rounds``, interleaved): one job of
2 replicas is shrunk to 1 and grown back to 2, in-process (``RayBackend.resize``) and by
checkpoint-restart (stop, which saves; launch at the new size, which restores); the seconds
from the call to the first step at the new size.

    python bench/ray_trace.py [--jobs 8] [--gpus 4] [--out bench/results/ray_trace.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import tempfile
import threading
import time
from pathlib import Path

import ray

from stratagem.service import store as st
from stratagem.service.jobfile import parse_job
from stratagem.service.ray_backend import RayBackend
from stratagem.service.scheduler import Scheduler, SchedulerOptions, job_dirs, job_env

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "cluster" / "classify.py"
TRAINING = re.compile(r"training on (\d+) replicas at ([0-9.]+)")


def trace(jobs: int, max_replicas: int, rescale: str) -> list[dict]:
    return [{"name": f"j{i}", "script": str(SCRIPT), "min_replicas": 1,
             "max_replicas": max_replicas, "resources": {"CPU": 1, "GPU": 1},
             "args": ["--epochs", str(2 + i % 3), "--step-sleep", "0.02", "--adaptive"],
             "rescale": rescale} for i in range(jobs)]


def summary(values: list[float]) -> dict:
    return {"n": len(values), "median": statistics.median(values) if values else None,
            "max": max(values, default=None)}


def replay(policy: str, jobs: list[dict], gap: float, directory: Path) -> dict:
    store = st.Store(directory)
    opts = SchedulerOptions(policy=policy, interval=1.0, restart_delay=5.0, grace=30.0,
                            gpu_resource="fake_gpu")
    sched = Scheduler(directory, opts)
    stop = threading.Event()
    thread = threading.Thread(target=sched.run, args=(stop,), daemon=True)
    thread.start()
    t0 = time.time()
    try:
        for job in jobs:
            store.add_job(parse_job(job))
            time.sleep(gap)
        while any(j.state not in st.FINAL for j in store.jobs()):
            time.sleep(0.5)
    finally:
        stop.set()
        thread.join()
    rows = store.jobs()
    jct = [j.finished - j.submitted for j in rows if j.state == st.SUCCEEDED]
    overhead: dict[str, list[float]] = {}
    for decided, name, old, new, how in sched.resizes:
        starts = []
        for log in (directory / "jobs" / name / "logs").glob("rank-*.log"):
            starts += [(float(t), int(n)) for n, t in TRAINING.findall(log.read_text())]
        after = [t for t, n in starts if t > decided and n == new]
        if new and after:
            kind = how if how != "in-process" else ("shrink" if new < old else "grow")
            overhead.setdefault(kind, []).append(min(after) - decided)
    return {"policy": policy, "rescale": jobs[0]["rescale"], "completed": len(jct),
            "failed": sum(j.state != st.SUCCEEDED for j in rows),
            "mean_jct_s": statistics.mean(jct) if jct else None,
            "max_jct_s": max(jct, default=None),
            "makespan_s": max(j.finished or t0 for j in rows) - t0,
            "restarts": sum(j.restarts for j in rows), "decisions": len(sched.decisions),
            "decision_to_training_s": {k: summary(v) for k, v in sorted(overhead.items())}}


def first_step_at(log_dir: Path, replicas: int, after: float, timeout: float = 300) -> float:
    """When a job's rank 0 first trained on ``replicas`` after ``after`` (waits for it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for log in log_dir.glob("rank-*.log"):
            hits = [float(t) for n, t in TRAINING.findall(log.read_text())
                    if int(n) == replicas and float(t) > after]
            if hits:
                return min(hits)
        time.sleep(0.05)
    raise TimeoutError(f"no step on {replicas} replicas in {log_dir}")


def probe(rounds: int, directory: Path) -> dict:
    """Shrink 2 -> 1 and grow 1 -> 2, in-process and by checkpoint-restart, interleaved."""
    backend = RayBackend("fake_gpu", start_timeout=300.0, grace=60.0)
    out: dict[str, list[float]] = {}
    for r in range(rounds):
        for rescale in ("auto", "restart"):
            spec = parse_job({"name": f"probe-{rescale}-{r}", "script": str(SCRIPT),
                              "min_replicas": 1, "max_replicas": 2, "rescale": rescale,
                              "resources": {"CPU": 1, "GPU": 1},
                              "args": ["--epochs", "200", "--step-sleep", "0.05"]})
            ckpt, logs = job_dirs(directory, spec)
            env = job_env(spec, ckpt)
            launched = backend.launch(spec, 2, 0, env, logs, in_process=rescale == "auto")
            try:
                first_step_at(logs, 2, 0.0)
                time.sleep(1.0)  # a few steps at 2
                for new in (1, 2):
                    t0 = time.time()
                    if rescale == "auto":
                        resized = backend.resize(spec, launched, new, env, logs)
                        if resized is None:
                            raise RuntimeError("in-process resize did not apply")
                        launched = resized
                    else:
                        backend.stop(launched)
                        launched = backend.launch(spec, new, new, env, logs)
                    took = first_step_at(logs, new, t0) - t0
                    kind = ("in-process " if rescale == "auto" else "restart ") + (
                        "shrink" if new == 1 else "grow")
                    out.setdefault(kind, []).append(took)
                    print(f"  probe {kind}: {took:.2f} s", flush=True)
                    time.sleep(1.0)
            finally:
                backend.stop(launched, grace=0.0)
    return {k: summary(v) | {"values": v} for k, v in sorted(out.items())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, default=8)
    p.add_argument("--gpus", type=int, default=4)
    p.add_argument("--max-replicas", type=int, default=2)
    p.add_argument("--gap", type=float, default=4.0, help="seconds between submissions")
    p.add_argument("--runs", default="pollux:auto,pollux:restart,fifo:auto",
                   help="policy:rescale pairs, replayed in this order")
    p.add_argument("--probe-rounds", type=int, default=2)
    p.add_argument("--out", default="bench/results/ray_trace.json")
    a = p.parse_args()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(address="local", num_cpus=a.gpus, resources={"fake_gpu": a.gpus},
             include_dashboard=False, log_to_driver=False, object_store_memory=80 * 1024 * 1024)
    results = []
    load = [os.getloadavg()[0]]
    try:
        for run in filter(None, a.runs.split(",")):
            policy, rescale = run.split(":")
            with tempfile.TemporaryDirectory() as tmp:
                r = replay(policy, trace(a.jobs, a.max_replicas, rescale), a.gap, Path(tmp))
            load.append(os.getloadavg()[0])
            results.append(r)
            d = ", ".join(f"{k} median {v['median']:.2f} s max {v['max']:.2f} s (n={v['n']})"
                          for k, v in r["decision_to_training_s"].items())
            print(f"{policy:>7}/{rescale:<7}: mean JCT {r['mean_jct_s']:.1f} s, max "
                  f"{r['max_jct_s']:.1f} s, makespan {r['makespan_s']:.1f} s, restarts "
                  f"{r['restarts']}; decision-to-training: {d}", flush=True)
        probed = {}
        if a.probe_rounds:
            with tempfile.TemporaryDirectory() as tmp:
                probed = probe(a.probe_rounds, Path(tmp))
            load.append(os.getloadavg()[0])
    finally:
        ray.shutdown()
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"load average (1 min) before and after each run: {load}")
    out.write_text(json.dumps({"machine": {"cpus": os.cpu_count(), "python":
                                           platform.python_version(), "loadavg_1min": load},
                               "options": vars(a), "results": results,
                               "resize_probe_s": probed}, indent=1) + "\n")


if __name__ == "__main__":
    main()

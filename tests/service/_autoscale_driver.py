"""The driver of test_service_fake_autoscaler (its own process): a scheduler with autoscaling
on the fake autoscaling cluster at ADDRESS; prints what it saw as one JSON line.

    python _autoscale_driver.py ADDRESS DIR FAKE_GPU JOB_SCRIPT
"""

from __future__ import annotations

import json
import sys
import time

import ray

from stratagem.service import store as st
from stratagem.service.autoscale import AutoscaleOptions, request_nodes
from stratagem.service.jobfile import parse_job
from stratagem.service.ray_backend import Launched
from stratagem.service.scheduler import Scheduler, SchedulerOptions


def gpu_nodes(gpu: str) -> list[dict]:
    return [n for n in ray.nodes() if n["Alive"] and n["Resources"].get(gpu)]


def main() -> None:
    address, directory, gpu, script = sys.argv[1:5]
    ray.init(address=address, namespace="stratagem", log_to_driver=False)
    seen: dict = {"before": len(gpu_nodes(gpu))}
    opts = SchedulerOptions(interval=0.5, gpu_resource=gpu, start_timeout=60.0, grace=5.0,
                            min_runtime=0.0,
                            autoscale=AutoscaleOptions(node_cost=0.5, max_nodes=2,
                                                       node_gpus=2))
    sched = Scheduler(directory, opts)
    sched.store.add_job(parse_job({
        "name": "wide", "script": script, "min_replicas": 4, "max_replicas": 4,
        "resources": {"CPU": 0, "GPU": 1}, "adaptive": False,
        "args": ["--epochs", "50", "--step-sleep", "0.05"]}))
    sched.step()
    seen["target"] = sched.autoscale_target
    deadline = time.monotonic() + 200
    while len(gpu_nodes(gpu)) < 2 or sched.store.job("wide").state != st.RUNNING:
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out: {gpu_nodes(gpu)} {sched.store.events('wide')}")
        time.sleep(1.0)
        sched.step()
    nodes = gpu_nodes(gpu)
    seen["up"] = sorted(n["Resources"][gpu] for n in nodes)
    seen["job_state"] = sched.store.job("wide").state
    alloc = sched.store.allocations()["wide"]
    launched = Launched(alloc.group_name or "", alloc.actors)
    seen["job_on_new_nodes"] = (sched.backend.actor_nodes(launched)
                                == {n["NodeID"] for n in nodes})
    sched.store.request_delete("wide")
    sched.step()
    request_nodes(0, {gpu: 2.0})  # withdraw: idle nodes go after idle_timeout_minutes
    deadline = time.monotonic() + 150
    while gpu_nodes(gpu) and time.monotonic() < deadline:
        time.sleep(1.0)
    seen["after_withdraw"] = len(gpu_nodes(gpu))
    ray.shutdown()
    print(json.dumps(seen))


if __name__ == "__main__":
    main()

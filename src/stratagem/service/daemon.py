"""The scheduler process: connect to Ray, serve the control plane, step until SIGTERM.

``python -m stratagem.service.daemon --dir DIR --address HOST:PORT [...]``; started by
``stratagem cluster up``, beside the head it starts (``--head-log``: it imports meanwhile,
then waits for the head). The control plane serves the store's requests from the start;
``status`` and ``drain`` wait (at most 30 s) until Ray is connected. Stopping it leaves the
jobs running (their workers are detached Ray actors); the next daemon on the same directory
takes them over.
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading
import time
from pathlib import Path

from stratagem.service.autoscale import AutoscaleOptions
from stratagem.service.scheduler import Scheduler, SchedulerOptions


def cluster_status(ray, gpu_resource: str) -> dict:
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    return {"address": ray.get_runtime_context().gcs_address, "gpu_resource": gpu_resource,
            "nodes": [{"id": n["NodeID"], "ip": n.get("NodeManagerAddress"),
                       "resources": {k: v for k, v in n.get("Resources", {}).items()
                                     if not k.startswith(("node:", "object_store",
                                                          "memory", "accelerator_type"))}}
                      for n in nodes]}


def wait_for_head(log: Path, timeout: float) -> None:
    """Until the local head's ``ray start`` reports it started (``cluster up`` starts this
    process beside the head, so that the imports overlap the head's start)."""
    from stratagem.service.cluster import HEAD_READY

    deadline = time.monotonic() + timeout
    while True:
        try:
            if HEAD_READY in log.read_text(errors="replace"):
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"the Ray head did not start within {timeout:g} s (see {log})")
        time.sleep(0.1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="stratagem-scheduler")
    p.add_argument("--dir", required=True)
    p.add_argument("--address", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--token-file")
    p.add_argument("--policy", default="pollux")
    p.add_argument("--interval", type=float, default=5.0)
    p.add_argument("--restart-delay", type=float, default=30.0)
    p.add_argument("--gpu-resource", default="GPU")
    p.add_argument("--min-runtime", type=float, default=60.0)
    p.add_argument("--node-cost", type=float, help="autoscale: speedup a node must add")
    p.add_argument("--max-nodes", type=int, default=16)
    p.add_argument("--node-gpus", type=int, default=1,
                   help="autoscale: accelerators of a node the autoscaler adds")
    p.add_argument("--head-log", help="wait for the local head's start in this log first")
    p.add_argument("--head-timeout", type=float, default=120.0)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    import ray

    from stratagem.errors import StratagemError
    from stratagem.service.api import ControlServer

    # The control plane answers (submit, ls, logs, delete: the store) while Ray connects;
    # ``up`` returns once it does. Status and drain need Ray: they wait for it (bounded).
    ready: dict = {}
    connected = threading.Event()

    def needs_ray(what: str):
        if not connected.wait(timeout=30.0):
            raise StratagemError(f"the scheduler is still connecting to Ray; no {what} yet",
                                 where="cluster service", fix="try again in a few seconds; "
                                 "see scheduler.log in the cluster directory")
        return ready["scheduler"]

    token = Path(a.token_file).read_text().strip() if a.token_file else None
    server = ControlServer(
        a.dir, a.host, a.port, token,
        status=lambda: (needs_ray("status"), cluster_status(ray, a.gpu_resource))[1],
        drain=lambda node: needs_ray("drain").drain(node))
    try:
        if a.head_log:
            wait_for_head(Path(a.head_log), a.head_timeout)
        ray.init(address=a.address, namespace="stratagem", log_to_driver=False)
        scale = (AutoscaleOptions(node_cost=a.node_cost, max_nodes=a.max_nodes,
                                  node_gpus=a.node_gpus)
                 if a.node_cost is not None else None)
        options = SchedulerOptions(policy=a.policy, interval=a.interval,
                                   restart_delay=a.restart_delay,
                                   gpu_resource=a.gpu_resource, min_runtime=a.min_runtime,
                                   autoscale=scale)
        scheduler = ready["scheduler"] = Scheduler(a.dir, options)
        connected.set()
    except BaseException:
        server.close()
        raise
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    logging.info("scheduler on %s, control plane on %s:%d", a.address, a.host,
                 server.server_address[1])
    try:
        scheduler.run(stop)
    finally:
        server.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

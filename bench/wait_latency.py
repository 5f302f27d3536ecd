#!/usr/bin/env python3
"""How long a worker waits for a small message on the virtual cluster: the floor under the
cost model's fixed costs, and how much it moves.

A step of a small model is a handful of such waits (an all-reduce group's, a parameter-server
bucket's push and pull, a sparse exchange's rounds). On this machine (a virtual machine, two
vCPUs, each node pinned to one, as bench/auto_strategy.py pins them) a thread woken by its
peer's message may run at once, or only when the core's running thread gives way: the same
exchange in the same processes reads either. This measures the distribution, one worker per
node, every kind interleaved in a seeded order per repeat:

* ``allreduce_1kib``: a 1 KiB all-reduce after a barrier (one group launched alone);
* ``bucket_round_1kib``: a dense parameter-server bucket's round, the runtime's order (the
  owner's receives posted, every other worker's push, then the values sent back);
* ``allreduce_1kib_busy``: the all-reduce while a thread of the same process runs 256x256
  matmuls (a backward pass beside the gradient hook that launched it);
* ``compute_1ms``: the matmul loop alone, about 1 ms (how much a core's own work moves).

Per kind: median, 10th and 90th percentiles, the largest, the share of repeats over 1 ms, and
the ratio of the 90th percentile to the median (the spread a prediction of one number meets).
JSON to bench/results/wait_latency.json. Needs root (the virtual cluster).

    python bench/wait_latency.py                        # 2 and 4 nodes, 10 Gbit/s
    python bench/wait_latency.py --nodes 2 --repeats 100 --bandwidth 1gbit
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from vcluster_host import pinned_cpus, virtual_cluster

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "results" / "wait_latency.json"
KINDS = ("allreduce_1kib", "bucket_round_1kib", "allreduce_1kib_busy", "compute_1ms")
KIB = 256  # float32 elements in 1 KiB


def summary(times_s: list[float]) -> dict[str, float]:
    """Median, 10th/90th percentiles and largest (ms), share over 1 ms, p90 / median."""
    ms = sorted(t * 1e3 for t in times_s)
    q = statistics.quantiles(ms, n=10, method="inclusive")
    med = statistics.median(ms)
    return {"median_ms": round(med, 4), "p10_ms": round(q[0], 4), "p90_ms": round(q[-1], 4),
            "max_ms": round(ms[-1], 4), "over_1ms": round(sum(t > 1.0 for t in ms) / len(ms), 3),
            "p90_over_median": round(q[-1] / med, 2) if med > 0 else 0.0}


# -- worker (one per node, under `stratagem run`) -------------------------------------------
def _bucket_round(dist: Any, buf: Any, inbox: list[Any]) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        works = [dist.irecv(inbox[m], m, tag=11) for m in range(1, world)]
    else:
        works = [dist.isend(buf, 0, tag=11)]
    for w in works:
        w.wait()
    if rank == 0:
        works = [dist.isend(buf, m, tag=12) for m in range(1, world)]
    else:
        works = [dist.irecv(buf, 0, tag=12)]
    for w in works:
        w.wait()


def worker(args: argparse.Namespace) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    small = torch.zeros(KIB)
    inbox = [torch.zeros(KIB) for _ in range(world)]
    a = torch.randn(64, 64)
    # the matmul count that takes about 1 ms here (the same on every rank: the max)
    s = time.perf_counter()
    for _ in range(200):
        a @ a
    per_ms = torch.tensor([max(1, int(200 * 1e-3 / (time.perf_counter() - s)))])
    dist.all_reduce(per_ms, op=dist.ReduceOp.MAX)
    n_mm = int(per_ms)

    def compute() -> None:
        for _ in range(n_mm):
            a @ a

    big = torch.randn(256, 256)  # each product releases the GIL for most of its time

    def busy_allreduce() -> float:
        stop = threading.Event()

        def loop() -> None:
            while not stop.is_set():
                big @ big

        t = threading.Thread(target=loop, daemon=True)
        t.start()
        time.sleep(0.002)  # the loop is running when the all-reduce starts
        s = time.perf_counter()
        dist.all_reduce(small)
        took = time.perf_counter() - s
        stop.set()
        t.join()
        return took

    def timed(kind: str) -> float:
        dist.barrier()
        if kind == "allreduce_1kib_busy":
            return busy_allreduce()
        s = time.perf_counter()
        if kind == "allreduce_1kib":
            dist.all_reduce(small)
        elif kind == "bucket_round_1kib":
            _bucket_round(dist, small, inbox)
        else:
            compute()
        return time.perf_counter() - s

    for kind in KINDS:  # warm-up: connections, allocator
        timed(kind)
    times: dict[str, list[float]] = {k: [] for k in KINDS}
    rng = random.Random(args.seed)
    for _ in range(args.repeats):
        order = list(KINDS)
        rng.shuffle(order)  # the same order on every rank (same seed)
        for kind in order:
            took = torch.tensor([timed(kind)], dtype=torch.float64)
            dist.all_reduce(took, op=dist.ReduceOp.MAX)  # the slowest rank's, as a step's
            times[kind].append(float(took))
    if rank == 0:
        Path(args.out).write_text(json.dumps(times))
    dist.destroy_process_group()


# -- driver ---------------------------------------------------------------------------------
def driver(args: argparse.Namespace) -> int:
    VirtualCluster = virtual_cluster()
    if VirtualCluster is None:
        return 0
    cases: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for nodes in args.nodes:
            cpus = pinned_cpus(nodes)
            for bw in args.bandwidth:
                part = Path(tmp) / f"{nodes}_{bw}.json"
                load0 = os.getloadavg()[0]
                with VirtualCluster(nodes, bandwidth=bw, cpus=cpus, prefix=args.prefix,
                                    subnet=args.subnet) as vc:
                    spec = vc.write_resource_spec(Path(tmp) / "spec.yml")
                    shell = (f"{sys.executable} {ROOT / 'tools' / 'vcluster.py'} exec "
                             f"--prefix {args.prefix} {{address}} --")
                    argv = [sys.executable, "-m", "stratagem", "run", "-q", "--resource-spec",
                            str(spec), "--remote-shell", shell, str(Path(__file__).resolve()),
                            "--worker", "--out", str(part), "--repeats", str(args.repeats),
                            "--seed", str(args.seed)]
                    proc = vc.run(0, argv)
                    try:
                        rc = proc.wait(timeout=args.timeout)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        rc = 124
                if rc != 0 or not part.exists():
                    print(f"{nodes} nodes, {bw}: failed (exit {rc})")
                    return rc or 1
                times = json.loads(part.read_text())
                key = f"{nodes}n/{bw}"
                cases[key] = {"nodes": nodes, "link": bw, "repeats": args.repeats,
                              "pinning": cpus, "kinds": {k: summary(v) for k, v in times.items()},
                              "host": {"loadavg_1m_start": round(load0, 2),
                                       "loadavg_1m_end": round(os.getloadavg()[0], 2)}}
                print(f"{key}: " + ", ".join(
                    f"{k} {s['median_ms']:.2f} ms (p10 {s['p10_ms']:.2f}, p90 {s['p90_ms']:.2f},"
                    f" >1 ms {s['over_1ms']:.0%})" for k, s in cases[key]["kinds"].items()))
    result = {"benchmark": "wait_latency", "cases": cases,
              "host": {"cpus": os.cpu_count(), "python": platform.python_version(),
                       "kernel": platform.release()},
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--nodes", type=int, nargs="+", default=[2, 4])
    p.add_argument("--bandwidth", nargs="+", default=["10gbit"])
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prefix", default="sgwait")
    p.add_argument("--subnet", default="10.87.0.0/24")
    p.add_argument("--timeout", type=int, default=600, help="per cluster case (s)")
    p.add_argument("--out", default=str(OUT))
    args = p.parse_args()
    if args.worker:
        worker(args)
        return 0
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())

"""Scheduling policies on the eight 160-job Pollux workloads (16 nodes x 4 GPUs, 60 s).

For every workload and policy: mean, median and p99 JCT, makespan, GPU utilization, policy
decision time per interval and the wall time of the whole simulation. Separately, the
goodput-aware policy's decision time with all 160 jobs of a workload active at once (cold:
a fresh policy, no cache; warm: the next decision from that allocation). CPU only.

    nice -n 10 python bench/sched_sim.py [--data DIR] [--workloads 1,2] [--policies all]

Data: ``--data``, else ``$STRATAGEM_POLLUX_DATA``, else the copy bundled with the package.
Results: bench/results/sched_sim.json and bench/results/sched_sim/*.png.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from stratagem.sched.policy import POLICIES, PolluxPolicy, make_policy
from stratagem.sched.simulator.bundled import POLLUX_DIR
from stratagem.sched.simulator.engine import SimOptions, simulate
from stratagem.sched.simulator.job import SimJob
from stratagem.sched.simulator.profile import load_profiles
from stratagem.sched.simulator.report import plot_allocation, plot_jct_cdf, summarize
from stratagem.sched.simulator.workload import load_workload

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
# Pollux paper (OSDI 2021), its simulator, TunedJobs baselines: mean JCT in seconds.
PUBLISHED = {"pollux": 2751.0, "tiresias": 4038.0, "optimus": 5682.0}


def data_dir(arg: str | None) -> Path:
    path = Path(arg or os.environ.get("STRATAGEM_POLLUX_DATA") or POLLUX_DIR)
    if not (path / "profiles").is_dir():
        sys.exit(f"Pollux data set not found at {path}: pass --data DIR")
    return path


def decision_at_full_load(specs, profiles, options: SimOptions) -> dict[str, float]:
    """Goodput-aware decisions with every job of the workload active (at its start)."""
    cluster = options.cluster
    jobs = [SimJob(s, profiles[s.application], adaptive=True, restart_delay=30.0,
                   total_gpus=cluster.total_gpus) for s in specs]
    views = [j.view(3600.0) for j in jobs]
    policy = PolluxPolicy()
    t0 = time.perf_counter()
    first = policy.allocate(views, cluster, {}, 3600.0)
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    policy.allocate(views, cluster, first, 3660.0)
    warm = time.perf_counter() - t0
    return {"jobs": len(views), "cold_s": cold, "warm_s": warm,
            "gpus_used": sum(map(len, first.values())), "jobs_allocated": len(first)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data")
    ap.add_argument("--workloads", default="1,2,3,4,5,6,7,8")
    ap.add_argument("--policies", default="all")
    ap.add_argument("--out", default=str(RESULTS / "sched_sim.json"))
    args = ap.parse_args()
    data = data_dir(args.data)
    names = list(POLICIES) if args.policies == "all" else args.policies.split(",")
    options = SimOptions(num_nodes=16, gpus_per_node=4, interval=60.0)
    plots = RESULTS / "sched_sim"
    plots.mkdir(parents=True, exist_ok=True)
    profiles = load_profiles(data / "profiles")
    for p in profiles.values():  # fit once, outside the timed runs
        _ = p.throughput_params
    runs, pooled, full_load = [], {n: [] for n in names}, []
    for w in args.workloads.split(","):
        wname = f"workload-{w}"
        specs = load_workload(data / "workloads-realistic" / f"{wname}.csv")
        jcts = {}
        for pname in names:
            result = simulate(specs, profiles, make_policy(pname), options, wname)
            s = summarize(result)
            runs.append(s)
            jcts[pname] = [j.jct for j in result.jobs if j.jct is not None]
            pooled[pname] += jcts[pname]
            if w == "1":
                plot_allocation(result, plots / f"allocation_{wname}_{pname}.png")
            print(f"{wname} {pname:9s} mean JCT {s['mean_jct']:8.0f} s  p99 "
                  f"{s['p99_jct']:8.0f} s  util {s['gpu_utilization']:.2f}  decide "
                  f"{1e3 * s['decision_mean_s']:.1f}/{1e3 * s['decision_max_s']:.0f} ms  "
                  f"wall {s['wall_seconds']:.1f} s", flush=True)
        if "pollux" in names:
            full_load.append({"workload": wname,
                              **decision_at_full_load(specs, profiles, options)})
    plot_jct_cdf(pooled, plots / "jct_cdf_all.png",
                 title=f"JCT CDF, {len(args.workloads.split(','))} workloads pooled")
    per_policy = {}
    for pname in names:
        mine = [r for r in runs if r["policy"] == pname]
        per_policy[pname] = {
            "mean_jct": statistics.mean(r["mean_jct"] for r in mine),
            "p99_jct": statistics.mean(r["p99_jct"] for r in mine),
            "makespan": statistics.mean(r["makespan"] for r in mine),
            "gpu_utilization": statistics.mean(r["gpu_utilization"] for r in mine),
            "decision_mean_s": statistics.mean(r["decision_mean_s"] for r in mine),
            "decision_max_s": max(r["decision_max_s"] for r in mine),
            "wall_max_s": max(r["wall_seconds"] for r in mine),
            "completed": sum(r["completed"] for r in mine),
            "jobs": sum(r["jobs"] for r in mine)}
    improvement = {}
    if "pollux" in per_policy:
        ours = per_policy["pollux"]["mean_jct"]
        improvement = {f"pollux_vs_{p}": 1 - ours / v["mean_jct"]
                       for p, v in per_policy.items() if p != "pollux"}
        improvement["published_pollux_vs_tiresias"] = 1 - PUBLISHED["pollux"] / PUBLISHED[
            "tiresias"]
        improvement["published_pollux_vs_optimus"] = 1 - PUBLISHED["pollux"] / PUBLISHED[
            "optimus"]
    out = {"options": {"nodes": 16, "gpus_per_node": 4, "interval": 60.0,
                       "restart_delay": 30.0},
           "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
           "per_policy": per_policy, "improvement": improvement, "published": PUBLISHED,
           "decision_at_full_load": full_load, "runs": runs}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({"per_policy": per_policy, "improvement": improvement,
                      "full_load": full_load}, indent=1))
    if full_load:
        cold = max(f["cold_s"] for f in full_load)
        warm = max(f["warm_s"] for f in full_load)
        print(f"full-load decision: cold max {cold:.3f} s, warm max {warm:.3f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

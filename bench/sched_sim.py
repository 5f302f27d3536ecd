"""Scheduling policies on the eight 160-job Pollux workloads (16 nodes x 4 GPUs, 60 s), at
several arrival-rate load factors, on equal information.

For every workload, load factor and policy: mean, median and p99 JCT, makespan, GPU
utilization, decision time per interval (wall clock, and the process's CPU time, which a
loaded machine does not inflate) and the wall time of the simulation. By default no job
knows its throughput model in advance (each learns it from what it runs; ``--oracle`` gives
every job its application's full-profile model instead). All policies run interleaved in one
process: load by load (so a cut-short run has every workload at the first loads),
workload by workload. Separately, the decision time of the
goodput-aware policy and of the Pollux baseline with all 160 jobs of a workload active (cold:
a fresh policy; warm: the next decision from that allocation). Optional sweeps of the
interval, restart delay and fairness exponent (goodput-aware vs Pollux baseline, one workload).

    nice -n 19 python bench/sched_sim.py [--workloads 1,2] [--loads 0.5,1,1.5,2]
                                         [--policies all] [--sweeps] [--oracle]
    python bench/sched_sim.py --merge a.json b.json --out grid.json   # cells run apart

Every simulation is deterministic, so cells may run in separate processes (one policy, load
or workload each) and be merged: ``--merge`` takes the runs of several result files (a later
file's run replaces an earlier one of the same policy, load and workload) and writes one
file with the per-load aggregates over them, each run naming the file it came from.

Data: ``--data``, else ``$STRATAGEM_POLLUX_DATA``, else the copy bundled with the package.
Results (rewritten after every run, so a cut-short run keeps what it did):
bench/results/sched_sim.json and bench/results/sched_sim/*.png.
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

from stratagem.sched.policy import POLICIES, make_policy
from stratagem.sched.simulator.bundled import POLLUX_DIR
from stratagem.sched.simulator.engine import SimOptions, simulate
from stratagem.sched.simulator.job import SimJob
from stratagem.sched.simulator.profile import load_profiles
from stratagem.sched.simulator.report import plot_allocation, summarize
from stratagem.sched.simulator.workload import load_workload

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
# Pollux paper (OSDI 2021), its simulator, TunedJobs baselines: mean JCT in seconds.
PUBLISHED = {"pollux": 2751.0, "tiresias": 4038.0, "optimus": 5682.0}
OURS, BASELINE = "pollux", "pollux-paper"


def data_dir(arg: str | None) -> Path:
    path = Path(arg or os.environ.get("STRATAGEM_POLLUX_DATA") or POLLUX_DIR)
    if not (path / "profiles").is_dir():
        sys.exit(f"Pollux data set not found at {path}: pass --data DIR")
    return path


def policy(name: str, args: argparse.Namespace, **extra):
    if name == BASELINE:
        extra = {"population": args.ga_population, "generations": args.ga_generations, **extra}
    return make_policy(name, **extra)


def decision_at_full_load(specs, profiles, options: SimOptions, args) -> dict[str, float]:
    """Both Pollux-style policies deciding with every job of the workload active, each job
    having run one epoch-free first interval on 1 GPU (so each has a learned model)."""
    cluster = options.cluster
    jobs = [SimJob(s, profiles[s.application], adaptive=True, restart_delay=30.0,
                   total_gpus=cluster.total_gpus, oracle=options.oracle) for s in specs]
    for j in jobs:  # one interval on one GPU: a first timing to learn from
        j.allocate((0,), 0.0)
        j.advance(0.0, 60.0)
        j.allocate((), 60.0)
    views = [j.view(3600.0, options.capped) for j in jobs]
    out: dict[str, float] = {"jobs": len(views)}
    for name in (OURS, BASELINE):
        pol = policy(name, args)
        t0, c0 = time.perf_counter(), time.process_time()
        first = pol.allocate(views, cluster, {}, 3600.0)
        out[f"{name}_cold_s"] = time.perf_counter() - t0
        out[f"{name}_cold_cpu_s"] = time.process_time() - c0
        t0, c0 = time.perf_counter(), time.process_time()
        pol.allocate(views, cluster, first, 3660.0)
        out[f"{name}_warm_s"] = time.perf_counter() - t0
        out[f"{name}_warm_cpu_s"] = time.process_time() - c0
        out[f"{name}_gpus_used"] = sum(map(len, first.values()))
    return out


def alone_reference(specs, profiles) -> dict:
    """Each job of a workload alone on the cluster under the goodput-aware policy (the
    cluster is its own, so no policy can give it more): mean JCT with the job's model learned
    online (equal information) and with the oracle model (uncapped growth). A reference for
    what contention costs at low load, not a strict bound."""
    out: dict = {}
    for oracle in (False, True):
        key = "oracle" if oracle else "learned"
        jcts = [simulate([s], profiles, make_policy(OURS),
                         SimOptions(oracle=oracle, explore_cap=not oracle)).jobs[0].jct
                for s in specs]
        out[f"{key}_mean_jct"] = statistics.mean(jcts)
        out[f"{key}_jobs"] = dict(zip((s.name for s in specs), jcts, strict=True))
    return out


def aggregate(runs: list[dict], names: list[str], loads: list[float]) -> dict:
    per_load: dict[str, dict] = {}
    for load in loads:
        rows = {}
        for pname in names:
            mine = [r for r in runs if r["policy"] == pname and r["load"] == load]
            if not mine:
                continue
            rows[pname] = {
                "workloads": len(mine),
                "mean_jct": statistics.mean(r["mean_jct"] for r in mine),
                "p99_jct": statistics.mean(r["p99_jct"] for r in mine),
                "makespan": statistics.mean(r["makespan"] for r in mine),
                "gpu_utilization": statistics.mean(r["gpu_utilization"] for r in mine),
                "decision_mean_s": statistics.mean(r["decision_mean_s"] for r in mine),
                "decision_max_s": max(r["decision_max_s"] for r in mine),
                "decision_cpu_mean_s": statistics.mean(r["decision_cpu_mean_s"] for r in mine),
                "decision_cpu_max_s": max(r["decision_cpu_max_s"] for r in mine),
                "wall_max_s": max(r["wall_seconds"] for r in mine),
                "completed": sum(r["completed"] for r in mine),
                "jobs": sum(r["jobs"] for r in mine)}
        if OURS in rows:  # ratios over the workloads both ran
            for other in [n for n in names if n in rows]:
                if other == OURS:
                    continue
                done = {r["workload"] for r in runs if r["policy"] == other and r["load"] == load}
                pair = [(r["mean_jct"], o["mean_jct"]) for r in runs for o in runs
                        if r["policy"] == OURS and o["policy"] == other and r["load"] == load
                        and o["load"] == load and r["workload"] == o["workload"]
                        and r["workload"] in done]
                if pair:
                    rows[f"{OURS}_over_{other}"] = (sum(a for a, _ in pair)
                                                    / sum(b for _, b in pair))
        per_load[str(load)] = rows
    return per_load


def merge(paths: list[str], out: str) -> int:
    """One result file from the runs of several (see the module doc)."""
    cells: dict[tuple, dict] = {}
    sources = []
    for path in paths:
        data = json.loads(Path(path).read_text())
        sources.append({"file": Path(path).name, "options": data.get("options"),
                        "machine": data.get("machine")})
        for run in data.get("runs", []):
            cells[(run["policy"], run["load"], run["workload"])] = {
                **run, "source": Path(path).name}
    runs = sorted(cells.values(), key=lambda r: (r["load"], r["workload"], r["policy"]))
    names = sorted({r["policy"] for r in runs}, key=lambda n: (n != OURS, n))
    loads = sorted({r["load"] for r in runs})
    result = {"merged_from": sources, "per_load": aggregate(runs, names, loads),
              "published": PUBLISHED, "runs": runs}
    Path(out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["per_load"], indent=1))
    return 0


def sweeps(specs, profiles, base: SimOptions, args, record) -> list[dict]:
    """Goodput-aware vs Pollux baseline on one workload, one knob at a time."""
    out = []
    grid = [("interval", v, {"interval": v}, {}) for v in (30.0, 120.0)]
    grid += [("restart_delay", v, {"restart_delay": v}, {"restart_delay": v})
             for v in (0.0, 120.0)]
    grid += [("fairness", v, {}, {"fairness": v}) for v in (-3.0, 0.0, 1.0)]
    for knob, value, sim_over, pol_over in grid:
        opts = SimOptions(**{**base.__dict__, **sim_over})
        row = {"knob": knob, "value": value}
        for name in (OURS, BASELINE):
            s = summarize(simulate(specs, profiles, policy(name, args, **pol_over), opts))
            row[name] = s["mean_jct"]
        row["ratio"] = row[OURS] / row[BASELINE]
        print(f"sweep {knob}={value}: {OURS} {row[OURS]:.0f} s, {BASELINE} "
              f"{row[BASELINE]:.0f} s, ratio {row['ratio']:.3f}", flush=True)
        out.append(row)
        record(out)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data")
    ap.add_argument("--workloads", default="1,2,3,4,5,6,7,8")
    ap.add_argument("--loads", default="0.5,1,1.5,2")
    ap.add_argument("--policies", default="all")
    ap.add_argument("--oracle", action="store_true", help="jobs know their model (ablation)")
    ap.add_argument("--ga-population", type=int, default=40)
    ap.add_argument("--ga-generations", type=int, default=40)
    ap.add_argument("--sweeps", action="store_true", help="interval/restart/fairness sweeps")
    ap.add_argument("--full-load", action="store_true", help="160-job decision timings")
    ap.add_argument("--only-full-load", action="store_true",
                    help="the 160-job decision timings alone (every workload), no simulations")
    ap.add_argument("--alone", action="store_true",
                    help="each job alone on the cluster (a low-load reference), no grid")
    ap.add_argument("--merge", nargs="+", metavar="JSON",
                    help="merge the runs of these result files into --out, no simulation")
    ap.add_argument("--out", default=str(RESULTS / "sched_sim.json"))
    args = ap.parse_args()
    if args.merge:
        return merge(args.merge, args.out)
    data = data_dir(args.data)
    names = list(POLICIES) if args.policies == "all" else args.policies.split(",")
    loads = [] if args.only_full_load else [float(x) for x in args.loads.split(",")]
    args.full_load = args.full_load or args.only_full_load
    plots = RESULTS / "sched_sim"
    plots.mkdir(parents=True, exist_ok=True)
    profiles = load_profiles(data / "profiles")
    for p in profiles.values():  # fit once, outside the timed runs
        _ = p.throughput_params
    runs: list[dict] = []
    full_load: list[dict] = []
    sweep_rows: list[dict] = []
    load1 = os.getloadavg()

    def write() -> None:
        out = {"options": {"nodes": 16, "gpus_per_node": 4, "interval": 60.0,
                           "restart_delay": 30.0, "oracle": args.oracle,
                           "explore_cap": not args.oracle, "loads": loads,
                           "ga_population": args.ga_population,
                           "ga_generations": args.ga_generations,
                           "workloads": args.workloads},
               "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                           "loadavg_start": load1, "loadavg_now": os.getloadavg()},
               "per_load": aggregate(runs, names, loads), "published": PUBLISHED,
               "decision_at_full_load": full_load, "sweeps": sweep_rows, "runs": runs}
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")

    workloads = {w: load_workload(data / "workloads-realistic" / f"workload-{w}.csv")
                 for w in args.workloads.split(",")}
    if args.alone:
        alone = {}
        for w, specs in workloads.items():
            alone[f"workload-{w}"] = alone_reference(specs, profiles)
            print(w, alone[f"workload-{w}"]["learned_mean_jct"],
                  alone[f"workload-{w}"]["oracle_mean_jct"], flush=True)
            Path(args.out).write_text(json.dumps(alone, indent=1) + "\n")
        return 0
    if args.full_load and OURS in names and BASELINE in names:
        for w, specs in workloads.items():
            opts = SimOptions(oracle=args.oracle)
            full_load.append({"workload": f"workload-{w}",
                              **decision_at_full_load(specs, profiles, opts, args)})
            print(json.dumps(full_load[-1]), flush=True)
            write()
    for load in loads:  # load-major: a cut-short run has every workload at the first loads
        for w, specs in workloads.items():
            wname = f"workload-{w}"
            options = SimOptions(num_nodes=16, gpus_per_node=4, interval=60.0,
                                 oracle=args.oracle, load=load)
            for pname in names:
                result = simulate(specs, profiles, policy(pname, args), options, wname)
                s = {**summarize(result), "load": load, "oracle": args.oracle}
                runs.append(s)
                if w == "1" and load == 1.0:
                    plot_allocation(result, plots / f"allocation_{wname}_{pname}.png")
                print(f"{wname} x{load} {pname:12s} mean JCT {s['mean_jct']:8.0f} s  p99 "
                      f"{s['p99_jct']:8.0f} s  util {s['gpu_utilization']:.2f}  decide "
                      f"{1e3 * s['decision_mean_s']:.1f}/{1e3 * s['decision_max_s']:.0f} ms "
                      f"(CPU {1e3 * s['decision_cpu_mean_s']:.1f}/"
                      f"{1e3 * s['decision_cpu_max_s']:.0f})  wall {s['wall_seconds']:.1f} s",
                      flush=True)
                write()
    if args.sweeps:
        specs = load_workload(data / "workloads-realistic" / "workload-1.csv")

        def keep(rows: list[dict]) -> None:
            sweep_rows[:] = rows
            write()

        sweeps(specs, profiles, SimOptions(oracle=args.oracle), args, keep)
    write()
    print(json.dumps(aggregate(runs, names, loads), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

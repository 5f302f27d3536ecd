"""``stratagem simulate``: replay workloads under policies, show progress, write reports."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TextIO

from stratagem.errors import StratagemError


def add_simulate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "simulate", help="simulate scheduling policies on a workload trace",
        description="Replay workload CSVs (name,time,application,num_replicas,batch_size) "
                    "on a simulated GPU cluster under one or more scheduling policies, "
                    "against application profiles (Pollux format, or a Stratagem job's "
                    "hints.json). Writes per-job CSV/JSON, plots and a summary table.")
    p.add_argument("workload", metavar="WORKLOAD.csv|DIR",
                   help="a workload CSV, or a directory of them")
    p.add_argument("--profiles", required=True, metavar="DIR",
                   help="one subdirectory per application named in the workload")
    p.add_argument("--policy", default="pollux", metavar="NAME[,NAME...]",
                   help="pollux, pollux-paper, tiresias, optimus, fifo, a comma-separated "
                        "list, or all (default: pollux)")
    p.add_argument("--nodes", type=int, default=16, help="nodes (default 16)")
    p.add_argument("--gpus-per-node", type=int, default=4, help="GPUs per node (default 4)")
    p.add_argument("--interval", type=float, default=60.0,
                   help="seconds between scheduling decisions (default 60)")
    p.add_argument("--restart-delay", type=float, default=30.0,
                   help="seconds a job loses per (re)allocation (default 30)")
    p.add_argument("--seed", type=int, default=0, help="seed (draws --step-noise)")
    p.add_argument("--step-noise", type=float, default=0.0,
                   help="std of a per-job log step-time slowdown (default 0: none)")
    p.add_argument("--fairness", type=float, default=-1.0,
                   help="pollux: power-mean exponent p (default -1)")
    p.add_argument("--share-distributed", action="store_true",
                   help="allow two multi-node jobs on one node")
    p.add_argument("--explore-cap", action=argparse.BooleanOptionalAction, default=None,
                   help="a job may get at most twice the replicas it has run on "
                        "(default: on unless --oracle)")
    p.add_argument("--oracle", action="store_true",
                   help="jobs know their application's throughput model from the start "
                        "(default: each learns it from the configurations it runs)")
    p.add_argument("--load", type=float, default=1.0,
                   help="arrival-rate factor: submission times are divided by it (default 1)")
    p.add_argument("--out", metavar="DIR", help="write results here (default: none)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(handler=cmd_simulate, parser=p)


def _policies(text: str) -> list[str]:
    from stratagem.sched.policy import POLICIES

    return list(POLICIES) if text == "all" else [t.strip() for t in text.split(",") if t]


class ProgressBar:
    """One self-overwriting line: jobs done and simulated time (throttled)."""

    def __init__(self, label: str, stream: TextIO, enabled: bool = True) -> None:
        self.label, self.stream, self.enabled = label, stream, enabled
        self.tty = bool(getattr(stream, "isatty", lambda: False)())
        self.last, self.quarter = 0.0, -1

    def __call__(self, now: float, done: int, total: int) -> None:
        if not self.enabled:
            return
        if not self.tty:  # a log file: one line per quarter of the jobs
            q = 4 * done // max(total, 1)
            if q > self.quarter:
                self.quarter = q
                self.stream.write(f"{self.label}: {done}/{total} jobs, t={now / 3600:.1f}h\n")
            return
        if time.monotonic() - self.last < 0.2 and done < total:
            return
        self.last = time.monotonic()
        width = 30
        fill = int(width * done / max(total, 1))
        self.stream.write(f"\r{self.label:<28} [{'#' * fill}{'.' * (width - fill)}] "
                          f"{done}/{total} jobs  t={now / 3600:6.1f}h")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()


def cmd_simulate(args: argparse.Namespace) -> int:
    from stratagem.sched.policy import make_policy
    from stratagem.sched.simulator.engine import SimOptions, simulate
    from stratagem.sched.simulator.profile import load_profiles
    from stratagem.sched.simulator.report import (
        plot_allocation,
        plot_jct_cdf,
        summarize,
        summary_table,
        write_jobs,
    )
    from stratagem.sched.simulator.workload import load_workload, workload_files

    names = _policies(args.policy)
    if not names:
        raise StratagemError("no policy given", where="--policy",
                             fix="pollux, pollux-paper, tiresias, optimus, fifo, a list or all")
    for name in names:  # fail on a typo before any work
        make_policy(name)
    options = SimOptions(num_nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                         interval=args.interval, restart_delay=args.restart_delay,
                         seed=args.seed, step_noise=args.step_noise,
                         share_distributed=args.share_distributed,
                         explore_cap=args.explore_cap, oracle=args.oracle, load=args.load)
    workloads = [(f.stem, load_workload(f)) for f in workload_files(args.workload)]
    apps = {s.application for _, specs in workloads for s in specs}
    profiles = load_profiles(args.profiles, apps)
    out = Path(args.out) if args.out else None
    summaries = []
    for wname, specs in workloads:
        jcts = {}
        for pname in names:
            opts = {"fairness": args.fairness, "restart_delay": args.restart_delay} \
                if pname in ("pollux", "pollux-paper") else {}
            bar = ProgressBar(f"{wname} {pname}", sys.stderr,
                              enabled=not args.quiet)
            result = simulate(specs, profiles, make_policy(pname, **opts), options, wname, bar)
            bar.close()
            summaries.append(summarize(result))
            jcts[pname] = [j.jct for j in result.jobs if j.jct is not None]
            if out is not None:
                write_jobs(result, out / wname / pname)
                plot_allocation(result, out / wname / pname / "allocation.png")
        if out is not None:
            plot_jct_cdf(jcts, out / wname / "jct_cdf.png", title=f"JCT CDF ({wname})")
    print(summary_table(summaries))
    if out is not None:
        (out / "summary.json").write_text(json.dumps(summaries, indent=1) + "\n")
        print(f"results in {out}/")
    return 0

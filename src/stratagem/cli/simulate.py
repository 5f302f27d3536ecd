"""``stratagem simulate``: replay workloads under policies, show progress, write reports."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
from collections.abc import Iterator
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
    p.add_argument("workload", nargs="?", metavar="WORKLOAD.csv|DIR",
                   help="a workload CSV, a directory of them, or pollux:NAME (a bundled one)")
    p.add_argument("--workload", dest="workload_option", metavar="WORKLOAD",
                   help="the same as the positional WORKLOAD, e.g. pollux:workload-1 (the "
                        "bundled Pollux workloads: pollux:workload-1 ... pollux:workload-8, "
                        "or pollux: for all eight)")
    p.add_argument("--profiles", metavar="DIR",
                   help="one subdirectory per application named in the workload (default: "
                        "the bundled Pollux profiles: bert, cifar10, deepspeech2, imagenet, "
                        "ncf, yolov3)")
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


# Bounds of the numeric options: a simulated cluster's size is what it allocates per step.
MAX_NODES = 4096
MAX_GPUS_PER_NODE = 64
MAX_GPUS = 65_536
LIMITS: dict[str, tuple[float, float]] = {  # option: (low, high), both included
    "interval": (1e-3, 86400.0), "restart_delay": (0.0, 86400.0),
    "step_noise": (0.0, 10.0), "fairness": (-100.0, 100.0), "load": (0.01, 100.0)}


def check_options(args: argparse.Namespace) -> None:
    """Every numeric option finite and in range, and --out writable, before any work."""
    for dest, (low, high) in LIMITS.items():
        value = getattr(args, dest)
        if not (math.isfinite(value) and low <= value <= high):
            flag = "--" + dest.replace("_", "-")
            raise StratagemError(f"{flag} {value} is out of range", where=flag,
                                 fix=f"a number from {low:g} to {high:g}")
    if not 1 <= args.nodes <= MAX_NODES:
        raise StratagemError(f"--nodes {args.nodes} is out of range", where="--nodes",
                             fix=f"from 1 to {MAX_NODES}")
    if not 1 <= args.gpus_per_node <= MAX_GPUS_PER_NODE:
        raise StratagemError(f"--gpus-per-node {args.gpus_per_node} is out of range",
                             where="--gpus-per-node", fix=f"from 1 to {MAX_GPUS_PER_NODE}")
    if args.nodes * args.gpus_per_node > MAX_GPUS:
        raise StratagemError(f"{args.nodes} x {args.gpus_per_node} GPUs is more than "
                             f"{MAX_GPUS}", where="--nodes/--gpus-per-node",
                             fix=f"from 1 to {MAX_GPUS} GPUs in all (nodes x GPUs per node)")
    if args.out:
        out = Path(args.out)
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StratagemError(f"cannot create the output directory: {exc.strerror}",
                                 where="--out", fix="pass a directory you can write") from None
        if not os.access(out, os.W_OK | os.X_OK):
            raise StratagemError("the output directory is not writable", where=f"--out {out}",
                                 fix="pass a directory you can write")


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


def _workload_arg(args: argparse.Namespace) -> str:
    given = [w for w in (args.workload, args.workload_option) if w]
    if len(given) != 1:
        raise StratagemError("give one workload" if not given else "two workloads given",
                             where="stratagem simulate",
                             fix="a workload CSV or directory, or --workload pollux:workload-1 "
                                 "(a bundled one)")
    return given[0]


def cmd_simulate(args: argparse.Namespace) -> int:
    from stratagem.sched.policy import make_policy
    from stratagem.sched.simulator.bundled import pollux_profiles, resolve_workload
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

    check_options(args)
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
    source = resolve_workload(_workload_arg(args))
    workloads = [(f.stem, load_workload(f)) for f in workload_files(source)]
    apps = {s.application for _, specs in workloads for s in specs}
    profiles = load_profiles(args.profiles or pollux_profiles(), apps)
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
                with _writing(out):
                    write_jobs(result, out / wname / pname)
                    plot_allocation(result, out / wname / pname / "allocation.png")
        if out is not None:
            with _writing(out):
                plot_jct_cdf(jcts, out / wname / "jct_cdf.png", title=f"JCT CDF ({wname})")
    print(summary_table(summaries))
    if out is not None:
        with _writing(out):
            (out / "summary.json").write_text(json.dumps(summaries, indent=1) + "\n")
        print(f"results in {out}/")
    return 0


@contextlib.contextmanager
def _writing(out: Path) -> Iterator[None]:
    """A failed write of the results (a full disk, a directory made read-only meanwhile)
    is one error naming --out, not a traceback."""
    try:
        yield
    except OSError as exc:
        raise StratagemError(f"cannot write the results: {exc.strerror or exc}",
                             where=f"--out {out}",
                             fix="free space, or pass another directory") from None

"""Results of simulations: summary metrics, per-job CSV and JSON, PNG plots, a text table.

Metrics: mean, median and p99 job completion time (JCT: completion - submission, of the jobs
that finished), makespan (last completion - first submission), GPU utilization (GPU-seconds
held by jobs, restarts included, over all GPUs x makespan), and the policy's decision time.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from stratagem.sched.simulator.engine import SimResult


def summarize(result: SimResult) -> dict[str, Any]:
    """Headline numbers of one simulation (JSON-ready)."""
    jcts = np.array([j.jct for j in result.jobs if j.jct is not None], dtype=float)
    ends = [j.completion_time for j in result.jobs if j.completion_time is not None]
    first = min((j.submit_time for j in result.jobs), default=0.0)
    makespan = (max(ends) - first) if ends else None
    gpus = result.options.num_nodes * result.options.gpus_per_node
    held = sum(j.gpu_seconds for j in result.jobs)
    dec = np.array(result.decision_seconds or [0.0])
    pct = (lambda q: float(np.percentile(jcts, q)) if jcts.size else None)  # noqa: E731
    return {
        "policy": result.policy, "workload": result.workload,
        "jobs": len(result.jobs), "completed": int(jcts.size),
        "mean_jct": float(jcts.mean()) if jcts.size else None,
        "median_jct": pct(50), "p99_jct": pct(99),
        "makespan": makespan,
        "gpu_utilization": held / (gpus * makespan) if makespan else None,
        "mean_restarts": float(np.mean([j.num_restarts for j in result.jobs])),
        "decisions": len(result.decision_seconds),
        "decision_mean_s": float(dec.mean()), "decision_max_s": float(dec.max()),
        "wall_seconds": result.wall_seconds,
    }


def write_jobs(result: SimResult, directory: str | Path) -> dict[str, Path]:
    """``jobs.csv`` and ``result.json`` (summary, options, jobs, timeline) in ``directory``."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    rows = [asdict(j) for j in result.jobs]
    csv_path = d / "jobs.csv"
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["name"])
        writer.writeheader()
        writer.writerows(rows)
    json_path = d / "result.json"
    json_path.write_text(json.dumps({
        "summary": summarize(result), "options": asdict(result.options), "jobs": rows,
        "timeline": {"time": result.times, "allocations": result.allocations,
                     "active_jobs": result.active_jobs},
        "decision_seconds": result.decision_seconds}, indent=1) + "\n")
    return {"csv": csv_path, "json": json_path}


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def plot_allocation(result: SimResult, path: str | Path) -> Path | None:
    """Stacked GPUs per application over time (None without matplotlib)."""
    plt = _pyplot()
    if plt is None:
        return None
    apps = sorted(set(result.applications.values()))
    hours = np.array(result.times) / 3600.0
    stack = np.zeros((len(apps), len(hours)))
    for t, alloc in enumerate(result.allocations):
        for name, k in alloc.items():
            stack[apps.index(result.applications[name]), t] += k
    fig, ax = plt.subplots(figsize=(8, 3.5), dpi=110)
    if hours.size:
        ax.stackplot(hours, stack, labels=apps, step="post")
    total = result.options.num_nodes * result.options.gpus_per_node
    ax.axhline(total, color="black", lw=0.8, ls="--", label="cluster GPUs")
    ax.set(xlabel="time (hours)", ylabel="GPUs allocated", ylim=(0, total * 1.05),
           title=f"{result.policy}: allocation over time ({result.workload})")
    ax.legend(loc="upper right", fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)


def plot_jct_cdf(jcts: Mapping[str, Sequence[float]], path: str | Path,
                 title: str = "JCT CDF") -> Path | None:
    """One CDF line per policy, log-scaled time axis (None without matplotlib)."""
    plt = _pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(6, 4), dpi=110)
    for policy, values in jcts.items():
        v = np.sort(np.asarray(values, dtype=float))
        if v.size:
            ax.step(v / 3600.0, np.arange(1, v.size + 1) / v.size, where="post",
                    label=f"{policy} (mean {v.mean() / 3600:.2f} h)")
    ax.set_xscale("log")
    ax.set(xlabel="job completion time (hours, log scale)", ylabel="fraction of jobs",
           ylim=(0, 1.01), title=title)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)


def _fmt(value: float | None, scale: float = 1.0, digits: int = 0) -> str:
    return "-" if value is None else f"{value / scale:,.{digits}f}"


def summary_table(summaries: Sequence[Mapping[str, Any]]) -> str:
    """An 80-column table, one row per (workload, policy)."""
    head = (f"{'workload':<16}{'policy':<10}{'done':>6}{'mean JCT':>10}{'p99 JCT':>10}"
            f"{'makespan':>10}{'util':>6}{'decide':>12}")
    lines = [head, "-" * len(head)]
    for s in summaries:
        done = f"{s['completed']}/{s['jobs']}"
        decide = f"{1e3 * s['decision_mean_s']:.0f}/{1e3 * s['decision_max_s']:.0f}ms"
        util = "-" if s["gpu_utilization"] is None else f"{100 * s['gpu_utilization']:.0f}%"
        lines.append(f"{str(s['workload'])[:15]:<16}{s['policy'][:9]:<10}{done:>6}"
                     f"{_fmt(s['mean_jct']):>10}{_fmt(s['p99_jct']):>10}"
                     f"{_fmt(s['makespan']):>10}{util:>6}{decide:>12}")
    lines.append("JCT and makespan in seconds; decide: mean/max policy time per interval")
    return "\n".join(lines)

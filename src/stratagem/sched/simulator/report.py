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
    cpu = np.array(result.decision_cpu_seconds or [0.0])
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
        "decision_cpu_mean_s": float(cpu.mean()), "decision_cpu_max_s": float(cpu.max()),
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


def time_unit(seconds: float) -> tuple[str, float]:
    """(unit, seconds per unit) that shows ``seconds`` with readable numbers: a small
    workload's minutes are not "0.01 h"."""
    if seconds < 120:
        return "s", 1.0
    if seconds < 2 * 3600:
        return "min", 60.0
    return "h", 3600.0


def allocation_series(result: SimResult) -> tuple[np.ndarray, list[str], np.ndarray]:
    """(times in seconds, applications, GPUs per application at each time) as they were
    held: the decisions' allocations, with a job's GPUs given back at its completion (not
    at the next decision), and a point at the end of the run, so the series covers the
    makespan and an idle gap shows no GPUs."""
    apps = sorted(set(result.applications.values()))
    done = {j.name: j.completion_time for j in result.jobs if j.completion_time is not None}
    end = max([*done.values(), *result.times], default=0.0)
    points = np.array(sorted({*result.times, *done.values(), end}), dtype=float)
    stack = np.zeros((len(apps), points.size))
    taken = np.searchsorted(np.asarray(result.times, dtype=float), points, side="right") - 1
    for t, (point, i) in enumerate(zip(points, taken, strict=True)):
        if i < 0:
            continue
        for name, k in result.allocations[i].items():
            if done.get(name, np.inf) > point:
                stack[apps.index(result.applications[name]), t] += k
    return points, apps, stack


def allocation_figure(result: SimResult) -> Any:
    """The stacked GPUs per application over the whole run (see :func:`allocation_series`)."""
    plt = _pyplot()
    if plt is None:
        return None
    points, apps, stack = allocation_series(result)
    unit, per = time_unit(float(points[-1]) if points.size else 0.0)
    fig, ax = plt.subplots(figsize=(8, 3.5), dpi=110)
    if points.size:
        ax.stackplot(points / per, stack, labels=apps, step="post")
        ax.set_xlim(0, max(float(points[-1]) / per, 1e-9))
    total = result.options.num_nodes * result.options.gpus_per_node
    ax.axhline(total, color="black", lw=0.8, ls="--", label="cluster GPUs")
    ax.set(xlabel=f"time ({unit})", ylabel="GPUs allocated", ylim=(0, total * 1.15),
           title=f"{result.policy}: allocation over time ({result.workload})")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.25), fontsize=7, frameon=False,
              ncol=min(len(apps) + 1, 5))  # below the axes: over no allocation
    fig.tight_layout()
    return fig


def plot_allocation(result: SimResult, path: str | Path) -> Path | None:
    """Stacked GPUs per application over time (None without matplotlib)."""
    fig = allocation_figure(result)
    if fig is None:
        return None
    fig.savefig(path)
    _pyplot().close(fig)
    return Path(path)


STYLES = ("-", "--", ":", "-.")  # policies whose lines coincide stay told apart


def jct_cdf_figure(jcts: Mapping[str, Sequence[float]], title: str = "JCT CDF") -> Any:
    """One CDF line per policy, log-scaled time axis in a unit that suits the values; a
    policy whose completion times equal an earlier one's is drawn dashed over it and says
    so in the legend."""
    plt = _pyplot()
    if plt is None:
        return None
    longest = max((max(v) for v in jcts.values() if len(v)), default=0.0)
    unit, per = time_unit(float(longest))
    fig, ax = plt.subplots(figsize=(6, 4.6), dpi=110)
    drawn: dict[str, np.ndarray] = {}
    for i, (policy, values) in enumerate(jcts.items()):
        v = np.sort(np.asarray(values, dtype=float))
        if not v.size:
            continue
        same = next((p for p, w in drawn.items() if w.shape == v.shape
                     and np.allclose(w, v, rtol=1e-9, atol=1e-6)), None)
        label = f"{policy} (mean {v.mean() / per:.3g} {unit})"
        if same is not None:
            label += f", the same as {same}"
        ax.step(v / per, np.arange(1, v.size + 1) / v.size, where="post", label=label,
                linestyle=STYLES[i % len(STYLES)], linewidth=2.4 - 0.5 * (i % 3),
                zorder=3 + i)
        drawn[policy] = v
    ax.set_xscale("log")
    from matplotlib.ticker import FuncFormatter

    plain = FuncFormatter(lambda value, _: f"{value:g}")  # 2, 5, 10; not 2×10^0
    ax.xaxis.set_major_formatter(plain)
    ax.xaxis.set_minor_formatter(plain)
    ax.tick_params(axis="x", which="minor", labelsize=7)
    ax.set(xlabel=f"job completion time ({unit}, log scale)", ylabel="fraction of jobs",
           ylim=(0, 1.01), title=title)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.18), fontsize=8, frameon=False)
    fig.tight_layout()
    return fig


def plot_jct_cdf(jcts: Mapping[str, Sequence[float]], path: str | Path,
                 title: str = "JCT CDF") -> Path | None:
    """One CDF line per policy (:func:`jct_cdf_figure`; None without matplotlib)."""
    fig = jct_cdf_figure(jcts, title)
    if fig is None:
        return None
    fig.savefig(path)
    _pyplot().close(fig)
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

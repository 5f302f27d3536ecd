"""The fault-tolerance figure for bench/README.md: time from each chaos event to training
again, per event, for the local chaos run (``results/chaos.json``) and the elastic one on the
virtual cluster (``results/chaos_elastic.json``), against the issue's 30 s target.

    python bench/plot_chaos.py          # results/chaos.png (needs matplotlib)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
TARGET_S = 30.0
COLOURS = {"worker": "#4878cf", "agent": "#d65f5f", "node": "#ee854a"}
LABELS = {"worker": "worker SIGKILL", "agent": "node agent SIGKILL",
          "node": "node lost (link down)"}


def events(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Per-event records of either bench (``per_kill`` or ``per_event``)."""
    return list(result.get("per_kill") or result.get("per_event") or [])


def panel(ax: Any, result: dict[str, Any], title: str) -> None:
    rows = events(result)
    xs = range(1, len(rows) + 1)
    ax.bar(xs, [r["time_to_resume_s"] for r in rows],
           color=[COLOURS.get(r["target"], "grey") for r in rows])
    for x, r in zip(xs, rows, strict=True):
        if r.get("grown"):
            ax.plot(x, r["time_to_grow_s"], marker="^", color="black", linestyle="none")
    ax.axhline(TARGET_S, color="black", linestyle="--", linewidth=1)
    before, after = (result.get(k, [None])[0] for k in ("loadavg_before", "loadavg_after"))
    ax.set_title(f"{title}\n(load average {before:.1f} at the start, {after:.1f} at the end)"
                 if before is not None and after is not None else title, fontsize=9)
    ax.set_xlabel("event")
    ax.set_xticks(list(xs))


def plot(out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    runs = [(RESULTS / "chaos.json", "2 workers, one machine (chaos.py)"),
            (RESULTS / "chaos_elastic.json", "adaptive, 2 nodes, --nnodes 1:2 (chaos_elastic.py)")]
    found = [(json.loads(p.read_text()), t) for p, t in runs if p.is_file()]
    if not found:
        raise SystemExit("no chaos results: run bench/chaos.py or bench/chaos_elastic.py")
    fig, axes = plt.subplots(1, len(found), figsize=(5 * len(found), 3.6), sharey=True,
                             squeeze=False)
    for ax, (result, title) in zip(axes[0], found, strict=True):
        panel(ax, result, title)
    axes[0][0].set_ylabel("event -> training again (s)")
    handles = [Patch(color=c, label=LABELS[k]) for k, c in COLOURS.items()]
    handles += [Line2D([], [], marker="^", color="black", linestyle="none",
                       label="link back -> training on 2 nodes"),
                Line2D([], [], color="black", linestyle="--", label=f"target {TARGET_S:.0f} s")]
    fig.legend(handles=handles, loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS / "chaos.png")
    print(plot(parser.parse_args().out))

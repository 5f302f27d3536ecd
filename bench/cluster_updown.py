"""Wall time of ``stratagem cluster up`` and ``cluster down`` (a local head, fake GPUs), with
where ``up`` spends it: the head's ``ray start`` until "Ray runtime started", and the
scheduler until its control plane answers. Run under both locks (it starts Ray)::

    flock /tmp/stratagem-hostwide.lock flock /tmp/stratagem-bench.lock \\
        python bench/cluster_updown.py [--runs 3] [--out bench/results/cluster_updown.json]

Reports each run, the medians and the machine's load (1-minute average, before and after).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import tempfile
import time
from datetime import datetime
from pathlib import Path

from stratagem.service import cluster


def _stamp(line: str) -> float | None:
    m = re.match(r"\[?(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})", line)
    return None if m is None else datetime.strptime(
        m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()


def one(d: Path) -> dict:
    t0 = time.time()
    cluster.up(d, num_cpus=2, gpus=1, gpu_resource="fake_gpu", interval=1.0)
    t_up = time.time()
    head = next((_stamp(line) for line in (d / "ray.log").read_text().splitlines()
                 if cluster.HEAD_READY in line), None)
    t1 = time.time()
    done = cluster.down(d)
    t_down = time.time()
    return {"up_s": t_up - t0, "down_s": t_down - t1, "head_ready_s": head and head - t0,
            "scheduler_after_head_s": head and t_up - head, "down": done}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--out", default="bench/results/cluster_updown.json")
    a = p.parse_args()
    load = [os.getloadavg()[0]]
    runs = []
    for i in range(a.runs):
        with tempfile.TemporaryDirectory() as tmp:
            runs.append(one(Path(tmp) / f"c{i}"))
        load.append(os.getloadavg()[0])
        print(json.dumps(runs[-1]), flush=True)
    summary = {k: statistics.median(r[k] for r in runs if r[k] is not None)
               for k in ("up_s", "down_s", "head_ready_s", "scheduler_after_head_s")}
    print("medians:", json.dumps({k: round(v, 2) for k, v in summary.items()}), "load:", load)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": {"cpus": os.cpu_count(), "load_1min": load},
                               "runs": runs, "medians": summary}, indent=1) + "\n")


if __name__ == "__main__":
    main()

"""Periodic checkpoints: training stall per save, synchronous vs background writes.

    python bench/checkpoint_async.py [--reps 7] [--steps 65] [--every 10] [--width 1024]
                                     [--dir DIR] [--out bench/results/checkpoint_async.json]

One process trains an MLP 32-W-W-W-10 with Adam (W=1024: 2.1 M parameters; parameters and
two moments, about 25 MB of state) and calls ``exit_point`` after every step with a
checkpoint every ``--every`` steps, in three modes run interleaved (their order rotates
each repetition): ``none`` (no periodic checkpoints: the baseline step time), ``sync``
(``STRATAGEM_CHECKPOINT_ASYNC=0``) and ``async`` (the default: a CPU snapshot, the write on
a background thread). Measured per mode: the stall per save (the time of ``exit_point`` at
a boundary that saves: median over saves and repetitions), the median step time at the
other boundaries (the background writer competes with training for the cores), and the
whole run's time per step (throughput, saves included; the run ends when the last write is
complete). The machine's load average is
recorded before and after; the checkpoints go to ``--dir`` (default: a temporary directory
on the disk of ``bench/results``, not a tmpfs), so fsync is real.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MODES = ("none", "sync", "async")


def run_once(mode: str, root: Path, steps: int, every: int, width: int) -> dict[str, Any]:
    """One training run in ``mode``; per-step times, and which steps saved."""
    import torch
    from torch import nn

    from stratagem import env
    from stratagem.elastic import exit_point, job_context, track_model, wait_for_checkpoint

    shutil.rmtree(root, ignore_errors=True)
    os.environ[env.CHECKPOINT_DIR] = str(root)
    os.environ[env.CHECKPOINT_STEPS] = str(every if mode != "none" else 0)
    os.environ[env.CHECKPOINT_ASYNC] = "0" if mode == "sync" else "1"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                          nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 32, generator=g), torch.randint(0, 10, (64,), generator=g)
    compute, boundary = [], []
    start = time.perf_counter()
    with job_context():
        track_model(model, opt)
        for _ in range(steps):
            t0 = time.perf_counter()
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            t1 = time.perf_counter()
            exit_point(step=True)
            compute.append(t1 - t0)
            boundary.append(time.perf_counter() - t1)
        wait_for_checkpoint()  # the last write counts (steps after it overlap only part)
        t_end = time.perf_counter()
    saved = sorted(p.name for p in root.iterdir()) if root.exists() else []
    state_bytes = sum(f.stat().st_size for f in (root / saved[-1]).iterdir()) if saved else 0
    return {"mode": mode, "compute_s": compute, "boundary_s": boundary,
            "run_s": t_end - start, "checkpoints": saved, "state_bytes": state_bytes}


def summarize(runs: list[dict[str, Any]], every: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode in MODES:
        mine = [r for r in runs if r["mode"] == mode]
        stalls, others, per_step = [], [], []
        for r in mine:
            n = len(r["boundary_s"])
            for i in range(n):
                saving = mode != "none" and (i + 1) % every == 0
                (stalls if saving else others).append(r["boundary_s"][i])
                if not saving and i >= 2:  # skip warm-up
                    per_step.append(r["compute_s"][i] + r["boundary_s"][i])

        out[mode] = {
            "stall_per_save_s": statistics.median(stalls) if stalls else 0.0,
            "stall_per_save_max_s": max(stalls) if stalls else 0.0,
            "step_s_between_saves": statistics.median(per_step),
            "run_s_per_step": statistics.median(r["run_s"] / len(r["boundary_s"])
                                                for r in mine),
            "saves_per_run": sum(1 for i in range(len(mine[0]["boundary_s"]))
                                 if mode != "none" and (i + 1) % every == 0),
        }
    base = out["none"]
    for mode in ("sync", "async"):
        out[mode]["run_overhead_vs_none"] = out[mode]["run_s_per_step"] / base["run_s_per_step"]
        out[mode]["step_overhead_vs_none"] = (out[mode]["step_s_between_saves"]
                                              / base["step_s_between_saves"])
    out["stall_ratio_async_vs_sync"] = (out["async"]["stall_per_save_s"]
                                        / out["sync"]["stall_per_save_s"])
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--steps", type=int, default=65)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--dir", default=None, help="where the checkpoints go (a real disk)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"
                                             / "checkpoint_async.json"))
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)  # leave a core to the writer, as a real job with a GPU would
    parent = Path(args.dir) if args.dir else Path(args.out).resolve().parent
    parent.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    runs = []
    with tempfile.TemporaryDirectory(dir=parent, prefix="ckpt-bench-") as tmp:
        run_once("async", Path(tmp) / "warm", 12, 5, args.width)  # imports, allocator
        for rep in range(args.reps):
            order = MODES[rep % 3:] + MODES[:rep % 3]
            for mode in order:
                r = run_once(mode, Path(tmp) / mode, args.steps, args.every, args.width)
                r["rep"] = rep
                runs.append(r)
                print(f"rep {rep} {mode:5s}: {r['run_s']:.2f} s, "
                      f"{len(r['checkpoints'])} checkpoints kept", file=sys.stderr)
    summary = summarize(runs, args.every)
    state_mb = max(r["state_bytes"] for r in runs) / 1e6
    result = {
        "bench": "checkpoint_async", "machine": platform.machine(), "cpus": os.cpu_count(),
        "python": platform.python_version(), "torch": torch.__version__,
        "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
        "args": vars(args), "state_mb": round(state_mb, 1), "summary": summary, "runs": runs,
    }
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"state {state_mb:.1f} MB; load {load_before[0]:.1f} -> {os.getloadavg()[0]:.1f}")
    print("| mode | stall per save (median) | max | step time between saves | "
          "time per step, whole run | vs none |")
    print("| --- | --- | --- | --- | --- | --- |")
    for mode in MODES:
        s = summary[mode]
        ratio = s.get("run_overhead_vs_none", 1.0)
        print(f"| {mode} | {s['stall_per_save_s'] * 1e3:.1f} ms | "
              f"{s['stall_per_save_max_s'] * 1e3:.1f} ms | "
              f"{s['step_s_between_saves'] * 1e3:.1f} ms | "
              f"{s['run_s_per_step'] * 1e3:.1f} ms | {ratio:.2f}x |")
    print(f"async / sync stall: {summary['stall_ratio_async_vs_sync']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

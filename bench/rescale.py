"""Rescale time 2 -> 1 -> 2 workers: in-process rescale vs checkpoint-restart (torchrun).

    python bench/rescale.py [--reps 3] [--width 1024] [--out bench/results/rescale.json]
    python bench/rescale.py --zero-stages 2 3 [--reps 3]   # in-process, sharded: ZeRO-2 vs -3

In-process: two workers share a rescale store (``STRATAGEM_RESCALE_STORE``); rank 1 leaves
after step 5; a new worker is started once it is gone and joins at the next step boundary
after it is ready. Measured: each survivor's pause at the boundary (agreement, new process
group, engine rebuild, state broadcast), and the gap between the last step before and the
first step after the change (one step included). The joiner's own start-up (interpreter,
imports, model) overlaps training and is reported separately.

Checkpoint-restart: ``torchrun --standalone`` with 2 workers gets SIGTERM after step 5
(the job saves and exits), then ``torchrun`` with 1 worker resumes; then again to 2.
Measured: SIGTERM to the first step of the relaunched job (save, exit, relaunch, imports,
model build, restore), which is time without training.

The model: an MLP with 3 hidden layers of ``--width`` units (width 1024: 2.1 M parameters),
Adam, so the state handed over is parameters plus two moments. Medians over ``--reps``.

``--zero-stages 2 3``: the in-process rescale only, the model sharded by ``ZeRO(stage=s)``
for each stage, interleaved in every rep (``results/rescale_zero.json``): stage 3 gathers
its FSDP2 units whole before the change and shards the rebuilt model after it (docs/
concepts/sharding.md), stage 2 gathers the owners' optimizer state.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

N, BATCH = 4096, 64


# -- the worker ---------------------------------------------------------------------------------
def worker(out: Path, width: int, leave_at: int, step_sleep: float, zero: int = 0) -> None:
    import torch
    from torch import nn
    from torch.utils.data import TensorDataset

    import stratagem as sg
    from stratagem.elastic import rescale

    builder = None
    if zero:
        from stratagem.strategy.builders import ZeRO

        builder = ZeRO(stage=zero)
    ad = sg.AutoDist(strategy_builder=builder, verbose=False)
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(32, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                          nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))
    model, opt = ad.distribute(plain, torch.optim.Adam(plain.parameters(), lr=1e-3))
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(N, 32, generator=g), torch.randint(0, 10, (N,), generator=g))
    loader = ad.data_loader(data, batch_size=BATCH, shuffle=True)
    group = rescale.active_group()
    seen = 0
    log = (out / f"steps-{os.getpid()}.jsonl").open("a")
    step = 0
    for _ in ad.remaining_epochs_until(10_000):
        for x, y in loader:
            step += 1
            log.write(json.dumps({"pid": os.getpid(), "step": step, "world": ad.world_size,
                                  "rank": ad.rank, "time": time.time()}) + "\n")
            log.flush()
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            if step == leave_at and ad.rank == 1:
                rescale.request_leave()
            if group is not None and len(group.history) != seen:
                seen = len(group.history)
                (out / f"changes-{os.getpid()}.json").write_text(
                    json.dumps([c.__dict__ for c in group.history]))
            time.sleep(step_sleep)


# -- helpers --------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(**extra: str) -> dict[str, str]:
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
            "STRATAGEM_CHECKPOINT_DIR", "ADAPTDL_CHECKPOINT_PATH", "STRATAGEM_RESCALE_STORE")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    return env


def records(out: Path) -> list[dict[str, Any]]:
    recs = [json.loads(line) for f in out.glob("steps-*.jsonl")
            for line in f.read_text().splitlines() if line.strip()]
    return sorted(recs, key=lambda r: r["time"])


def wait_for(pred: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.01)


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def worker_cmd(out: Path, args: argparse.Namespace, leave_at: int = 0, zero: int = 0
               ) -> list[str]:
    return [__file__, "--worker", "--dir", str(out), "--width", str(args.width),
            "--leave-at", str(leave_at), "--step-sleep", str(args.step_sleep),
            "--zero", str(zero)]


# -- in-process -----------------------------------------------------------------------------------
def in_process(args: argparse.Namespace, tmp: Path, zero: int = 0) -> dict[str, float]:
    from stratagem.elastic.rescale import host_store

    out = tmp / f"inproc-{zero}"
    out.mkdir()
    port = free_port()
    store = host_store("127.0.0.1", port)
    env = clean_env(STRATAGEM_RESCALE_STORE=f"127.0.0.1:{port}", STRATAGEM_RESCALE_NPROC="2")
    logf = (out / "workers.log").open("w")

    def spawn() -> subprocess.Popen:
        return subprocess.Popen([sys.executable, *worker_cmd(out, args, leave_at=5, zero=zero)],
                                env=env, stdout=logf, stderr=subprocess.STDOUT)

    first = [spawn(), spawn()]
    procs = list(first)
    try:
        wait_for(lambda: any(p.poll() is not None for p in first), 120, "no worker left")
        t_spawn = time.time()
        procs.append(spawn())
        wait_for(lambda: any(r["world"] == 2 and r["time"] > t_spawn for r in records(out)),
                 120, "the new worker did not join")
        wait_for(lambda: sum(r["world"] == 2 and r["time"] > t_spawn
                             for r in records(out)) >= 4, 60, "no steps after the join")
    finally:
        stop(procs)
        del store
    histories = [json.loads(p.read_text()) for p in out.glob("changes-*.json")]
    survivor = max(histories, key=len)
    (shrink, grow) = survivor[:2]
    recs = [r for r in records(out) if r["rank"] == 0]
    gaps = []
    for old, new in ((2, 1), (1, 2)):
        for a, b in zip(recs, recs[1:], strict=False):
            if a["world"] == old and b["world"] == new:
                gaps.append(b["time"] - a["time"])
                break
    joined_at = min(r["time"] for r in records(out) if r["world"] == 2 and r["time"] > t_spawn)
    return {"pause_2to1_s": shrink["seconds"], "pause_1to2_s": grow["seconds"],
            "gap_2to1_s": gaps[0], "gap_1to2_s": gaps[1],
            "joiner_startup_s": joined_at - t_spawn}


# -- checkpoint-restart ---------------------------------------------------------------------------
def checkpoint_restart(args: argparse.Namespace, tmp: Path) -> dict[str, float]:
    out = tmp / "ckpt-restart"
    out.mkdir()
    env = clean_env(STRATAGEM_CHECKPOINT_DIR=str(out / "ckpt"))
    logf = (out / "torchrun.log").open("w")

    def launch(nproc: int) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(nproc), "--monitor-interval", "0.05",
               *worker_cmd(out, args)]
        return subprocess.Popen(cmd, env=env, stdout=logf, stderr=subprocess.STDOUT)

    result = {}
    job = launch(2)
    try:
        wait_for(lambda: len(records(out)) >= 10, 120, "the 2-worker job did not train")
        for old, new in ((2, 1), (1, 2)):
            t0 = time.time()
            stop([job])
            job = launch(new)
            wait_for(lambda t0=t0, new=new: any(r["time"] > t0 and r["world"] == new
                                                for r in records(out)), 180,
                     f"the {new}-worker job did not resume")
            first = min(r["time"] for r in records(out) if r["time"] > t0)
            result[f"restart_{old}to{new}_s"] = first - t0
            wait_for(lambda t0=t0, n=new: sum(r["time"] > t0 for r in records(out)) >= 5 * n, 60,
                     "no steps after the restart")
    finally:
        stop([job])
    return result


def median_of(runs: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--leave-at", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--step-sleep", type=float, default=0.02,
                        help="pause after each step (keeps the 2-core box responsive)")
    parser.add_argument("--zero", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--zero-stages", type=int, nargs="+", choices=[1, 2, 3],
                        help="in-process only, sharded by ZeRO at each stage (interleaved)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.worker:
        worker(args.dir, args.width, args.leave_at, args.step_sleep, args.zero)
        return
    if args.zero_stages:
        zero_stages(args)
        return
    args.out = args.out or Path(__file__).parent / "results" / "rescale.json"
    inproc, restart = [], []
    load_before = os.getloadavg()
    for rep in range(args.reps):
        with tempfile.TemporaryDirectory(prefix="sg-rescale-") as tmp:
            inproc.append(in_process(args, Path(tmp)))
            restart.append(checkpoint_restart(args, Path(tmp)))
        print(f"rep {rep + 1}/{args.reps}: in-process {inproc[-1]}, "
              f"checkpoint-restart {restart[-1]}", flush=True)
    med_in, med_re = median_of(inproc), median_of(restart)
    result = {
        "benchmark": "rescale 2->1->2 workers, in-process vs checkpoint-restart",
        **machine_and_model(args, load_before[0]),
        "reps": args.reps,
        "median": {"in_process": med_in, "checkpoint_restart": med_re},
        "in_process_total_s": med_in["pause_2to1_s"] + med_in["pause_1to2_s"],
        "checkpoint_restart_total_s": med_re["restart_2to1_s"] + med_re["restart_1to2_s"],
        "target_in_process_s": 5.0,
        "runs": {"in_process": inproc, "checkpoint_restart": restart},
    }
    result["meets_target"] = (med_in["pause_2to1_s"] <= 5.0 and med_in["pause_1to2_s"] <= 5.0)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["median"], indent=2))
    print(f"wrote {args.out}")


def machine_and_model(args: argparse.Namespace, load_before: float) -> dict[str, Any]:
    """The results' ``machine`` (with the load before and now) and ``model`` entries."""
    width = args.width
    params = 32 * width + 2 * width * width + width * 10 + 3 * width + 10
    return {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                        "python": platform.python_version(),
                        "load_average_1m_before_after": [load_before, os.getloadavg()[0]]},
            "model": {"kind": "MLP 32-w-w-w-10", "width": width, "parameters": params,
                      "optimizer": "Adam"}}


def zero_stages(args: argparse.Namespace) -> None:
    """In-process rescale of the model sharded at each of ``args.zero_stages``,
    interleaved in every rep; medians and the ratios to the first stage."""
    runs: dict[int, list[dict[str, float]]] = {z: [] for z in args.zero_stages}
    load_before = os.getloadavg()
    for rep in range(args.reps):
        with tempfile.TemporaryDirectory(prefix="sg-rescale-zero-") as tmp:
            for z in args.zero_stages:
                runs[z].append(in_process(args, Path(tmp), zero=z))
        print(f"rep {rep + 1}/{args.reps}: " + ", ".join(
            f"ZeRO-{z} {runs[z][-1]}" for z in args.zero_stages), flush=True)
    med = {f"ZeRO-{z}": median_of(r) for z, r in runs.items()}
    first = f"ZeRO-{args.zero_stages[0]}"
    result = {
        "benchmark": "in-process rescale 2->1->2 workers of a sharded model, by ZeRO stage",
        **machine_and_model(args, load_before[0]),
        "reps": args.reps,
        "median": med,
        "pause_total_over_" + first: {
            k: round((m["pause_2to1_s"] + m["pause_1to2_s"])
                     / (med[first]["pause_2to1_s"] + med[first]["pause_1to2_s"]), 3)
            for k, m in med.items()},
        "runs": {f"ZeRO-{z}": r for z, r in runs.items()},
    }
    out = args.out or Path(__file__).parent / "results" / "rescale_zero.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["median"], indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

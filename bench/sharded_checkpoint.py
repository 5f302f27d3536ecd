"""Sharded checkpoints against a full (gathered) save of the same ZeRO-3 job.

4 gloo workers on loopback train an 8-layer MLP of 1024-wide linear layers (8.4 M fp32
parameters: 33.6 MB, Adam state 67 MB) with ZeRO-3 (FSDP2), then save ROUNDS times each
way, interleaved (the order alternates): sharded (every rank writes its pieces,
``checkpoint.save``) and full (``checkpoint.save(full=True)``: gathered, rank 0 writes
``model.pt``/``optimizer.pt``); each load back as well (``checkpoint.load``; the sharded
one assembles the whole state on every rank). Times are rank 0's wall time of the
collective call, medians; the machine's load average is recorded with them. Results:
bench/results/sharded_checkpoint.json.

    flock /tmp/stratagem-bench.lock .venv/bin/python bench/sharded_checkpoint.py
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from stratagem.launch.local import free_port

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
WIDTH, LAYERS, WORLD, ROUNDS = 1024, 8, 4, 3


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh())
                           for _ in range(LAYERS)])


def worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    from stratagem import checkpoint
    from stratagem.analysis import analyze
    from stratagem.resource import ResourceSpec
    from stratagem.runtime import DistributedModel, compile_plan
    from stratagem.strategy.builders import ZeRO

    m = model()
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    profile = analyze(m)
    plan = compile_plan(ZeRO(stage=3).build(profile, ResourceSpec.local(1)).with_replicas([]),
                        profile, rank=rank, world_size=WORLD, device=torch.device("cpu"))
    dm = DistributedModel(m, plan, optimizer=opt)
    x = torch.randn(4, WIDTH)
    dm(x).square().mean().backward()
    opt.step()
    root = Path(out)
    times: dict[str, list[float]] = {k: [] for k in ("save sharded", "save full",
                                                     "load sharded", "load full")}

    def timed(name: str, fn) -> None:  # noqa: ANN001
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        times[name].append(time.perf_counter() - t0)

    for r in range(ROUNDS):
        order = ("sharded", "full") if r % 2 == 0 else ("full", "sharded")
        for kind in order:
            path = root / f"{kind}-{r}"
            timed(f"save {kind}", lambda p=path, k=kind: checkpoint.save(
                p, dm, opt, full=(k == "full")))
        for kind in order:
            path = root / f"{kind}-{r}"
            timed(f"load {kind}", lambda p=path: checkpoint.load(p, dm, opt))
    if rank == 0:
        size = {k: sum(f.stat().st_size for f in (root / f"{k}-0").iterdir())
                for k in ("sharded", "full")}
        (root / "times.json").write_text(json.dumps({"times": times, "bytes": size}))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    out = Path(tempfile.mkdtemp(prefix="sg-ckpt-bench-"))
    try:
        port = free_port()
        load_before = os.getloadavg()[0]
        mp.start_processes(worker, args=(port, str(out)), nprocs=WORLD, start_method="spawn")
        raw = json.loads((out / "times.json").read_text())
    finally:
        shutil.rmtree(out, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in raw["times"].items()}
    result = {
        "model": f"{LAYERS} x Linear({WIDTH}, {WIDTH}), Adam, ZeRO-3, {WORLD} gloo workers",
        "rounds": ROUNDS, "median_s": med, "all_s": raw["times"], "bytes": raw["bytes"],
        "save_ratio_full_over_sharded": med["save full"] / med["save sharded"],
        "load_ratio_full_over_sharded": med["load full"] / med["load sharded"],
        "load_average": [load_before, os.getloadavg()[0]], "cpus": os.cpu_count(),
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "sharded_checkpoint.json").write_text(json.dumps(result, indent=1))
    json.dump(result, sys.stdout, indent=1)


if __name__ == "__main__":
    main()

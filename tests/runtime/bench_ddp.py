"""Step time of DistributedModel vs torch DDP (same bucket size), 2 gloo ranks on loopback.

    python tests/runtime/bench_ddp.py [--layers 6] [--width 2048] [--batch 32] [--steps 15]

Not a pytest test. Both sides train copies of the same ~25M-parameter MLP; our groups are
built with DDP's bucket rule. Variants are interleaved step by step so machine noise hits
them alike; medians are printed by rank 0. (bench/allreduce_vs_ddp.py measures the same on
a 1 Gbit/s virtual cluster.)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: _spawn
from _spawn import free_port  # noqa: E402

from stratagem.analysis import analyze  # noqa: E402
from stratagem.runtime import DistributedModel, compile_plan  # noqa: E402
from stratagem.strategy import AllReduceSynchronizer, NodeConfig, Strategy  # noqa: E402


def bucketed_strategy(model: nn.Module, bucket_mb: float, compressor: str) -> Strategy:
    """DDP's bucket rule: reverse parameter order, a bucket closes once it reaches its cap
    (1 MB for the first bucket, ``bucket_mb`` after)."""
    profile = analyze(model)
    groups: dict[str, int] = {}
    gid, size = 0, 0
    for info in reversed(profile.params):
        groups[info.name] = gid
        size += info.bytes
        if size >= (1 if gid == 0 else bucket_mb) * 2**20:
            gid, size = gid + 1, 0
    nodes = tuple(NodeConfig(n, synchronizer=AllReduceSynchronizer(group=groups[n],
                                                                   compressor=compressor))
                  for n in profile.names)
    return Strategy(nodes, builder="bench")


def make_model(layers: int, width: int) -> nn.Module:
    torch.manual_seed(0)
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*mods[:-1])


def step_once(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    model(x).square().mean().backward()
    opt.step()
    return time.perf_counter() - t0


def worker(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    base = make_model(args.layers, args.width)
    nparams = sum(p.numel() for p in base.parameters())
    configs = {
        "ddp": lambda m: DDP(m, bucket_cap_mb=args.bucket_mb),
        "ddp_view": lambda m: DDP(m, bucket_cap_mb=args.bucket_mb,
                                  gradient_as_bucket_view=True),
        "ours": lambda m: DistributedModel(m, compile_plan(
            bucketed_strategy(m, args.bucket_mb, "none"), analyze(m), rank=rank,
            world_size=world, device=torch.device("cpu"))),
    }
    if args.fp16:
        configs["ours_fp16"] = lambda m: DistributedModel(m, compile_plan(
            bucketed_strategy(m, args.bucket_mb, "fp16"), analyze(m), rank=rank,
            world_size=world, device=torch.device("cpu")))
    models = {name: make(make_model(args.layers, args.width)) for name, make in configs.items()}
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-4, momentum=0.9) for k, m in models.items()}
    x = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(rank))
    results: dict[str, list[float]] = {name: [] for name in configs}
    order = list(models)
    for step in range(args.warmup + args.steps):  # interleaved: noise hits all variants alike
        for name in order[step % len(order):] + order[:step % len(order)]:
            elapsed = step_once(models[name], opts[name], x)
            if step >= args.warmup:
                results[name].append(elapsed)
    if rank == 0:
        ddp = statistics.median(results["ddp"])
        print(f"{nparams / 1e6:.1f}M params, batch {args.batch}, bucket {args.bucket_mb} MB, "
              f"{world} gloo ranks on loopback, {args.threads} thread(s) each")
        for name, ts in results.items():
            med = statistics.median(ts)
            print(f"  {name:10s} median {med * 1e3:7.1f} ms  (min {min(ts) * 1e3:7.1f})  "
                  f"{med / ddp:5.3f}x ddp")
        ours = models["ours"]
        print(f"  ours: {len(ours.plan.groups)} groups; {ours.comm_stats.summary()}")
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    ap.add_argument("--fp16", action="store_true")
    args = ap.parse_args()
    mp.start_processes(worker, args=(2, free_port(), args), nprocs=2, start_method="spawn")


if __name__ == "__main__":
    main()

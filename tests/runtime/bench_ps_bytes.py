"""PS traffic and step time on a small DLRM-like model, loopback gloo (not a pytest test).

    python tests/runtime/bench_ps_bytes.py [--workers 2] [--servers 0] [--rows 100000]
        [--builder Parallax] [--steps 30] [--local-batch 256]

Per worker and step: the PS bytes it sent and received (``CommStats.push_bytes`` /
``pull_bytes``: row indices, rows, request ids, counts; dense buckets) against the lower
bound ``(unique rows of its batch + unique rows of its next batch) x row bytes`` (push the
gradient rows, pull the rows the next forward reads; indices not counted), and the part of
that bound for rows the worker does not own (colocated owners keep their own rows). Prints
medians over the steps after the first 5, from rank 0. bench/ps_vs_ddp.py measures the
same on a shaped virtual cluster against DDP.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: _spawn
from _spawn import free_port  # noqa: E402
from models import DLRM, DLRMConfig, DLRMData, bce_loss  # noqa: E402

from stratagem.analysis import analyze  # noqa: E402
from stratagem.resource import ResourceSpec  # noqa: E402
from stratagem.runtime import DistributedModel, compile_plan  # noqa: E402
from stratagem.runtime.ps import join_cluster, run_server  # noqa: E402
from stratagem.strategy import builder_from_name, validate  # noqa: E402
from stratagem.strategy.validate import server_devices  # noqa: E402


def spec_for(workers: int, servers: int) -> ResourceSpec:
    nodes = [{"address": "10.0.0.1", "chief": True, "workers": workers}]
    nodes += [{"address": f"10.0.1.{i + 1}", "workers": 0} for i in range(servers)]
    return ResourceSpec.from_dict({"nodes": nodes})


def worker(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      STRATAGEM_ROLE="server" if rank >= args.workers else "worker")
    torch.set_num_threads(1)
    spec = spec_for(args.workers, args.servers)
    cluster = join_cluster(spec.replicas, server_devices(spec))
    cfg = DLRMConfig(num_rows=args.rows)
    torch.manual_seed(0)
    model = DLRM(cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    profile = analyze(model)
    strategy = validate(builder_from_name(args.builder).build(profile, spec), profile, spec)
    plan = compile_plan(strategy, profile, rank=cluster.rank, world_size=args.workers,
                        device=torch.device("cpu"), servers=server_devices(spec))
    if plan.role == "server":
        run_server(model, plan, opt, cluster)
        return
    dm = DistributedModel(model, plan, optimizer=opt, cluster=cluster)
    data = DLRMData(cfg, args.local_batch, args.workers)
    row_bytes = cfg.dim * 4
    emb = [p for p in plan.ps.pieces if p.param == "embedding.weight"]
    owned = [(p.row_start, p.row_start + p.rows) for p in emb if p.owner == rank]
    rows = []
    for step in range(args.steps + 1):
        ids = data.batches(step)[rank].sparse_ids
        u = torch.unique(ids)
        mine = sum(int(((u >= lo) & (u < hi)).sum()) for lo, hi in owned)
        rows.append((len(u), len(u) - mine))
    out = []
    for step in range(args.steps):
        b = data.batches(step)[rank]
        s = dm.comm_stats
        before = (s.push_bytes, s.pull_bytes, s.rows_pushed, s.rows_pulled)
        t0 = time.perf_counter()
        opt.zero_grad()
        bce_loss(dm(*b.inputs), b.target).backward()
        opt.step()
        dt = time.perf_counter() - t0
        # this step pushes its own rows; its pull was for this batch (fetched in forward)
        out.append({"time": dt, "push": s.push_bytes - before[0], "pull": s.pull_bytes - before[1],
                    "rows_pushed": s.rows_pushed - before[2],
                    "rows_pulled": s.rows_pulled - before[3],
                    "bound": 2 * rows[step][0] * row_bytes,
                    "bound_remote": 2 * rows[step][1] * row_bytes})
    dm.close()
    if rank == 0:
        keep = out[5:]

        def med(k: str) -> float:
            return statistics.median(r[k] for r in keep)

        print(f"{args.builder}: {args.workers} workers + {args.servers} servers, "
              f"{args.rows} x {cfg.dim} fp32 table, local batch {args.local_batch} "
              f"({cfg.fields * cfg.pooling} ids/sample)")
        print(f"  step {med('time') * 1e3:.1f} ms; rows pushed {med('rows_pushed'):.0f}, "
              f"pulled {med('rows_pulled'):.0f}")
        total = med("push") + med("pull")
        print(f"  PS bytes/step (rank 0): push {med('push') / 1e3:.1f} kB, pull "
              f"{med('pull') / 1e3:.1f} kB, total {total / 1e3:.1f} kB")
        print(f"  lower bound (unique rows x {row_bytes} B, push + pull): "
              f"{med('bound') / 1e3:.1f} kB -> actual/bound {total / med('bound'):.2f}")
        print(f"  lower bound for rows it does not own: {med('bound_remote') / 1e3:.1f} kB -> "
              f"actual/bound {total / max(med('bound_remote'), 1):.2f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--servers", type=int, default=0)
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--builder", default="Parallax")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--local-batch", type=int, default=256)
    args = ap.parse_args()
    world = args.workers + args.servers
    mp.start_processes(worker, args=(world, free_port(), args), nprocs=world,
                       start_method="spawn")


if __name__ == "__main__":
    main()

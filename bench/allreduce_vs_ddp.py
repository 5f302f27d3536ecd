"""AllReduce builder vs torch DDP on a 2-node virtual cluster at 1 Gbit/s.

Runs every variant in the same worker processes, interleaved step by step, so machine noise
hits all of them alike; reports per-variant median step times, ratios to DDP, bytes on the
wire per step (from the namespace's /proc/net/dev) and link utilization. Needs root (the
virtual cluster). Results: bench/results/allreduce_vs_ddp.json.

    python bench/allreduce_vs_ddp.py [--nodes 2] [--bandwidth 1gbit] [--steps 20]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from vcluster_host import pinned_cpus, virtual_cluster

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


# ----------------------------------------------------------------------------- worker side
def _wire_bytes(ifname: str) -> tuple[int, int]:
    """(rx, tx) byte counters of ``ifname`` in this network namespace."""
    for line in Path("/proc/net/dev").read_text().splitlines()[2:]:
        name, data = line.split(":", 1)
        if name.strip() == ifname:
            fields = data.split()
            return int(fields[0]), int(fields[8])
    return 0, 0


def _rss_bytes() -> int:
    """Resident set size of this process (bytes), from /proc/self/status."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _make_model(layers: int, width: int):  # noqa: ANN202 - torch imported lazily
    import torch
    from torch import nn

    torch.manual_seed(0)
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*mods)


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import stratagem as sg
    from stratagem.runtime import DistributedModel, compile_plan

    torch.set_num_threads(1)
    ad = sg.AutoDist(verbose=False)  # joins the process group the launcher prepared
    rank, world = ad.rank, ad.world_size
    ifname = os.environ.get("GLOO_SOCKET_IFNAME", "lo")
    base = _make_model(args.layers, args.width)
    profile = sg.analyze(base)
    params_per_layer = 2
    chunk = args.layers_per_bucket * params_per_layer
    bucket_mb = chunk // params_per_layer * (args.width * args.width + args.width) * 4 / 2**20

    def ours(compressor: str) -> torch.nn.Module:
        model = _make_model(args.layers, args.width)
        strategy = sg.strategy.validate(
            sg.strategy.AllReduce(chunk_size=chunk, compressor=compressor).build(
                profile, ad.resource_spec), profile, ad.resource_spec)
        plan = compile_plan(strategy, profile, rank=rank, world_size=world,
                            device=torch.device("cpu"))
        return DistributedModel(model, plan)

    builders = {
        "ddp": lambda: DDP(_make_model(args.layers, args.width), bucket_cap_mb=bucket_mb + 0.01),
        "allreduce_none": lambda: ours("none"),
        "allreduce_fp16": lambda: ours("fp16"),
        "compute_only": lambda: _make_model(args.layers, args.width),
    }
    x = torch.randn(args.local_batch, args.width)
    variants: dict[str, torch.nn.Module] = {}
    opts: dict[str, torch.optim.Optimizer] = {}
    memory: dict[str, int] = {}
    for name, build in builders.items():
        # Memory of model + synchronizer + gradients, measured over construction and one step.
        before = _rss_bytes()
        variants[name] = build()
        opts[name] = torch.optim.SGD(variants[name].parameters(), lr=1e-4)
        opts[name].zero_grad()
        variants[name](x).square().mean().backward()
        opts[name].step()
        memory[name] = _rss_bytes() - before
    times: dict[str, list[float]] = {k: [] for k in variants}
    wire: dict[str, list[int]] = {k: [] for k in variants}
    order = list(variants)
    for step in range(args.warmup + args.steps):
        rotated = order[step % len(order):] + order[: step % len(order)]
        for name in rotated:
            model, opt = variants[name], opts[name]
            dist.barrier()
            rx0, tx0 = _wire_bytes(ifname)
            t0 = time.perf_counter()
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
            elapsed = time.perf_counter() - t0
            rx1, tx1 = _wire_bytes(ifname)
            if step >= args.warmup:
                times[name].append(elapsed)
                wire[name].append(tx1 - tx0)
    # Communication alone: all-reduce the same fp32 gradient bytes in the same buckets.
    flat = [torch.zeros(chunk // 2 * (args.width * args.width + args.width))
            for _ in range(args.layers // args.layers_per_bucket)]
    comm_times, comm_wire = [], []
    for _ in range(max(5, args.steps // 4)):
        dist.barrier()
        rx0, tx0 = _wire_bytes(ifname)
        t0 = time.perf_counter()
        for w in [dist.all_reduce(b, async_op=True) for b in flat]:
            w.wait()
        comm_times.append(time.perf_counter() - t0)
        comm_wire.append(_wire_bytes(ifname)[1] - tx0)
    if rank == 0:
        report(args, world, profile.num_params, bucket_mb, times, wire, comm_times, comm_wire,
               memory)


def report(args: argparse.Namespace, world: int, num_params: int, bucket_mb: float,
           times: dict[str, list[float]], wire: dict[str, list[int]],
           comm_times: list[float], comm_wire: list[int], memory: dict[str, int]) -> None:
    med = {k: statistics.median(v) for k, v in times.items()}
    link_bps = args.link_gbps * 1e9
    comm_s, comm_bytes = statistics.median(comm_times), statistics.median(comm_wire)
    result = {
        "benchmark": "allreduce_vs_ddp",
        "nodes": world,
        "link_gbps": args.link_gbps,
        "params": num_params,
        "bucket_mb": round(bucket_mb, 3),
        "local_batch": args.local_batch,
        "steps_measured": args.steps,
        "median_step_s": {k: round(v, 5) for k, v in med.items()},
        "all_step_s": {k: [round(t, 5) for t in v] for k, v in times.items()},
        "tx_bytes_per_step_median": {k: int(statistics.median(v)) for k, v in wire.items()},
        "rss_mb_model_sync_grads": {k: round(v / 2**20, 1) for k, v in memory.items()},
        "ratio_allreduce_none_to_ddp": round(med["allreduce_none"] / med["ddp"], 4),
        "speedup_fp16_over_ddp": round(med["ddp"] / med["allreduce_fp16"], 4),
        "comm_only_s": round(comm_s, 5),
        "comm_only_tx_bytes": int(comm_bytes),
        "link_utilization": round(comm_bytes * 8 / comm_s / link_bps, 4),
        # Busy-link rate over a whole step (a lower bound: compute overlaps communication).
        "wire_gbps_over_step": {k: round(statistics.median(wire[k]) * 8 / med[k] / 1e9, 4)
                                for k in med if k != "compute_only"},
        "targets": {"ratio_allreduce_none_to_ddp_max": 1.03, "speedup_fp16_over_ddp_min": 1.6,
                    "link_utilization_min": 0.85},
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = Path(args.out)
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k != "all_step_s"}, indent=2))


# ----------------------------------------------------------------------------- driver side
def driver(args: argparse.Namespace) -> int:
    VirtualCluster = virtual_cluster()
    if VirtualCluster is None:
        return 0
    cpus = pinned_cpus(args.nodes)
    with VirtualCluster(args.nodes, bandwidth=args.bandwidth, delay=args.delay, cpus=cpus) as vc, \
            tempfile.TemporaryDirectory() as tmp:
        spec = vc.write_resource_spec(Path(tmp) / "spec.yml")
        shell = f"{sys.executable} {ROOT / 'tools' / 'vcluster.py'} exec {{address}} --"
        argv = [sys.executable, "-m", "stratagem", "run", "--resource-spec", str(spec),
                "--remote-shell", shell, str(Path(__file__).resolve()), "--worker",
                "--out", str(Path(args.out).resolve()), "--steps", str(args.steps),
                "--warmup", str(args.warmup), "--layers", str(args.layers),
                "--width", str(args.width), "--local-batch", str(args.local_batch),
                "--layers-per-bucket", str(args.layers_per_bucket),
                "--link-gbps", str(vc.bandwidth_gbps or 0)]
        return vc.run(0, argv).wait()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--bandwidth", default="1gbit")
    p.add_argument("--delay", default="0.1ms")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--layers", type=int, default=24, help="Linear layers (width^2 params each)")
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--layers-per-bucket", type=int, default=6)
    p.add_argument("--local-batch", type=int, default=32)
    p.add_argument("--link-gbps", type=float, default=1.0, help=argparse.SUPPRESS)
    p.add_argument("--out", default=str(RESULTS / "allreduce_vs_ddp.json"))
    args = p.parse_args()
    if args.worker:
        worker(args)
        return 0
    return driver(args)


if __name__ == "__main__":
    raise SystemExit(main())

"""Sharded strategies: peak memory per worker and step time, and Stratagem's ZeRO-3 against
torch FSDP2 used directly.

One job per world size (2 and 4 gloo workers on loopback: memory is the subject here, so
no virtual cluster). Each worker runs, one after the other, replicated (AllReduce),
ZeRO-1, ZeRO-2, ZeRO-3 and FSDP2 direct: it builds the model, wraps it, trains STEPS steps
and records its peak RSS growth over the RSS before the model was built (the peak counter
reset there; glibc's mmap threshold fixed so freed blocks leave the process) with the
planner's estimate next to it. Then Stratagem's ZeRO-3 and FSDP2 direct on the same model,
world and batch are timed interleaved step by step (the order alternates), medians and
their ratio. Results: bench/results/sharding.json.

    flock /tmp/stratagem-bench.lock .venv/bin/python bench/sharding.py
    .venv/bin/python bench/sharding.py --memory-only   # no timings: needs no bench lock
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from ps_vs_ddp import _commit
from torch import nn
from torch.nn import functional as F

from stratagem.launch.local import free_port

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
VOCAB, DIM, BLOCKS, SEQ, PER_WORKER = 512, 192, 12, 16, 2
STEPS = 3
TIMED = 30
"""Interleaved steps per variant (after two warm-up steps): at 8 the ratio moved by 0.2
between runs on the loaded machine."""
VARIANTS = ("replicated", "ZeRO-1", "ZeRO-2", "ZeRO-3", "FSDP2 direct")
PREFETCH1 = "ZeRO-3 prefetch 1"
"""ZeRO-3 gathering one unit ahead in forward (the builder's default until results/
sharding.json's commit, where the variants were "ZeRO-3" = this and "ZeRO-3 prefetch 0" =
today's default, the direct FSDP2 baseline's own setting)."""
TIMED_VARIANTS = ("ZeRO-3", PREFETCH1, "FSDP2 direct")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(DIM)
        self.ln2 = nn.LayerNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM, bias=False)
        self.proj = nn.Linear(DIM, DIM)
        self.fc1, self.fc2 = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, 4, d // 4).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randint(0, VOCAB, (PER_WORKER, SEQ + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def step(model: nn.Module, opt: torch.optim.Optimizer, s: int, rank: int) -> None:
    x, y = batch(s, rank)
    opt.zero_grad()
    F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1)).backward()
    opt.step()


def build(variant: str, rank: int, world: int) -> tuple[nn.Module, torch.optim.Optimizer,
                                                         int | None]:
    """The wrapped model, its optimizer and the planner's estimate (None: FSDP2 direct)."""
    from stratagem.analysis import analyze
    from stratagem.planner import estimate_memory
    from stratagem.planner.memory import activation_bytes
    from stratagem.resource import ResourceSpec
    from stratagem.runtime import DistributedModel, compile_plan
    from stratagem.strategy import AllReduce
    from stratagem.strategy.builders import ZeRO

    torch.manual_seed(0)
    model = GPT()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    if variant == "FSDP2 direct":
        from torch.distributed.fsdp import fully_shard

        for b in model.blocks:
            fully_shard(b)
        fully_shard(model.emb)
        fully_shard(model.head)
        fully_shard(model)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        return model, opt, None
    profile = analyze(model)
    builder = (AllReduce() if variant == "replicated" else ZeRO(stage=3, prefetch=1)
               if variant == PREFETCH1 else ZeRO(stage=int(variant[-1])))
    strategy = builder.build(profile, ResourceSpec.local(1))
    est = estimate_memory(strategy, profile, world, state_elements=2,
                          activations=activation_bytes(model, (batch(0, rank)[0],))).peak
    plan = compile_plan(strategy, profile, rank=rank, world_size=world,
                        device=torch.device("cpu"))
    return DistributedModel(model, plan, optimizer=opt), opt, est


def worker(rank: int, world: int, port: int, out: str, timed: bool) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD fixed: freed blocks leave the process
    libc.mallopt(-1, 128 * 1024)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    result: dict = {"memory": {}, "step_s": {}}
    # Warm-up: the libraries' one-time allocations belong to the baseline.
    m, o, _ = build("replicated", rank, world)
    step(m, o, 0, rank)
    del m, o
    gc.collect()
    for variant in VARIANTS:
        dist.barrier()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        base = status("VmRSS")
        m, o, est = build(variant, rank, world)
        times = []
        for s in range(STEPS):
            t = time.perf_counter()
            step(m, o, s, rank)
            times.append(time.perf_counter() - t)
        result["memory"][variant] = {"peak": status("VmHWM") - base, "estimate": est}
        result["step_s"][variant] = statistics.median(times[1:])
        del m, o
        gc.collect()
    if not timed:
        result["step_s"] = {}
        if rank == 0:
            Path(out).write_text(json.dumps({**result, "interleaved_s": {},
                                         "interleaved_cpu_s": {}}))
        dist.barrier()
        dist.destroy_process_group()
        return
    # Interleaved: Stratagem's ZeRO-3 against FSDP2 direct, same model, world and batch.
    pair = {v: build(v, rank, world)[:2] for v in TIMED_VARIANTS}
    timed: dict[str, list[float]] = {v: [] for v in pair}
    cpu: dict[str, list[float]] = {v: [] for v in pair}
    names = list(pair)
    for s in range(TIMED + 2):
        k = s % len(names)  # the order rotates
        for v in names[k:] + names[:k]:
            dist.barrier()
            t, c = time.perf_counter(), time.process_time()
            step(*pair[v], s, rank)
            if s >= 2:
                timed[v].append(time.perf_counter() - t)
                cpu[v].append(time.process_time() - c)
    result["interleaved_s"] = {v: statistics.median(ts) for v, ts in timed.items()}
    # CPU seconds of the process per step (its gloo threads too): less sensitive to what
    # else the loaded machine runs than the wall time
    result["interleaved_cpu_s"] = {v: statistics.median(ts) for v, ts in cpu.items()}
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def run(world: int, timed: bool) -> dict:
    port = free_port()
    out = RESULTS / f".sharding_{world}.tmp.json"
    mp.spawn(worker, args=(world, port, str(out), timed), nprocs=world, join=True)
    data = json.loads(out.read_text())
    out.unlink()
    return data


def main() -> None:
    sys.path.insert(0, str(ROOT / "src"))
    timed = "--memory-only" not in sys.argv
    params = sum(p.numel() for p in GPT().parameters())
    load0 = os.getloadavg()[0]
    result: dict = {"model": {"parameters": params, "fp32_train_state_mib":
                              round(16 * params / 2**20, 1)},
                    "steps": STEPS, "timed_steps": TIMED if timed else 0, "worlds": {}}
    for world in (2, 4):
        r = run(world, timed)
        mem = {v: {"peak_mib": round(x["peak"] / 2**20, 1),
                   "estimate_mib": round(x["estimate"] / 2**20, 1) if x["estimate"] else None,
                   "peak_over_estimate": round(x["peak"] / x["estimate"], 3)
                   if x["estimate"] else None}
               for v, x in r["memory"].items()}
        inter = r["interleaved_s"]
        cpu = r.get("interleaved_cpu_s", {})
        result["worlds"][str(world)] = {
            "memory_per_worker": mem,
            "step_ms": {v: round(s * 1e3, 1) for v, s in r["step_s"].items()},
            "interleaved_step_ms": {v: round(s * 1e3, 1) for v, s in inter.items()},
            "interleaved_cpu_ms": {v: round(s * 1e3, 1) for v, s in cpu.items()},
            "zero3_over_fsdp2": round(inter["ZeRO-3"] / inter["FSDP2 direct"], 3)
            if inter else None,
            "zero3_prefetch1_over_fsdp2": round(inter[PREFETCH1] / inter["FSDP2 direct"], 3)
            if inter else None,
            "cpu_zero3_over_fsdp2": round(cpu["ZeRO-3"] / cpu["FSDP2 direct"], 3)
            if cpu else None,
            "cpu_zero3_prefetch1_over_fsdp2": round(cpu[PREFETCH1] / cpu["FSDP2 direct"], 3)
            if cpu else None}
    result["host"] = {"cores": os.cpu_count(), "loadavg_1m_start": round(load0, 2),
                      "commit": _commit(),
                      "loadavg_1m_end": round(os.getloadavg()[0], 2),
                      "note": "shared machine: other engineers' jobs ran meanwhile"}
    RESULTS.mkdir(exist_ok=True)
    name = "sharding.json" if timed else "sharding_memory.json"
    (RESULTS / name).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

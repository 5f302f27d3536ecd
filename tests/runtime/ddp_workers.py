"""The ddp engine's own cases (runtime/ddp_engine.py), run in spawned gloo workers by
test_ddp_engine.py; the references are plain single-process torch (rt_common)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import rt_workers
import torch
from rt_common import batch, guarded, loss_fn, make_model, make_optimizer
from rt_workers import local_slice, powersgd_roundtrip, regression_data, state, wrap
from torch import nn

from stratagem.errors import DistributedError
from stratagem.strategy import AllReduce

DDP = AllReduce(chunk_size=2, engine="ddp")


def no_sync_case(rank: int, world: int) -> dict:
    """Two micro-batches per step, the first inside no_sync: the big batch's result."""
    dm = wrap(make_model("mlp", seed=rank), rank, world, DDP)
    o = make_optimizer("sgd", dm.parameters())
    sl = local_slice(rank, world)
    synced = 0
    for step in range(10):
        x, y = batch("mlp", step)
        x, y = x[sl], y[sl]
        half = len(x) // 2
        o.zero_grad()
        before = dm.comm_stats.steps
        with dm.no_sync():
            (loss_fn("mlp", dm(x[:half]), y[:half]) / 2).backward()
        synced += dm.comm_stats.steps - before
        (loss_fn("mlp", dm(x[half:]), y[half:]) / 2).backward()
        o.step()
    return {"state": state(dm), "synced_inside_no_sync": synced,
            "steps": dm.comm_stats.steps}


def grad_weight_case(rank: int, world: int) -> dict:
    return rt_workers.grad_weight_case(rank, world, DDP)


def sgd_steps(dm: object, kind: str, rank: int, world: int, steps: int = 10) -> None:
    """``steps`` SGD steps of ``dm`` on this rank's slice of the shared batches."""
    o = make_optimizer("sgd", dm.parameters())
    sl = local_slice(rank, world)
    for step in range(steps):
        x, y = batch(kind, step)
        o.zero_grad()
        loss_fn(kind, dm(x[sl]), y[sl]).backward()
        o.step()


def batchnorm_case(rank: int, world: int) -> dict:
    """Rank 0's buffers on every rank after each step; an eval forward on rank 0 alone
    communicates nothing (rank 1 does not take part: a collective would hang)."""
    dm = wrap(make_model("bn", seed=rank), rank, world, DDP)
    sgd_steps(dm, "bn", rank, world)
    final = state(dm)
    dm.eval()
    out = None
    if rank == 0:
        with torch.no_grad():
            out = dm(batch("bn", 99)[0])
    return {"final": final, "eval_out": out}


def buckets_case(rank: int, world: int) -> dict:
    """Which parameters DDP reduced together (seen by a gradient observer), per step."""
    dm = wrap(make_model("tied", seed=rank), rank, world, AllReduce(chunk_size=2,
                                                                    engine="ddp"))
    o = make_optimizer("sgd", dm.parameters())
    seen: list[tuple[str, frozenset[str]]] = []
    dm.add_grad_observer(lambda event, g, buf, scale: seen.append(
        (event, frozenset(m.param for m in g.members))))
    sl = local_slice(rank, world)
    per_step = []
    for step in range(3):
        x, y = batch("tied", step)
        o.zero_grad()
        seen.clear()
        loss_fn("tied", dm(x[sl]), y[sl]).backward()
        per_step.append(list(seen))
        o.step()
    return {"seen": [[(e, sorted(p)) for e, p in s] for s in per_step],
            "groups": [sorted(g.params) for g in dm.plan.groups],
            "steps": dm.comm_stats.steps, "collectives": dm.comm_stats.collectives,
            "summary": dm.plan.summary()}


def train_mlp_watching(dm: Any, o: Any, seen: list, rank: int, world: int) -> dict:
    """Train the MLP for the workers' steps; the final state, the buckets ``seen`` in the
    last step (the observer appends to it) and the plan's groups."""
    sl = local_slice(rank, world)
    for step in range(rt_workers.STEPS):
        x, y = batch("mlp", step)
        o.zero_grad()
        seen.clear()
        loss_fn("mlp", dm(x[sl]), y[sl]).backward()
        o.step()
    return {"final": state(dm), "last_step_buckets": list(seen),
            "groups": [sorted(g.params) for g in dm.plan.groups]}


def first_bucket_case(rank: int, world: int) -> dict:
    """AllReduce on the ddp engine with a 100-byte first bucket (plain DDP's is 1 MiB): the
    last-registered parameters up to that size are a group, and a DDP bucket, of their
    own; the rest of the MLP is one group (DDP's 25 MiB default)."""
    dm = wrap(make_model("mlp", seed=rank), rank, world,
              AllReduce(engine="ddp", first_bucket_bytes=100))
    o = make_optimizer("sgd", dm.parameters())
    seen: list[list[str]] = []
    dm.add_grad_observer(lambda event, g, buf, scale: seen.append(
        sorted(m.param for m in g.members)) if event == "local" else None)
    return train_mlp_watching(dm, o, seen, rank, world)


def bucket_bytes_case(rank: int, world: int) -> dict:
    """AllReduce(engine="ddp", bucket_bytes=150, first_bucket_bytes=0) on the MLP: groups of
    150 bytes in DDP's fill order (no 1 MiB first bucket, which would hold it all), each one
    DDP bucket (seen by an observer on the Python hook), and training
    on DDP's C++ reducer (no observer) as well."""
    out: dict[str, Any] = {}
    for watched in (True, False):
        dm = wrap(make_model("mlp", seed=rank), rank, world,
                  AllReduce(engine="ddp", bucket_bytes=150, first_bucket_bytes=0))
        o = make_optimizer("sgd", dm.parameters())
        seen: list[list[str]] = []
        if watched:
            dm.add_grad_observer(lambda event, g, buf, scale, seen=seen: seen.append(
                sorted(m.param for m in g.members)) if event == "local" else None)
        key = "python" if watched else "cpp"
        out[key] = {**train_mlp_watching(dm, o, seen, rank, world),
                    "hook": dm._reducer.hook_name}
    return out


def hook_case(rank: int, world: int) -> dict:
    """Which hook reduces: DDP's C++ reducer without observers; an observer added on
    every rank after some steps brings a new DDP with the Python hook, and training goes on
    as one process's would (tied weights: the model's shared parameter once)."""
    dm = wrap(make_model("tied", seed=rank), rank, world, DDP)
    o = make_optimizer("sgd", dm.parameters())
    sl = local_slice(rank, world)
    hooks, calls = [], []
    for step in range(rt_workers.STEPS):
        if step == 5:
            dm.add_grad_observer(lambda event, g, buf, scale: calls.append(event))
        x, y = batch("tied", step)
        o.zero_grad()
        loss_fn("tied", dm(x[sl]), y[sl]).backward()
        o.step()
        hooks.append(dm._reducer.hook_name)
    return {"state": state(dm), "hooks": hooks, "observed": len(calls),
            "steps": dm.comm_stats.steps, "collectives": dm.comm_stats.collectives,
            "repr": dm.extra_repr(), "summary": dm.plan.summary()}


def fp16_hooks_case(rank: int, world: int) -> dict:
    """fp16 on the ddp engine: torch's built-in C++ FP16_COMPRESS hook, and the same with
    an observer (torch's Python fp16_compress_hook): the same halves on the wire."""
    out: dict[str, Any] = {}
    for observed in (False, True):
        dm = wrap(make_model("mlp", seed=rank), rank, world,
                  AllReduce(chunk_size=2, compressor="fp16", engine="ddp"))
        if observed:
            dm.add_grad_observer(lambda *a: None)
        sgd_steps(dm, "mlp", rank, world)
        out["python" if observed else "cpp"] = {"state": state(dm),
                                                "hook": dm._reducer.hook_name,
                                                "bytes": dm.comm_stats.payload_bytes}
    return out


def unused_case(rank: int, world: int) -> str:
    """A parameter without a gradient: refused at the next forward, with the fix."""
    dm = wrap(make_model("gated", seed=rank), rank, world, DDP)
    o = make_optimizer("plain_sgd", dm.parameters())
    sl = local_slice(rank, world)
    try:
        for step in range(4):
            x, y = batch("gated", step)
            o.zero_grad()
            loss_fn("gated", dm(x[sl], step % 2 == 0), y[sl]).backward()
            o.step()
    except DistributedError as exc:
        return str(exc)
    return "no error"


def regroup_case(rank: int, world: int) -> dict:
    """replan to the same strategy on the other engine and back: DDP goes and comes back,
    training goes on as one process's would."""
    from stratagem.analysis import analyze
    from stratagem.resource import ResourceSpec
    from stratagem.runtime import compile_plan

    model = make_model("mlp", seed=rank)
    dm = wrap(model, rank, world, DDP)
    o = make_optimizer("sgd", dm.parameters())
    sl = local_slice(rank, world)
    profile = analyze(model)
    engines = []
    for step in range(9):
        if step in (3, 6):
            builder = AllReduce(chunk_size=2, engine="stratagem" if step == 3 else "ddp")
            dm.replan(lambda b=builder: compile_plan(
                b.build(profile, ResourceSpec.local(world)), profile, rank=rank,
                world_size=world, device=torch.device("cpu")))
        engines.append(type(dm._reducer).__name__)
        x, y = batch("mlp", step)
        o.zero_grad()
        loss_fn("mlp", dm(x[sl]), y[sl]).backward()
        o.step()
    return {"state": state(dm), "engines": engines, "steps": dm.comm_stats.steps}


def checkpoint_case(rank: int, world: int, ckpt_dir: str) -> dict:
    """checkpoint.save / load with PowerSGD on the ddp engine: every rank's state."""
    from stratagem import checkpoint

    x, y = regression_data()
    per = 32 // world
    builder = AllReduce(chunk_size=2, compressor="powersgd", powersgd_rank=2, engine="ddp")

    def run(dm: Any, o: Any, steps: range) -> None:
        for step in steps:
            lo = (step * 32) % 256 + rank * per
            o.zero_grad()
            nn.functional.mse_loss(dm(x[lo:lo + per]), y[lo:lo + per]).backward()
            o.step()

    from rt_workers import Regressor

    torch.manual_seed(0)
    dm = wrap(Regressor(), rank, world, builder)
    o = torch.optim.SGD(dm.parameters(), lr=0.05, momentum=0.9)
    run(dm, o, range(4))
    path = Path(ckpt_dir) / "ddp-powersgd"
    checkpoint.save(path, dm, o)
    run(dm, o, range(4, 8))
    continued = state(dm)
    torch.manual_seed(50 + rank)
    dm2 = wrap(Regressor(), rank, world, builder)
    o2 = torch.optim.SGD(dm2.parameters(), lr=0.05, momentum=0.9)
    checkpoint.load(path, dm2, o2)
    run(dm2, o2, range(4, 8))
    return {"files": sorted(p.name for p in path.iterdir()), "continued": continued,
            "resumed": state(dm2)}


def suite(rank: int, world: int, ckpt_dir: str) -> dict:
    out: dict[str, Any] = {}
    for name, fn in [("no_sync", no_sync_case), ("grad_weight", grad_weight_case),
                     ("batchnorm", batchnorm_case), ("buckets", buckets_case),
                     ("first_bucket", first_bucket_case), ("hook", hook_case),
                     ("bucket_bytes", bucket_bytes_case),
                     ("fp16_hooks", fp16_hooks_case),
                     ("unused", unused_case), ("replan", regroup_case),
                     ("powersgd_roundtrip",
                      lambda r, w: powersgd_roundtrip(r, w, engine="ddp"))]:
        out[name] = guarded(lambda fn=fn: fn(rank, world))
    out["checkpoint"] = guarded(lambda: checkpoint_case(rank, world, ckpt_dir))
    return out

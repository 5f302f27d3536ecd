"""Engine-side cases, run inside spawned worker processes (see rt_common.spawn)."""

from __future__ import annotations

import copy
import io
from typing import Any

import torch
from rt_common import BATCH, STEPS, batch, guarded, loss_fn, make_model, make_optimizer, sparse_adam
from torch import nn

from stratagem.analysis import analyze
from stratagem.errors import DistributedError
from stratagem.resource import ResourceSpec
from stratagem.runtime import DistributedModel, compile_plan
from stratagem.strategy import AllReduce, PartitionedAR, RandomAxisPartitionAR

BUILDERS = {
    "AllReduce": lambda comp="none": AllReduce(chunk_size=2, compressor=comp),
    "PartitionedAR": lambda comp="none": PartitionedAR(chunk_size=3, compressor=comp),
    "RandomAxisPartitionAR": lambda comp="none": RandomAxisPartitionAR(chunk_size=3, seed=1,
                                                                      compressor=comp),
    # torch's DDP reducer running the groups (runtime/ddp_engine.py)
    "AllReduceDDP": lambda comp="none": AllReduce(chunk_size=2, compressor=comp, engine="ddp"),
}
EQUIV_CASES = [(b, o, m) for b in BUILDERS for o in ("sgd", "adam") for m in ("mlp", "tied")]


def wrap(model: nn.Module, rank: int, world: int, builder: Any) -> DistributedModel:
    profile = analyze(model)
    strategy = builder.build(profile, ResourceSpec.local(world))
    plan = compile_plan(strategy, profile, rank=rank, world_size=world,
                        device=torch.device("cpu"))
    return DistributedModel(model, plan)


def state(m: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def local_slice(rank: int, world: int, sizes: list[int] | None = None) -> slice:
    sizes = sizes or [BATCH // world] * world
    lo = sum(sizes[:rank])
    return slice(lo, lo + sizes[rank])


def train(rank: int, world: int, model_name: str, opt: str, builder: Any,
          steps: int = STEPS, set_to_none: bool = True) -> dict[str, torch.Tensor]:
    dm = wrap(make_model(model_name, seed=rank), rank, world, builder)  # seeds differ
    o = make_optimizer(opt, dm.parameters())
    sl = local_slice(rank, world)
    for step in range(steps):
        x, y = batch(model_name, step)
        o.zero_grad(set_to_none=set_to_none)
        out = dm(x[sl], step % 2 == 0) if model_name == "gated" else dm(x[sl])
        loss_fn(model_name, out, y[sl]).backward()
        o.step()
    return state(dm)


# -- case groups ------------------------------------------------------------------------
def equivalence(rank: int, world: int) -> dict:
    return {f"{b}/{o}/{m}": guarded(lambda b=b, o=o, m=m: train(
        rank, world, m, o, BUILDERS[b](), set_to_none=(o == "sgd")))
        for b, o, m in EQUIV_CASES}


def grad_weight_case(rank: int, world: int, builder: Any = None) -> dict:
    """Uneven local batches weighted by ``grad_weight`` (``builder``: AllReduce's default)."""
    sizes = [3, 5]
    dm = wrap(make_model("mlp", seed=rank), rank, world, builder or BUILDERS["AllReduce"]())
    o = make_optimizer("sgd", dm.parameters())
    sl = local_slice(rank, world, sizes)
    dm.grad_weight = sizes[rank] * world / BATCH
    for step in range(10):
        x, y = batch("mlp", step)
        o.zero_grad()
        loss_fn("mlp", dm(x[sl]), y[sl]).backward()
        o.step()
    return state(dm)


def no_sync_case(rank: int, world: int) -> dict:
    dm = wrap(make_model("mlp", seed=rank), rank, world, BUILDERS["PartitionedAR"]())
    o = make_optimizer("sgd", dm.parameters())
    sl = local_slice(rank, world)
    synced = []
    for step in range(10):
        x, y = batch("mlp", step)
        x, y = x[sl], y[sl]
        half = len(x) // 2
        o.zero_grad()
        before = dm.comm_stats.steps
        with dm.no_sync():
            (loss_fn("mlp", dm(x[:half]), y[:half]) / 2).backward()
        synced.append(dm.comm_stats.steps - before)
        (loss_fn("mlp", dm(x[half:]), y[half:]) / 2).backward()
        o.step()
    return {"state": state(dm), "synced_inside_no_sync": sum(synced),
            "steps": dm.comm_stats.steps}


def batchnorm_case(rank: int, world: int) -> dict:
    dm = wrap(make_model("bn", seed=rank), rank, world, BUILDERS["AllReduce"]())
    o = make_optimizer("sgd", dm.parameters())
    sl = local_slice(rank, world)
    initial = state(dm)
    for step in range(10):
        x, y = batch("bn", step)
        o.zero_grad()
        loss_fn("bn", dm(x[sl]), y[sl]).backward()
        o.step()
    dm.eval()
    with torch.no_grad():
        out = dm(batch("bn", 99)[0])
    return {"initial": initial, "final": state(dm), "eval_out": out}


def stats_case(rank: int, world: int) -> dict:
    dm = wrap(make_model("mlp", seed=rank), rank, world, AllReduce(chunk_size=1))
    o = make_optimizer("sgd", dm.parameters())
    launched: list[int] = []
    reducer = dm._reducer
    original = reducer._launch

    def record(g: Any) -> None:
        launched.append(g.plan.id)
        original(g)

    reducer._launch = record
    sl = local_slice(rank, world)
    buffers = [g.buffer.data_ptr() for g in reducer.groups]
    grads_in_buffers = []
    for step in range(3):
        x, y = batch("mlp", step)
        o.zero_grad(set_to_none=step != 1)
        loss_fn("mlp", dm(x[sl]), y[sl]).backward()
        grads_in_buffers.append(all(
            m.param.grad.data_ptr() == m.view.data_ptr()
            for g in reducer.groups for m in g.members))
        o.step()
    s = dm.comm_stats
    return {"launched": launched, "order": list(dm.plan.launch_order),
            "nbytes": sum(g.nbytes for g in dm.plan.groups), "collectives": s.collectives,
            "overlapped": s.overlapped, "payload": s.payload_bytes, "wire": s.wire_bytes,
            "steps": s.steps, "wait": s.wait_seconds,
            "grads_in_buffers": grads_in_buffers,
            "buffers_kept": buffers == [g.buffer.data_ptr() for g in reducer.groups]}


def unused_case(rank: int, world: int) -> dict:
    return train(rank, world, "gated", "plain_sgd", AllReduce(chunk_size=1), steps=6)


def sparse_case(rank: int, world: int) -> dict:
    return train(rank, world, "sparse", "plain_sgd", BUILDERS["PartitionedAR"](), steps=8)


def sparse_adam_case(rank: int, world: int) -> dict:
    """SparseAdam over the sparse embedding, whole (AllReduce) and split by rows
    (PartitionedAR): its step gets the rows of the gradient summed densely."""
    out = {}
    for name in ("AllReduce", "PartitionedAR"):
        dm = wrap(make_model("sparse", seed=rank), rank, world, BUILDERS[name]())
        opts = sparse_adam(dm.module)
        sl = local_slice(rank, world)
        for step in range(6):
            x, y = batch("sparse", step)
            for o in opts:
                o.zero_grad()
            loss_fn("sparse", dm(x[sl]), y[sl]).backward()
            for o in opts:
                o.step()
        out[name] = state(dm)
    return out


class GatherRows:
    """AllReduce's strategy, with every sparse-gradient parameter's rows all-gathered
    (each in its own group) instead of summed densely."""

    def build(self, profile: Any, spec: ResourceSpec) -> Any:
        from dataclasses import replace

        from stratagem.strategy import AllReduceSynchronizer

        s = AllReduce(chunk_size=2).build(profile, spec)
        return replace(s, node_config=tuple(
            replace(nc, synchronizer=AllReduceSynchronizer(gather_rows=True, group=100 + i))
            if profile.get(nc.var_name).sparse else nc
            for i, nc in enumerate(s.node_config)))


def gather_rows_case(rank: int, world: int) -> dict:
    """The sparse embedding's rows all-gathered: plain SGD and SparseAdam take the summed
    rows as a sparse gradient, as in single-process training."""
    sgd = train(rank, world, "sparse", "plain_sgd", GatherRows(), steps=8)
    dm = wrap(make_model("sparse", seed=rank), rank, world, GatherRows())
    opts = sparse_adam(dm.module)
    sl = local_slice(rank, world)
    sparse_grads = []
    for step in range(6):
        x, y = batch("sparse", step)
        for o in opts:
            o.zero_grad()
        loss_fn("sparse", dm(x[sl]), y[sl]).backward()
        sparse_grads.append(dm.module.emb.weight.grad.is_sparse)
        for o in opts:
            o.step()
    return {"sgd": sgd, "sparse_adam": state(dm), "sparse_grads": sparse_grads,
            "summary": dm.plan.summary()}


def sparse_columns_case(rank: int, world: int) -> dict:
    """The sparse embedding split along its columns (axis 1, 5 parts; seed 0)."""
    return train(rank, world, "sparse", "plain_sgd",
                 RandomAxisPartitionAR(chunk_size=3, seed=0), steps=8)


def wrong_rank_case(rank: int, world: int) -> str:
    model = make_model("mlp", 0)
    profile = analyze(model)
    plan = compile_plan(AllReduce().build(profile, ResourceSpec.local(world)), profile,
                        rank=world - 1 - rank, world_size=world, device=torch.device("cpu"))
    try:
        DistributedModel(model, plan)
    except DistributedError as exc:
        return str(exc)
    return "no error"


# -- compressors ----------------------------------------------------------------------
class Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 32)
        self.fc3 = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


def regression_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(256, 16, generator=g)
    w = torch.randn(16, 4, generator=g)
    return x, torch.sin(x @ w)


def compressor_run(rank: int, world: int, comp: str, steps: int = 150) -> dict:
    torch.manual_seed(rank)
    dm = wrap(Regressor(), rank, world, AllReduce(chunk_size=3, compressor=comp,
                                                  powersgd_rank=2))
    o = torch.optim.SGD(dm.parameters(), lr=0.1, momentum=0.9)
    x, y = regression_data()
    per = 32 // world
    for step in range(steps):
        lo = (step * 32) % 256 + rank * per
        o.zero_grad()
        nn.functional.mse_loss(dm(x[lo:lo + per]), y[lo:lo + per]).backward()
        o.step()
    with torch.no_grad():
        loss = nn.functional.mse_loss(dm.module(x), y).item()
    compressed = sum(getattr(g.compressor, "compressed", 0) for g in dm._reducer.groups)
    return {"loss": loss, "payload": dm.comm_stats.payload_bytes, "compressed": compressed,
            "params": state(dm)}


def compressors(rank: int, world: int) -> dict:
    return {c: guarded(lambda c=c: compressor_run(rank, world, c))
            for c in ("none", "fp16", "bf16", "powersgd")}


def powersgd_roundtrip(rank: int, world: int, engine: str = "stratagem") -> dict:
    x, y = regression_data()
    per = 32 // world
    builder = AllReduce(chunk_size=2, compressor="powersgd", powersgd_rank=2, engine=engine)

    def run(dm: DistributedModel, o: torch.optim.Optimizer, steps: range) -> None:
        for step in steps:
            lo = (step * 32) % 256 + rank * per
            o.zero_grad()
            nn.functional.mse_loss(dm(x[lo:lo + per]), y[lo:lo + per]).backward()
            o.step()

    torch.manual_seed(0)
    dm = wrap(Regressor(), rank, world, builder)
    o = torch.optim.SGD(dm.parameters(), lr=0.05, momentum=0.9)
    run(dm, o, range(5))
    buf = io.BytesIO()
    torch.save({"model": dm.state_dict(), "opt": o.state_dict(),
                "sync": dm.synchronizer_state_dict()}, buf)
    sync_keys = sorted(dm.synchronizer_state_dict())
    run(dm, o, range(5, 10))
    continued = state(dm)

    results = {}
    for load_sync in (True, False):
        buf.seek(0)
        saved = torch.load(buf, weights_only=True)
        torch.manual_seed(100 + rank)
        dm2 = wrap(Regressor(), rank, world, builder)
        dm2.load_state_dict(saved["model"])
        o2 = torch.optim.SGD(dm2.parameters(), lr=0.05, momentum=0.9)
        o2.load_state_dict(copy.deepcopy(saved["opt"]))
        if load_sync:
            dm2.load_synchronizer_state_dict(saved["sync"])
        run(dm2, o2, range(5, 10))
        results[load_sync] = state(dm2)
    return {"continued": continued, "reloaded": results[True], "fresh": results[False],
            "keys": sync_keys}


def save_case(rank: int, world: int, ckpt_dir: str) -> dict:
    """``checkpoint.save`` without parameter servers: every rank calling it (one writes,
    the others wait), rank 0 alone, and PowerSGD (per-rank state: collective)."""
    from pathlib import Path

    from stratagem import checkpoint

    x, y = regression_data()
    per = 32 // world
    out: dict = {}
    for name, comp in (("allreduce", "none"), ("powersgd", "powersgd")):
        torch.manual_seed(0)
        dm = wrap(Regressor(), rank, world, AllReduce(chunk_size=2, compressor=comp,
                                                      powersgd_rank=2))
        o = torch.optim.SGD(dm.parameters(), lr=0.05, momentum=0.9)
        for step in range(3):
            lo = step * 32 + rank * per
            o.zero_grad()
            nn.functional.mse_loss(dm(x[lo:lo + per]), y[lo:lo + per]).backward()
            o.step()
        path = Path(ckpt_dir) / f"{name}-all"
        checkpoint.save(path, dm, o)  # every rank
        out[name] = {"files": sorted(p.name for p in path.iterdir()), "state": state(dm),
                     "saved": checkpoint.load_file(path, "model.pt")}
        if name == "allreduce" and rank == 0:  # rank 0 alone; rank 1 has moved on
            alone = checkpoint.save(Path(ckpt_dir) / "alone", dm, o)
            out["alone"] = checkpoint.load_file(alone, "model.pt")
    return out


def world2(rank: int, world: int, ckpt_dir: str) -> dict:
    out = equivalence(rank, world)
    out["save"] = guarded(lambda: save_case(rank, world, ckpt_dir))
    for name, fn in [("grad_weight", grad_weight_case), ("no_sync", no_sync_case),
                     ("batchnorm", batchnorm_case), ("stats", stats_case),
                     ("unused", unused_case), ("sparse", sparse_case),
                     ("sparse_adam", sparse_adam_case),
                     ("sparse_columns", sparse_columns_case),
                     ("gather_rows", gather_rows_case),
                     ("wrong_rank", wrong_rank_case), ("compressors", compressors),
                     ("powersgd_roundtrip", powersgd_roundtrip)]:
        out[name] = guarded(lambda fn=fn: fn(rank, world))
    return out


def world4(rank: int, world: int) -> dict:
    out = equivalence(rank, world)
    out["batchnorm"] = guarded(lambda: batchnorm_case(rank, world))
    out["gather_rows"] = guarded(lambda: gather_rows_case(rank, world))
    return out

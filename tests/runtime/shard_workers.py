"""Sharded-strategy cases, run inside spawned worker processes (see rt_common.spawn)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from rt_common import STEPS, batch, guarded, loss_fn, make_model, make_optimizer
from rt_workers import local_slice
from torch.distributed.optim import ZeroRedundancyOptimizer

from stratagem.analysis import analyze
from stratagem.resource import ResourceSpec
from stratagem.runtime import DistributedModel, compile_plan
from stratagem.strategy import (
    AllReduceSynchronizer,
    NodeConfig,
    ShardedSynchronizer,
    Strategy,
)
from stratagem.strategy.builders import ZeRO


def mixed(profile: Any) -> Strategy:
    """fc1 stage 3 (its own unit), fc2 all-reduced, fc3.weight stage 2, fc3.bias stage 1."""
    syncs = {"fc1": ShardedSynchronizer(stage=3, prefetch=0),
             "fc2": AllReduceSynchronizer(),
             "fc3.weight": ShardedSynchronizer(stage=2),
             "fc3.bias": ShardedSynchronizer(stage=1)}
    return Strategy(node_config=tuple(
        NodeConfig(var_name=n, synchronizer=syncs.get(n, syncs.get(n.split(".")[0])))
        for n in profile.names))


CASES: dict[str, Any] = {
    "zero1": lambda p: ZeRO(stage=1).build(p, ResourceSpec.local(1)),
    "zero2": lambda p: ZeRO(stage=2).build(p, ResourceSpec.local(1)),
    "zero3": lambda p: ZeRO(stage=3).build(p, ResourceSpec.local(1)),
    "zero3_keep": lambda p: ZeRO(stage=3, reshard_after_forward=False, prefetch=0).build(
        p, ResourceSpec.local(1)),
    "mixed": mixed,
}


def state_numel(opt: torch.optim.Optimizer) -> int:
    """Elements of optimizer state this rank holds (local shards of DTensors)."""
    total = 0
    for st in opt.state.values():
        for v in st.values():
            if torch.is_tensor(v) and v.dim() > 0:
                total += (v.to_local() if hasattr(v, "to_local") else v).numel()
    return total


def train(rank: int, world: int, case: str, steps: int = STEPS, accumulate: bool = False
          ) -> dict:
    model = make_model("mlp", seed=rank)
    opt = make_optimizer("adam", model.parameters())
    profile = analyze(model)
    strategy = CASES[case](profile)
    plan = compile_plan(strategy.with_replicas([]), profile, rank=rank, world_size=world,
                        device=torch.device("cpu"))
    dm = DistributedModel(model, plan, optimizer=opt)
    sl = local_slice(rank, world)
    for step in range(steps):
        x, y = batch("mlp", step)
        opt.zero_grad()
        if accumulate:  # two micro-batches, the first without sync
            half = (sl.stop - sl.start) // 2
            a, b = slice(sl.start, sl.start + half), slice(sl.start + half, sl.stop)
            with dm.no_sync():
                (loss_fn("mlp", dm(x[a]), y[a]) / 2).backward()
            (loss_fn("mlp", dm(x[b]), y[b]) / 2).backward()
        else:
            loss_fn("mlp", dm(x[sl]), y[sl]).backward()
        opt.step()
    full = dm.full_state_dict()
    return {"state": full, "state_numel": state_numel(opt),
            "plan": plan.summary()}


def torch_zero(rank: int, world: int, steps: int = STEPS) -> dict:
    """The same training with torch's ZeroRedundancyOptimizer (gradients all-reduced by
    hand, as DDP would): the engine Stratagem's stage 1 is checked against."""
    model = make_model("mlp", seed=0)
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam,
                                  lr=0.01)
    sl = local_slice(rank, world)
    for step in range(steps):
        x, y = batch("mlp", step)
        opt.zero_grad()
        loss_fn("mlp", model(x[sl]), y[sl]).backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad.div_(world)
        opt.step()
    return {"state": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "state_numel": state_numel(opt.optim)}


def full_state_roundtrip(rank: int, world: int) -> dict:
    """A stage-3 job's full state dict loads into a fresh stage-3 job of this world size."""
    model = make_model("mlp", seed=rank)
    opt = make_optimizer("adam", model.parameters())
    profile = analyze(model)
    plan = compile_plan(CASES["zero3"](profile).with_replicas([]), profile, rank=rank,
                        world_size=world, device=torch.device("cpu"))
    dm = DistributedModel(model, plan, optimizer=opt)
    want = make_model("mlp", seed=7).state_dict()
    dm.load_full_state_dict(want)
    return {"loaded": dm.full_state_dict(), "want": want}


def world(rank: int, world: int) -> dict:
    out = {case: guarded(lambda case=case: train(rank, world, case)) for case in CASES}
    out["zero2_accumulate"] = guarded(lambda: train(rank, world, "zero2", accumulate=True))
    out["zero3_accumulate"] = guarded(lambda: train(rank, world, "zero3", accumulate=True))
    out["torch_zero"] = guarded(lambda: torch_zero(rank, world))
    out["roundtrip"] = guarded(lambda: full_state_roundtrip(rank, world))
    return out

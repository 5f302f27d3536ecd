"""Stage-3 regroups run inside spawned workers (see test_shard_regroup.py): 4 -> 2 -> 3.

The calls the elastic lifecycle makes, without its store: ``before_regroup`` in the old
group, the old group destroyed, a new one formed (a FileStore per generation), rank 0's
optimizer state handed to a newcomer, ``regroup`` with the new world's plan. Global batch
``N`` splits evenly over 4, 2 and 3 workers, so the training equals one process's.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from rt_common import MLP, batch, guarded, loss_fn, make_model, make_optimizer
from shard_workers import CASES, state_numel

from stratagem.analysis import analyze
from stratagem.elastic import wire
from stratagem.errors import StratagemError
from stratagem.runtime import DistributedModel, MetaInit, compile_plan
from stratagem.runtime.materialize import materialize

N = 12  # global batch
PHASES = ((4, range(0, 3)), (2, range(3, 6)), (3, range(6, 9)))  # (world, steps)
STEPS = 9


def new_model(case: str, seed: int) -> tuple[torch.nn.Module, MetaInit | None]:
    """The MLP, eager (seeded by ``seed``) or, for a ``_meta`` case, built on the meta
    device and given values by MetaInit (unit by unit, each sharded as it is made)."""
    if not case.endswith("_meta"):
        return make_model("mlp", seed=seed), None
    with torch.device("meta"):
        return MLP().double(), MetaInit(seed=0)


def plan_for(module: torch.nn.Module, case: str, rank: int, world: int) -> Any:
    profile = analyze(module)
    strategy = CASES[case.removesuffix("_meta")](profile).with_replicas([])
    return compile_plan(strategy, profile, rank=rank, world_size=world,
                        device=torch.device("cpu"))


def join(out: Path, name: str, rank: int, world: int) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(str(out / name), world), rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))


def train(dm: DistributedModel, opt: torch.optim.Optimizer, rank: int, world: int,
          steps: range) -> None:
    per = N // world
    for step in steps:
        x, y = batch("mlp", step, n=N)
        opt.zero_grad()
        loss_fn("mlp", dm(x[rank * per:(rank + 1) * per]), y[rank * per:(rank + 1) * per]
                ).backward()
        opt.step()


def chain(rank: int, out: Path, case: str) -> dict[str, Any]:
    """4 workers train; ranks 2 and 3 leave; 0 and 1 train; rank 2 comes back as a
    newcomer (a fresh model, rank 0's optimizer state) and three train."""
    out.mkdir(parents=True, exist_ok=True)
    join(out, f"{case}-g0", rank, 4)
    model, meta = new_model(case, rank)  # (different values: rank 0's are broadcast)
    opt = make_optimizer("adam", model.parameters())
    dm = DistributedModel(model, plan_for(model, case, rank, 4), optimizer=opt,
                          materialize=meta)
    train(dm, opt, rank, 4, PHASES[0][1])
    held = {4: state_numel(opt)}
    dm.before_regroup()
    rebuilt = dm.module is not model
    try:
        dm(batch("mlp", 0, n=N)[0])
        refused = False
    except StratagemError:
        refused = True
    dist.destroy_process_group()
    if rank == 3:
        return {"left": True, "held": held}
    if rank == 2:  # a newcomer: alone first (world 1), then rank 0's state
        fresh, meta = new_model(case, 9)
        opt = make_optimizer("adam", fresh.parameters())
        dm = DistributedModel(fresh, plan_for(fresh, case, 0, 1), optimizer=opt,
                              materialize=meta)
        join(out, f"{case}-g2", 2, 3)
        opt.load_state_dict(wire.broadcast_state(None)["optimizer"])
    else:
        join(out, f"{case}-g1", rank, 2)
        dm.regroup(plan_for(dm.module, case, rank, 2), broadcast=False)
        train(dm, opt, rank, 2, PHASES[1][1])
        held[2] = state_numel(opt)
        dm.before_regroup()
        dist.destroy_process_group()
        join(out, f"{case}-g2", rank, 3)
        wire.broadcast_state({"optimizer": opt.state_dict()} if rank == 0 else None)
    dm.regroup(plan_for(dm.module, case, rank, 3), broadcast=True)
    train(dm, opt, rank, 3, PHASES[2][1])
    held[3] = state_numel(opt)
    whole, optimizer = dm.full_state_dict(), dm.full_optimizer_state_dict(opt)
    dist.destroy_process_group()
    return {"state": whole, "optimizer": optimizer, "held": held, "rebuilt": rebuilt,
            "refused": refused, "sharded": dm.is_sharded}


def run(rank: int, world: int, where: Path, cases: tuple[str, ...]) -> dict[str, Any]:
    dist.destroy_process_group()  # (each case forms its own groups)
    return {case: guarded(lambda case=case: chain(rank, where / case, case)) for case in cases}


def reference(case: str = "") -> dict[str, Any]:
    """The same global batches in one process, plain torch (a ``_meta`` case's model
    given its values by the same materialization)."""
    model, meta = new_model(case, 0)
    if meta is not None:
        materialize(model, meta, torch.device("cpu"))
    opt = make_optimizer("adam", model.parameters())
    for step in range(STEPS):
        x, y = batch("mlp", step, n=N)
        opt.zero_grad()
        loss_fn("mlp", model(x), y).backward()
        opt.step()
    return {"state": model.state_dict(), "optimizer": opt.state_dict()}

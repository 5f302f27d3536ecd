"""Sharded checkpoints across world sizes, run inside spawned worker processes: train the
first half on one world, save (every rank its pieces), resume the second half on another
world (see test_sharded_checkpoint.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from rt_common import STEPS, batch, guarded, loss_fn, make_model, make_optimizer
from rt_workers import local_slice
from shard_workers import CASES

from stratagem import checkpoint
from stratagem.analysis import analyze
from stratagem.runtime import DistributedModel, compile_plan

HALF = STEPS // 2


def wrap(rank: int, world: int, case: str) -> tuple[DistributedModel, torch.optim.Optimizer]:
    model = make_model("mlp", seed=rank + 11)  # not the reference's values: loading must
    opt = make_optimizer("adam", model.parameters())
    profile = analyze(model)
    plan = compile_plan(CASES[case](profile).with_replicas([]), profile, rank=rank,
                        world_size=world, device=torch.device("cpu"))
    return DistributedModel(model, plan, optimizer=opt), opt


def steps(dm: DistributedModel, opt: torch.optim.Optimizer, rank: int, world: int,
          first: int, last: int) -> None:
    sl = local_slice(rank, world)
    for step in range(first, last):
        x, y = batch("mlp", step)
        opt.zero_grad()
        loss_fn("mlp", dm(x[sl]), y[sl]).backward()
        opt.step()


def first_half(rank: int, world: int, case: str, ckpt: Path) -> dict[str, Any]:
    """Train steps [0, HALF) from the reference's start, save sharded and full."""
    dm, opt = wrap(rank, world, case)
    dm.load_full_state_dict(make_model("mlp", seed=0).state_dict())  # the reference's start
    steps(dm, opt, rank, world, 0, HALF)
    checkpoint.save(ckpt / f"{case}-sharded", dm, opt)
    checkpoint.save(ckpt / f"{case}-full", dm, opt, full=True)
    return {"sharded": dm.is_sharded}


def second_half(rank: int, world: int, case: str, source: str, ckpt: Path) -> dict[str, Any]:
    """Load ``source``'s checkpoint, train steps [HALF, STEPS), return the whole state."""
    dm, opt = wrap(rank, world, case)
    checkpoint.load(ckpt / source, dm, opt)
    steps(dm, opt, rank, world, HALF, STEPS)
    return {"state": dm.full_state_dict(), "optimizer": dm.full_optimizer_state_dict(opt)}


SAVED = ("zero1", "zero2", "zero3", "mixed")


def save_world(rank: int, world: int, ckpt: Path) -> dict[str, Any]:
    return {case: guarded(lambda case=case: first_half(rank, world, case, ckpt))
            for case in SAVED}


RESUMED = {  # case resumed on the second world: the checkpoint it loads
    "zero1": "zero1-sharded", "zero2": "zero2-sharded", "zero3": "zero3-sharded",
    "mixed": "mixed-sharded", "zero3_from_full": "zero3-full",
    "zero1_from_zero3": "zero3-sharded", "zero3_from_mixed": "mixed-sharded",
}


def train_plain(n: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The reference: one process, plain torch, the whole batch of steps 0..n-1."""
    model = make_model("mlp", seed=0)
    opt = make_optimizer("adam", model.parameters())
    for step in range(n):
        x, y = batch("mlp", step)
        opt.zero_grad()
        loss_fn("mlp", model(x), y).backward()
        opt.step()
    return model, opt


def stepped_before_wrapping(rank: int, world: int, case: str) -> dict[str, Any]:
    """Plain torch for the first half (the whole batch, on every rank alike), then the
    model and its optimizer, state and all, are wrapped: sharding takes the state over."""
    model, opt = train_plain(HALF)
    profile = analyze(model)
    plan = compile_plan(CASES[case](profile).with_replicas([]), profile, rank=rank,
                        world_size=world, device=torch.device("cpu"))
    dm = DistributedModel(model, plan, optimizer=opt)
    steps(dm, opt, rank, world, HALF, STEPS)
    return {"state": dm.full_state_dict(), "optimizer": dm.full_optimizer_state_dict(opt)}


WRAPPED = ("zero2", "zero3")


def load_world(rank: int, world: int, ckpt: Path) -> dict[str, Any]:
    out = {name: guarded(lambda name=name, src=src: second_half(
               rank, world, name.split("_from_")[0], src, ckpt))
           for name, src in RESUMED.items()}
    for case in WRAPPED:
        out[f"{case}_wrapped_late"] = guarded(
            lambda case=case: stepped_before_wrapping(rank, world, case))
    return out

"""World size 1: plain `python`, no process group, no communication."""

from __future__ import annotations

import pytest
import torch
from rt_common import batch, loss_fn, make_model, make_optimizer, reference

from stratagem.analysis import analyze
from stratagem.errors import (
    DistributedError,
    StratagemError,
    StrategyError,
    UnsupportedModelError,
)
from stratagem.resource import ResourceSpec
from stratagem.runtime import DistributedModel, compile_plan
from stratagem.strategy import AllReduce, PartitionedAR


def wrap(model: torch.nn.Module, world: int = 1, builder=None) -> DistributedModel:
    profile = analyze(model)
    strategy = (builder or PartitionedAR(chunk_size=3)).build(profile, ResourceSpec.local(world))
    plan = compile_plan(strategy, profile, rank=0, world_size=world, device=torch.device("cpu"))
    return DistributedModel(model, plan)


def test_single_process_trains_like_plain_torch() -> None:
    assert not torch.distributed.is_initialized()
    dm = wrap(make_model("tied", 0), builder=AllReduce(compressor="powersgd"))
    opt = make_optimizer("adam", dm.parameters())
    for step in range(10):
        x, y = batch("tied", step)
        opt.zero_grad()
        loss_fn("tied", dm(x), y).backward()
        opt.step()
    want = reference("tied", "adam", steps=10)
    got = dm.state_dict()
    assert got.keys() == want.keys()  # no "module." prefix
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0)
    assert dm.comm_stats.collectives == 0 and dm.comm_stats.steps == 10
    assert dm.synchronizer_state_dict() == {}


def test_state_dict_loads_into_plain_model() -> None:
    dm = wrap(make_model("mlp", 1))
    plain = make_model("mlp", 2)
    plain.load_state_dict(dm.state_dict())
    dm.load_state_dict(make_model("mlp", 3).state_dict())
    torch.testing.assert_close(dm.module.fc1.weight, make_model("mlp", 3).fc1.weight)
    with pytest.raises(UnsupportedModelError, match="assign"):
        dm.load_state_dict(plain.state_dict(), assign=True)


def test_grad_weight_and_no_sync_single_process() -> None:
    dm = wrap(make_model("mlp", 0))
    x, y = batch("mlp", 0)
    loss_fn("mlp", dm(x), y).backward()
    full = [p.grad.clone() for p in dm.parameters()]
    dm.zero_grad()
    dm.grad_weight = 0.5
    with dm.no_sync():
        loss_fn("mlp", dm(x), y).backward()
    assert dm.comm_stats.steps == 1  # the no_sync pass is not a synced step
    loss_fn("mlp", dm(x), y).backward()  # accumulated twice, then scaled by 0.5
    for p, g in zip(dm.parameters(), full, strict=True):
        torch.testing.assert_close(p.grad, g)
    with pytest.raises(Exception, match="grad_weight"):
        dm.grad_weight = float("nan")


def test_plan_for_another_model_is_refused() -> None:
    profile = analyze(make_model("mlp", 0))
    plan = compile_plan(AllReduce().build(profile, ResourceSpec.local(1)), profile, rank=0,
                        world_size=1, device=torch.device("cpu"))
    with pytest.raises(StrategyError, match="another model"):
        DistributedModel(make_model("tied", 0), plan)


def test_multi_rank_plan_needs_a_process_group() -> None:
    with pytest.raises(DistributedError, match="not initialized"):
        wrap(make_model("mlp", 0), world=2)


def test_replan_on_the_first_training_forward_keeps_training_like_plain_torch() -> None:
    """The hook runs once, at the first training forward (not an eval forward); a plan
    that fails to build leaves the old one working; a plan for another world is refused;
    the new plan trains like plain torch, with no_sync and grad_weight carried over."""
    model = make_model("mlp", 0)
    dm = wrap(model, builder=AllReduce())
    profile = analyze(model)
    calls: list[tuple] = []

    def bad() -> None:
        raise RuntimeError("planning failed")

    def first(args: tuple, kwargs: dict) -> None:
        calls.append(args)
        with pytest.raises(RuntimeError, match="planning failed"):
            dm.replan(bad)
        other = compile_plan(AllReduce().build(profile, ResourceSpec.local(2)), profile,
                             rank=1, world_size=2, device=torch.device("cpu"))
        with pytest.raises(StratagemError, match="rank 1 of 2"):
            dm.replan(lambda: other)
        dm.replan(lambda: compile_plan(
            PartitionedAR(chunk_size=3).build(profile, ResourceSpec.local(1)), profile,
            rank=0, world_size=1, device=torch.device("cpu")))

    dm.on_first_training_forward(first)
    opt = make_optimizer("sgd", dm.parameters())
    x, _ = batch("mlp", 0)
    with torch.no_grad():
        dm.eval()
        dm(x)
        dm.train()
    assert calls == []  # an evaluation forward is not the first training batch
    dm.grad_weight = 0.5
    for step in range(6):
        x, y = batch("mlp", step)
        opt.zero_grad()
        out = dm(x)
        if step == 0:
            assert dm.grad_weight == 0.5  # carried over to the new plan's reducer
            dm.grad_weight = 1.0
        loss_fn("mlp", out, y).backward()
        opt.step()
    assert len(calls) == 1 and len(calls[0]) == 1
    assert dm.plan.groups and any(m.part is not None for g in dm.plan.groups
                                  for m in g.members)
    want = reference("mlp", "sgd", steps=6)
    for k, v in dm.state_dict().items():
        torch.testing.assert_close(v, want[k], rtol=0, atol=0)

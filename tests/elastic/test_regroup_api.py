"""The public re-binding API an in-process rescale uses (``stratagem.elastic.membership``):
``DistributedModel.regroup``, ``AdaptiveTrainer.on_rescale`` and
``DistributedDataLoader.on_rescale``, in one process (the multi-process path is covered by
test_inprocess_rescale.py)."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from stratagem.adapt.loop import AdaptiveTrainer
from stratagem.analysis import analyze
from stratagem.data import DistributedDataLoader, elastic_loaders
from stratagem.errors import StratagemError
from stratagem.resource import ResourceSpec
from stratagem.runtime import DistributedModel, compile_plan
from stratagem.strategy import PS, AllReduce, validate


def _plan(module: nn.Module, builder=None):  # -> Plan
    spec, profile = ResourceSpec.local(1), analyze(module)
    strategy = validate((builder or AllReduce()).build(profile, spec), profile, spec)
    return compile_plan(strategy, profile, rank=0, world_size=1, device=torch.device("cpu"))


def _grad(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    model.zero_grad()
    model(x).sum().backward()
    return model.module.weight.grad.clone()


def test_model_regroup_replaces_the_synchronizers() -> None:
    torch.manual_seed(0)
    model = DistributedModel(nn.Linear(3, 2), _plan(nn.Linear(3, 2)))
    x = torch.randn(4, 3)
    plain = _grad(model, x)
    plan = _plan(model.module)
    model.regroup(plan)
    assert model.plan is plan
    model.grad_weight = 2.0  # the new synchronizer's
    torch.testing.assert_close(_grad(model, x), 2 * plain)


def test_model_regroup_refuses_parameter_servers_and_keeps_the_model() -> None:
    model = DistributedModel(nn.Linear(3, 2), _plan(nn.Linear(3, 2)))
    before = model.plan
    with pytest.raises(StratagemError, match="strategies only"):
        model.regroup(_plan(model.module, PS()))
    with pytest.raises(StratagemError):
        model.regroup(_plan(nn.Linear(3, 5, bias=False)))  # another model's plan
    assert model.plan is before
    model.grad_weight = 3.0
    x = torch.randn(4, 3)
    got = _grad(model, x)
    model.grad_weight = 1.0
    torch.testing.assert_close(got, 3 * _grad(model, x))


def test_trainer_on_rescale_follows_the_world() -> None:
    model = DistributedModel(nn.Linear(3, 2), _plan(nn.Linear(3, 2)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = AdaptiveTrainer(model, opt)
    data = TensorDataset(torch.randn(16, 3))
    trainer.attach(DistributedDataLoader(data, 8, rank=0, world_size=1))
    stats, gns, tracker = trainer.stats, trainer.gns, trainer.tracker
    trainer.on_rescale(1, 2)
    assert (trainer.rank, trainer.world_size) == (1, 2)
    assert trainer.stats is not stats and trainer.stats.world_size == 2
    assert trainer.gns is gns and trainer.tracker is tracker  # the estimates are kept


def test_loader_on_rescale_replans_from_the_offset() -> None:
    data = TensorDataset(torch.arange(16))
    loader = DistributedDataLoader(data, 4, rank=0, world_size=1)
    assert loader not in elastic_loaders()
    got = []
    for step, (ids,) in enumerate(loader):
        got.append(ids.tolist())
        if step == 1:
            loader.on_rescale(1, 2)  # rank 1 of 2 from the third global batch on
    assert got == [[0, 1, 2, 3], [4, 5, 6, 7], [10, 11], [14, 15]]
    assert (loader.sampler.rank, loader.sampler.world_size) == (1, 2)


def test_elastic_loaders_are_tracked_while_alive() -> None:
    data = TensorDataset(torch.arange(8))
    loader = DistributedDataLoader(data, 4, rank=0, world_size=1, elastic=True)
    assert loader in elastic_loaders()
    del loader
    gc.collect()
    assert not any(lo.dataset is data for lo in elastic_loaders())

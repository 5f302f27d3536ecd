"""Stratagem: explicit, serializable distribution strategies for PyTorch training.

Public API::

    import stratagem as sg
    ad = sg.AutoDist(resource_spec_file="spec.yml", strategy_builder=sg.strategy.AllReduce())
    model, optimizer = ad.distribute(model, optimizer)
    loader = ad.data_loader(dataset, batch_size=256, shuffle=True)
"""

from stratagem import checkpoint, strategy
from stratagem.analysis import ModelProfile, analyze
from stratagem.autodist import AutoDist
from stratagem.data import DistributedDataLoader
from stratagem.errors import (
    CheckpointError,
    LaunchError,
    ResourceSpecError,
    StratagemError,
    StrategyError,
)
from stratagem.resource import ResourceSpec
from stratagem.strategy import Strategy

__version__ = "0.1.0"

__all__ = [
    "AutoDist",
    "CheckpointError",
    "DistributedDataLoader",
    "LaunchError",
    "ModelProfile",
    "ResourceSpec",
    "ResourceSpecError",
    "StratagemError",
    "Strategy",
    "StrategyError",
    "analyze",
    "checkpoint",
    "strategy",
]

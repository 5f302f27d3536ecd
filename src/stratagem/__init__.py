"""Stratagem: explicit, serializable distribution strategies for PyTorch training.

Public API::

    import stratagem as sg
    ad = sg.AutoDist(resource_spec_file="spec.yml", strategy_builder=sg.strategy.AllReduce())
    model, optimizer = ad.distribute(model, optimizer)
    loader = ad.data_loader(dataset, batch_size=256, shuffle=True)

Names are imported lazily, so ``stratagem run`` and node agents start without paying for
``import torch`` in the launcher process.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "AutoDist": "stratagem.autodist",
    "DistributedDataLoader": "stratagem.data",
    "ModelProfile": "stratagem.analysis",
    "analyze": "stratagem.analysis",
    "ResourceSpec": "stratagem.resource",
    "Strategy": "stratagem.strategy",
    "StratagemError": "stratagem.errors",
    "ResourceSpecError": "stratagem.errors",
    "StrategyError": "stratagem.errors",
    "LaunchError": "stratagem.errors",
    "CheckpointError": "stratagem.errors",
    "DistributedError": "stratagem.errors",
}
_SUBMODULES = ("adapt", "analysis", "checkpoint", "data", "elastic", "env", "planner",
               "runtime", "strategy")

__all__ = [
    "AutoDist",
    "CheckpointError",
    "DistributedDataLoader",
    "DistributedError",
    "LaunchError",
    "ModelProfile",
    "ResourceSpec",
    "ResourceSpecError",
    "StratagemError",
    "Strategy",
    "StrategyError",
    "adapt",
    "analysis",
    "analyze",
    "checkpoint",
    "data",
    "elastic",
    "env",
    "planner",
    "runtime",
    "strategy",
]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"stratagem.{name}")
    else:
        raise AttributeError(f"module 'stratagem' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])


if TYPE_CHECKING:  # for type checkers and IDEs
    from stratagem import (
        adapt,
        analysis,
        checkpoint,
        data,
        elastic,
        env,
        planner,
        runtime,
        strategy,
    )
    from stratagem.analysis import ModelProfile, analyze
    from stratagem.autodist import AutoDist
    from stratagem.data import DistributedDataLoader
    from stratagem.errors import (
        CheckpointError,
        DistributedError,
        LaunchError,
        ResourceSpecError,
        StratagemError,
        StrategyError,
    )
    from stratagem.resource import ResourceSpec
    from stratagem.strategy import Strategy

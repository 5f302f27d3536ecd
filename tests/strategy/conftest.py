"""Shared models, profiles and resource specs for the strategy tests."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from stratagem.analysis import ModelProfile, analyze
from stratagem.resource import ResourceSpec

ROOT = Path(__file__).resolve().parents[2]
SPECS = ROOT / "examples" / "specs"
MIXED = ROOT / "examples" / "strategies" / "mlp-mixed.yaml"


def mlp() -> nn.Module:
    """The model examples/strategies/mlp-mixed.yaml is written for."""
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))


class Zoo(nn.Module):
    """Shapes that exercise the partitioning rules: scalar, prime, 1-row, 4-D, sparse."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))       # ()          never partitioned
        self.prime = nn.Parameter(torch.zeros(13, 4))   # (13, 4)     13 parts along axis 0
        self.emb = nn.Embedding(12, 6, sparse=True)     # (12, 6)     2 parts
        self.conv = nn.Conv2d(3, 9, 3)                  # (9, 3, 3, 3), (9,)  3 parts
        self.lin = nn.Linear(6, 25)                     # (25, 6), (25,)      5 parts
        self.one = nn.Linear(5, 1)                      # (1, 5), (1,)        not split


ZOO_NAMES = ["scale", "prime", "emb.weight", "conv.weight", "conv.bias", "lin.weight",
             "lin.bias", "one.weight", "one.bias"]


@pytest.fixture(scope="session")
def mlp_profile() -> ModelProfile:
    return analyze(mlp())


@pytest.fixture(scope="session")
def zoo_profile() -> ModelProfile:
    profile = analyze(Zoo())
    assert profile.names == ZOO_NAMES
    return profile


@pytest.fixture(scope="session")
def dense_profile() -> ModelProfile:
    """The zoo without its sparse embedding (PowerSGD cannot compress sparse gradients)."""
    model = Zoo()
    model.emb = nn.Embedding(12, 6)
    return analyze(model)


@pytest.fixture(scope="session")
def two_node() -> ResourceSpec:
    return ResourceSpec.from_file(SPECS / "two-node.yml")


@pytest.fixture(scope="session")
def gpu_cluster() -> ResourceSpec:
    return ResourceSpec.from_file(SPECS / "gpu-cluster.yml")


@pytest.fixture(scope="session")
def local3() -> ResourceSpec:
    return ResourceSpec.from_dict({"nodes": [{"address": "127.0.0.1", "workers": 3}]})

"""predict() prices the sharded stages' collectives with the link model (known answers:
hand-computed ring volumes and latencies on one node's loopback links)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from stratagem.analysis import analyze
from stratagem.planner import estimate, predict
from stratagem.planner.links import LinkModel
from stratagem.resource import ResourceSpec
from stratagem.strategy import AllReduce
from stratagem.strategy.builders import ZeRO

W = 4
B = 64 * 64 * 4  # bytes of each block's one matrix
BPS = 1e8
LAT = 1e-4


class Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(64, 64, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def half_ring(nbytes: float) -> float:
    """An all-gather (or reduce-scatter, reduce, broadcast) on a ring of W: each worker
    sends (W-1)/W of the bytes to its neighbour, and W-1 messages' latency."""
    return (W - 1) / W * nbytes / BPS + (W - 1) * LAT


@pytest.fixture()
def setup() -> tuple:
    spec = ResourceSpec.from_dict({"nodes": [{"address": "127.0.0.1", "workers": W}]})
    profile = analyze(Blocks())
    links = LinkModel.from_spec(spec, intra_bps=BPS, latency_s=LAT, message_cpu_s=0.0)
    return spec, profile, estimate(profile, 8), links


def test_stage3_gathers_twice_per_unit_when_resharding(setup: tuple) -> None:
    spec, profile, cal, links = setup
    cost = predict(ZeRO(stage=3).build(profile, spec), profile, spec, cal, links)
    # 4 units of one matrix each: forward all-gather + backward all-gather, exposed
    assert cost.parts["sharded_exposed"] == pytest.approx(4 * 2 * half_ring(B))
    kept = predict(ZeRO(stage=3, reshard_after_forward=False).build(profile, spec), profile,
                   spec, cal, links)
    assert kept.parts["sharded_exposed"] == pytest.approx(4 * half_ring(B))
    # the reduce-scatters queue in backward: 4 of them on the link
    names = [s.name for s in cost.slots]
    assert sum(n.startswith("reduce-scatter") for n in names) == 4
    assert cost.exposed_comm_s >= cost.parts["sharded_exposed"] > 0


def test_stage1_and_2_broadcast_each_owners_share(setup: tuple) -> None:
    spec, profile, cal, links = setup
    for stage in (1, 2):
        cost = predict(ZeRO(stage=stage).build(profile, spec), profile, spec, cal, links)
        # four equal matrices, one per owner: four broadcasts of one matrix, exposed
        assert cost.parts["sharded_exposed"] == pytest.approx(4 * half_ring(B)), stage
    z2 = predict(ZeRO(stage=2).build(profile, spec), profile, spec, cal, links)
    assert sum(s.name.startswith("reduce blocks.") for s in z2.slots) == 4
    replicated = predict(AllReduce().build(profile, spec), profile, spec, cal, links)
    assert replicated.parts["sharded_exposed"] == 0.0

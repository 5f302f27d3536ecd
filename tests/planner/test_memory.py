"""Memory-aware Auto: a transformer whose training state needs ~3x a worker's limit."""

from __future__ import annotations

import _spawn
import memory_workers as mw
import pytest
import torch

pytestmark = pytest.mark.slow

WORLD = 4
FACTOR = 3.0
"""Training state (fp32 parameters, gradients, Adam's moments) over the limit, as the
issue asks. Each worker builds the model on the meta device and gets its values unit by
unit as FSDP2 shards them (DistributedModel's ``materialize``): the whole model never
exists on a worker. Measured: peak 77.0-77.4 MiB against an 82.0 MiB limit and a
73.8 MiB estimate (1.04-1.05x); Auto's fit check keeps a 5% margin plus 2 MiB."""


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    limit = int(mw.full_state_bytes() / FACTOR)
    return [dict(r, limit=limit) for r in _spawn.run(
        mw.train, WORLD, tmp_path_factory.mktemp("mem"), {"limit": limit},
        _spawn.Setup(args=(WORLD,), local_rank=True, init_group=True))]


def test_needs_several_times_the_limit(trained: list[dict]) -> None:
    assert mw.full_state_bytes() >= FACTOR * trained[0]["limit"]


def test_auto_picks_a_sharded_strategy_that_fits(trained: list[dict]) -> None:
    assert len({r["builder"] for r in trained}) == 1
    for r in trained:
        assert r["builder"].startswith("ZeRO"), r["notes"]
        assert r["estimate"] <= r["limit"]


def test_measured_peak_under_limit_and_near_estimate(trained: list[dict]) -> None:
    for r in trained:
        ratio = r["peak"] / r["estimate"]
        assert r["peak"] <= r["limit"], (r["peak"], r["limit"], r["items"], r["marks"],
                                         r["builder"], r["notes"])
        assert 1 / 1.15 <= ratio <= 1.15, (ratio, r["peak"], r["items"])


def test_parameters_equal_single_process(trained: list[dict]) -> None:
    want = mw.reference(WORLD)
    for r in trained:
        assert r["state"].keys() == want.keys()
        for k, v in want.items():  # fp32: summation order differs from one process
            torch.testing.assert_close(r["state"][k], v, rtol=1e-5, atol=1e-6, msg=k)

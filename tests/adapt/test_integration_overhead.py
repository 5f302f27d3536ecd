"""The overhead benchmark's measurement code runs (no wall-time assertions: see bench/)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def bench():  # noqa: ANN201 - the bench module
    sys.path.insert(0, str(BENCH))
    try:
        import adaptive

        yield adaptive
    finally:
        sys.path.remove(str(BENCH))


@pytest.mark.slow
def test_overhead_measurement_runs(bench) -> None:  # noqa: ANN001
    tiny = [{"name": "tiny", "width": 16, "layers": 1, "batch": 16, "optimizer": "adamw"}]
    out = bench.overhead(True, configs=tiny, blocks=1, steps=12)["tiny"]
    assert out["steps_per_mode"] == 12  # one measured block per mode after the warm-up pair
    assert out["plain_median_step_s"] > 0 and out["adaptive_median_step_s"] > 0
    assert math.isfinite(out["ratio"]) and out["ratio"] > 0
    assert out["gns_updates"] > 0  # statistics really ran in the adaptive blocks


def test_digits_data_is_augmented(bench) -> None:  # noqa: ANN001
    pytest.importorskip("sklearn")
    train, (vx, vy) = bench.digits_data(2)
    x, y = train.tensors
    assert x.shape[1] == 64 and len(x) == 2 * int(0.8 * 1797)
    assert len(vx) == 1797 - int(0.8 * 1797) and set(vy.tolist()) == set(range(10))

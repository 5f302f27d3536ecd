"""bench/wait_latency.py: the summary of a wait distribution (known answers)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import wait_latency  # noqa: E402


def test_summary_of_a_bimodal_distribution() -> None:
    # 60 waits of 0.1 ms and 40 of 4 ms (a scheduler tick): the median is the fast mode,
    # the 90th percentile the slow one, 40% over 1 ms
    s = wait_latency.summary([1e-4] * 60 + [4e-3] * 40)
    assert s["median_ms"] == pytest.approx(0.1)
    assert s["p10_ms"] == pytest.approx(0.1)
    assert s["p90_ms"] == pytest.approx(4.0)
    assert s["max_ms"] == pytest.approx(4.0)
    assert s["over_1ms"] == pytest.approx(0.4)
    assert s["p90_over_median"] == pytest.approx(40.0)


def test_summary_of_steady_times() -> None:
    s = wait_latency.summary([1e-3 * (1 + i / 100) for i in range(101)])
    assert s["median_ms"] == pytest.approx(1.5)
    assert s["p10_ms"] == pytest.approx(1.1) and s["p90_ms"] == pytest.approx(1.9)
    assert s["over_1ms"] == pytest.approx(100 / 101, abs=1e-3)

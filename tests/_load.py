"""Waits that stretch with the machine's load.

A test's deadline only keeps a broken test from hanging; it must not encode how fast an idle
machine is (timings belong in benchmarks). Tests that wait for real processes (Ray workers,
elastic restarts) scale their deadlines by the load per core, so the suite passes beside other
work (issue 47 saw Ray-service tests time out at a load of 13-20 on two cores).
"""

from __future__ import annotations

import os

MAX_FACTOR = 8.0  # still bounded: a hung test ends


def load_factor() -> float:
    """1 on an idle machine; the 1-minute load per core above that, at most MAX_FACTOR."""
    try:
        per_core = os.getloadavg()[0] / (os.cpu_count() or 1)
    except OSError:  # no load average on this platform
        return 1.0
    return min(MAX_FACTOR, max(1.0, per_core))


def patience(seconds: float) -> float:
    """``seconds`` of waiting on an idle machine, stretched by the current load."""
    return seconds * load_factor()

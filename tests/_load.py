"""Waits that stretch with the machine's load, and a per-test timeout that stretches with them.

A test's deadline only keeps a broken test from hanging; it must not encode how fast an idle
machine is (timings belong in benchmarks). Tests that wait for real processes (Ray workers,
elastic restarts) scale their deadlines by the load per core, so the suite passes beside other
work (issue 47 saw Ray-service tests time out at a load of 13-20 on two cores).

The two bounds of a test must agree: its own waits (:func:`patience`) and pytest-timeout's
limit on the whole test. tests/conftest.py samples the factor once when each test starts
(:func:`begin_test`): every ``patience`` of that test uses it, and the test's pytest-timeout
(``timeout = 300`` in pyproject, or its marker) is multiplied by it. A wait of
``patience(s)`` therefore never outlives a timeout of ``t >= s`` (issue 47: a ``patience(150)``
wait, stretched to 8x, was cut by a fixed 300 s timeout).
"""

from __future__ import annotations

import os

import pytest

MAX_FACTOR = 8.0  # still bounded: a hung test ends
_frozen: list[float] = []  # the factor of the test running now (empty: none)


def load_factor() -> float:
    """The factor of the running test; outside tests, 1 on an idle machine and the 1-minute
    load per core above that, at most MAX_FACTOR."""
    return _frozen[-1] if _frozen else measured_factor()


def measured_factor() -> float:
    """The 1-minute load per core, between 1 and MAX_FACTOR."""
    try:
        per_core = os.getloadavg()[0] / (os.cpu_count() or 1)
    except OSError:  # no load average on this platform
        return 1.0
    return min(MAX_FACTOR, max(1.0, per_core))


def begin_test() -> float:
    """Sample the factor for the test that starts now (its waits and its timeout)."""
    _frozen[:] = [measured_factor()]
    return _frozen[0]


def end_test() -> None:
    _frozen.clear()


def patience(seconds: float) -> float:
    """``seconds`` of waiting on an idle machine, stretched by the test's load factor."""
    return seconds * load_factor()


def stretch_timeout(item: pytest.Item, factor: float) -> float | None:
    """Give ``item`` a pytest-timeout marker of its timeout (its own marker's, else the
    ``--timeout`` option's or the ini's) times ``factor``; the new timeout, or None when the
    test has none (no pytest-timeout, or no timeout configured) or ``factor`` is 1."""
    marker = item.get_closest_marker("timeout")
    if not item.config.pluginmanager.hasplugin("timeout"):  # e.g. -p no:timeout
        return None
    kwargs = dict(marker.kwargs) if marker is not None else {}
    if marker is not None and marker.args:
        base: object = marker.args[0]
        if len(marker.args) > 1:
            kwargs["method"] = marker.args[1]
    elif "timeout" in kwargs:
        base = kwargs["timeout"]
    else:
        base = item.config.getoption("timeout", None) or item.config.getini("timeout")
    try:
        seconds = float(base)  # type: ignore[arg-type]
    except (TypeError, ValueError):  # no timeout configured
        return None
    if seconds <= 0 or factor <= 1:
        return None
    kwargs["timeout"] = seconds * factor
    item.add_marker(pytest.mark.timeout(**kwargs), append=False)  # the closest one
    return kwargs["timeout"]

"""A test's waits and its pytest-timeout stretch by one load factor (tests/_load.py): on a
loaded machine a slow wait ends at its own deadline, never cut short by a fixed timeout."""

from __future__ import annotations

import os

import _load
import pytest


def test_the_factor_is_fixed_for_the_whole_test(monkeypatch: pytest.MonkeyPatch) -> None:
    factor = _load.load_factor()  # sampled as this test started
    cores = os.cpu_count() or 1
    monkeypatch.setattr(os, "getloadavg", lambda: (100.0 * cores, 0.0, 0.0))
    assert _load.measured_factor() == _load.MAX_FACTOR  # the machine got busy meanwhile
    assert _load.patience(150) == 150 * factor  # the waits keep the test's factor


def test_the_configured_timeout_is_stretched(request: pytest.FixtureRequest) -> None:
    marker = request.node.get_closest_marker("timeout")  # the hook's, on a loaded machine
    base = float(marker.kwargs["timeout"]) if marker is not None \
        else float(request.config.getoption("timeout", None) or request.config.getini("timeout"))
    assert base >= _load.patience(300) - 1e-6  # the ini's 300 s, by this test's factor
    assert _load.stretch_timeout(request.node, 4.0) == pytest.approx(base * 4)
    assert request.node.get_closest_marker("timeout").kwargs["timeout"] == \
        pytest.approx(base * 4)


@pytest.mark.timeout(60, "thread")
def test_a_marker_keeps_its_method_when_stretched(request: pytest.FixtureRequest) -> None:
    factor = _load.load_factor()
    marker = request.node.get_closest_marker("timeout")
    assert float(marker.kwargs.get("timeout", marker.args[0] if marker.args else 0)) == \
        pytest.approx(60 * factor)
    assert _load.stretch_timeout(request.node, 2.0) == pytest.approx(60 * factor * 2)
    stretched = request.node.get_closest_marker("timeout")
    assert stretched.kwargs == {"timeout": pytest.approx(60 * factor * 2), "method": "thread"}


def test_no_timeout_at_factor_one(request: pytest.FixtureRequest) -> None:
    before = request.node.get_closest_marker("timeout")
    assert _load.stretch_timeout(request.node, 1.0) is None
    assert request.node.get_closest_marker("timeout") is before

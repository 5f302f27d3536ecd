"""For every test directory: tests/ (shared helpers such as ``_spawn`` and ``_vcluster``) and
the repo's tools/ (``import vcluster``) on ``sys.path``, and a skip-if-unavailable fixture for
tests that build virtual clusters."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
for path in (TESTS, TESTS.parent / "tools"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import vcluster  # noqa: E402


@pytest.fixture
def need_vcluster() -> None:
    """Skip, with the reason, where this machine cannot build a virtual cluster."""
    ok, reason = vcluster.VirtualCluster.available()
    if not ok:
        pytest.skip(f"virtual cluster unavailable: {reason}")

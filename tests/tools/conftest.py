"""Make the repo's tools/ importable (``import vcluster``) and offer a skip-if-unavailable
fixture for tests that build virtual clusters."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[2] / "tools"
if str(TOOLS) not in sys.path:
    sys.path.insert(0, str(TOOLS))

import vcluster  # noqa: E402


@pytest.fixture
def need_vcluster() -> None:
    """Skip, with the reason, where this machine cannot build a virtual cluster."""
    ok, reason = vcluster.VirtualCluster.available()
    if not ok:
        pytest.skip(f"virtual cluster unavailable: {reason}")

"""Fixtures for the scheduler tests: the Pollux data set (bundled with the package) and the
tiny hand-made profiles of :mod:`_sched_data`."""

from __future__ import annotations

from pathlib import Path

import pytest
from _sched_data import ENV_DATA, pollux_data_dir, write_toy_profile


@pytest.fixture(scope="session")
def pollux_data() -> Path:
    path = pollux_data_dir()
    assert (path / "profiles").is_dir(), f"no Pollux profiles under {path} (${ENV_DATA})"
    return path


@pytest.fixture(scope="session")
def pollux_profiles(pollux_data):
    from stratagem.sched.simulator.profile import load_profiles

    return load_profiles(pollux_data / "profiles")


@pytest.fixture
def toy_profiles(tmp_path):
    """``toy1`` (one epoch) and ``toy2`` (two epochs), see :func:`write_toy_profile`."""
    from stratagem.sched.simulator.profile import load_profiles

    root = tmp_path / "profiles"
    write_toy_profile(root / "toy1", 1)
    write_toy_profile(root / "toy2", 2)
    return load_profiles(root)

"""Fixtures for the scheduler tests: the Pollux data set, and a tiny hand-made profile.

The data set (six application profiles, eight workloads) lives at ``../shared/data/pollux``
beside the repository (as CI checks it out) or at ``$STRATAGEM_POLLUX_DATA``; tests that need
it are skipped, with that reason, where it is absent.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ENV_DATA = "STRATAGEM_POLLUX_DATA"


def pollux_data_dir() -> Path | None:
    """The data set directory, or None."""
    value = os.environ.get(ENV_DATA)
    path = Path(value) if value else REPO.parent / "shared" / "data" / "pollux"
    return path if (path / "profiles").is_dir() else None


@pytest.fixture(scope="session")
def pollux_data() -> Path:
    path = pollux_data_dir()
    if path is None:
        pytest.skip(f"Pollux data set not found at {REPO.parent / 'shared/data/pollux'} "
                    f"(set ${ENV_DATA} to its directory)")
    return path


@pytest.fixture(scope="session")
def pollux_profiles(pollux_data):
    from stratagem.sched.simulator.profile import load_profiles

    return load_profiles(pollux_data / "profiles")


def write_toy_profile(directory: Path, epochs: int) -> Path:
    """A hand-made application: one step of 8 samples takes 1 s on one GPU (0.5 s at 4 per
    GPU, so two GPUs on one node at batch 8 run twice as fast); 0.6 s at 4 per GPU across two
    nodes; no gradient noise (every batch size gains exactly 1); 60 base-batch iterations per
    epoch, so an epoch is 60 s on one GPU and 30 s on two."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "placements.csv").write_text(
        "placement,local_bsz,step_time,sync_time\n"
        "1,4,0.5,0.0\n1,8,1.0,0.0\n"
        "2,4,0.5,0.0\n2,8,1.0,0.0\n"
        "11,4,0.6,0.1\n11,8,1.1,0.1\n")
    rows = "".join(f"{60.0 * e},{60 * e},0.5,1.0,0.0\n" for e in range(1, 5))
    for batch in (8, 16):
        (directory / f"validation-{batch}.csv").write_text(
            "progress,iteration,metric,grad_sqr,grad_var\n" + rows)
    (directory / "profile.json").write_text(json.dumps({"epochs": epochs}))
    return directory


@pytest.fixture
def toy_profiles(tmp_path):
    """``toy1`` (one epoch) and ``toy2`` (two epochs), see :func:`write_toy_profile`."""
    from stratagem.sched.simulator.profile import load_profiles

    root = tmp_path / "profiles"
    write_toy_profile(root / "toy1", 1)
    write_toy_profile(root / "toy2", 2)
    return load_profiles(root)

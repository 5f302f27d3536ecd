"""Helpers of the scheduler tests: where the Pollux data set is, and a tiny hand-made profile.

The data set (six application profiles, eight workloads) ships with the package
(:mod:`stratagem.sched.simulator.bundled`); ``$STRATAGEM_POLLUX_DATA`` points the tests at
another copy in the same layout.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

ENV_DATA = "STRATAGEM_POLLUX_DATA"


def pollux_data_dir() -> Path:
    """The data set directory: ``$STRATAGEM_POLLUX_DATA``, else the bundled copy."""
    from stratagem.sched.simulator.bundled import POLLUX_DIR

    value = os.environ.get(ENV_DATA)
    return Path(value) if value else POLLUX_DIR


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

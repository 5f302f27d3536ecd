"""What the scheduler reads from a running job: its hints document (``hints.json``).

Adaptive jobs publish it in their checkpoint directory (``docs/reference/hints.md``). A
missing, partial or foreign document means "nothing known yet", never an error: a job's bad
file must not stop the scheduler.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stratagem.adapt import GoodputFunction, ThroughputParams
from stratagem.adapt.noise_scale import GNSEstimate


@dataclass(frozen=True)
class JobHints:
    """The parts of a hints document the scheduler and ``stratagem ls`` use."""

    goodput: GoodputFunction | None = None
    max_batch_size: int | None = None
    local_bsz_bounds: tuple[int | None, int | None] = (None, None)
    gradient_accumulation: bool = True
    global_bsz: int | None = None
    goodput_now: float | None = None
    progress: float | None = None
    epoch: int | None = None


def parse_hints(doc: Any) -> JobHints:
    """:class:`JobHints` from a hints document (schema version 1); unusable parts are None."""
    if not isinstance(doc, dict) or doc.get("version") != 1:
        return JobHints()
    batch = doc.get("batch") or {}
    fn = None
    try:
        if doc.get("throughput_params") and doc.get("gradient"):
            fn = GoodputFunction(ThroughputParams.from_dict(doc["throughput_params"]),
                                 GNSEstimate(float(doc["gradient"]["sqr_norm"]),
                                             float(doc["gradient"]["var"])),
                                 int(batch["base_batch_size"]))
    except (KeyError, TypeError, ValueError):
        fn = None
    bounds = batch.get("local_bsz_bounds") or (None, None)
    current = batch.get("current") or {}
    good = doc.get("goodput") or {}
    progress = doc.get("progress") or {}
    return JobHints(
        goodput=fn, max_batch_size=batch.get("max_batch_size"),
        local_bsz_bounds=(bounds[0], bounds[1]),
        gradient_accumulation=bool(batch.get("gradient_accumulation", True)),
        global_bsz=current.get("global_bsz"), goodput_now=good.get("goodput"),
        progress=progress.get("progress"), epoch=doc.get("epoch"))


def read_hints(checkpoint_dir: str | Path) -> JobHints:
    """The job's latest hints, or empty ones when there are none (yet)."""
    try:
        return parse_hints(json.loads((Path(checkpoint_dir) / "hints.json").read_text()))
    except (OSError, ValueError):
        return JobHints()

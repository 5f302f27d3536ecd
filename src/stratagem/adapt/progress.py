"""Training progress counted in scale-invariant iterations.

One optimizer step at batch ``M`` advances training by its gain ``r`` base-batch iterations
(``r = 1`` at the base batch, up to ``M / M0`` when gradient noise dominates). Counting
progress this way keeps epoch budgets and per-iteration LR schedules meaningful while the
batch size changes underneath them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass


@dataclass
class ProgressTracker:
    """Accumulates gains; ``progress`` is in iterations at ``base_batch_size``."""

    base_batch_size: int
    progress: float = 0.0
    steps: int = 0
    samples: int = 0
    scheduler_steps: int = 0

    def update(self, gain: float, batch_size: int) -> None:
        """Record one optimizer step of ``batch_size`` samples worth ``gain`` iterations."""
        if not (math.isfinite(gain) and gain >= 0):
            raise ValueError(f"gain must be a finite non-negative number, got {gain}")
        self.progress += float(gain)
        self.steps += 1
        self.samples += int(batch_size)

    def epochs(self, dataset_size: int) -> float:
        """Scale-invariant epochs: base-batch samples' worth of progress per dataset size."""
        return self.progress * self.base_batch_size / dataset_size

    def scheduler_steps_due(self) -> int:
        """Whole base iterations completed since the last call.

        Step a per-iteration LR scheduler this many times, so its schedule follows
        progress rather than raw optimizer steps.
        """
        due = max(math.floor(self.progress + 1e-9) - self.scheduler_steps, 0)
        self.scheduler_steps += due
        return due

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: Mapping) -> None:
        for key, value in state.items():
            setattr(self, key, type(getattr(self, key))(value))

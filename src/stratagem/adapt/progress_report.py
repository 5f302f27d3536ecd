"""Readable progress of adaptive training: one line per epoch, optional TensorBoard."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any


def _known(value: float | None) -> bool:
    return value is not None and math.isfinite(value)


@dataclass(frozen=True)
class EpochReport:
    """What one epoch of adaptive training ran at and achieved.

    ``throughput``: measured samples per second over the epoch's steps; ``goodput`` and
    ``efficiency``: predicted by the model for the configuration now running (None before
    there is a model); ``lr_factor``: mean LR multiplier of the last step; ``adaptive``:
    whether the batch size adapts (otherwise the line leaves out goodput and efficiency).
    ``epoch`` is the script's own (0-based) epoch number.
    """

    epoch: int
    steps: int
    global_bsz: int
    num_replicas: int
    local_bsz: int
    accum_steps: int
    lr_factor: float
    gain: float
    throughput: float | None
    goodput: float | None
    efficiency: float | None
    noise_scale: float | None
    progress: float
    adaptive: bool = False

    def line(self) -> str:
        """One line; a value not known yet is left out (never shown as "?")."""
        micro = f"{self.num_replicas} x {self.local_bsz}"
        if self.accum_steps:
            micro += f" x {self.accum_steps + 1} accum"
        parts = [f"epoch {self.epoch}: batch {self.global_bsz} ({micro})",
                 f"lr x{self.lr_factor:.3g} (gain {self.gain:.3g})"]
        if _known(self.throughput):
            parts.append(f"throughput {self.throughput:.3g}/s")
        if self.adaptive:
            if _known(self.goodput):
                parts.append(f"goodput {self.goodput:.3g}/s")
            if _known(self.efficiency):
                parts.append(f"efficiency {self.efficiency:.2f}")
        if _known(self.noise_scale):
            parts.append(f"noise scale {self.noise_scale:.3g}")
        parts.append(f"{self.steps} steps")
        parts.append(f"progress {self.progress:.1f} base iterations")
        return ", ".join(parts)

    def scalars(self) -> dict[str, float]:
        """Numeric fields for logging (None and non-finite values left out)."""
        return {k: float(v) for k, v in asdict(self).items()
                if isinstance(v, (int, float)) and not isinstance(v, bool)
                and math.isfinite(float(v)) and k != "epoch"}


TB_TAGS = {
    "global_bsz": "Total_Batch_Size", "local_bsz": "Local_Batch_Size",
    "accum_steps": "Accumulation_Steps", "lr_factor": "Learning_Rate_Factor", "gain": "Gain",
    "throughput": "Throughput", "goodput": "Goodput", "efficiency": "Efficiency",
    "noise_scale": "Gradient_Noise_Scale", "progress": "Progress",
}


def to_tensorboard(writer: Any, report: EpochReport, global_step: int,
                   tag_prefix: str = "") -> None:
    """Write ``report`` to a ``SummaryWriter``-like object (anything with ``add_scalar``)."""
    if tag_prefix and not tag_prefix.endswith("/"):
        tag_prefix += "/"
    for key, value in report.scalars().items():
        if key in TB_TAGS:
            writer.add_scalar(tag_prefix + TB_TAGS[key], value, global_step)

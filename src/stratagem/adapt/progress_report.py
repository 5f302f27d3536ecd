"""Readable progress of adaptive training: one line per epoch, optional TensorBoard."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any


def _num(value: float | None, fmt: str = ".3g") -> str:
    if value is None or not math.isfinite(value):
        return "?"
    return format(value, fmt)


@dataclass(frozen=True)
class EpochReport:
    """What one epoch of adaptive training ran at and achieved.

    ``throughput``: measured samples per second over the epoch's steps; ``goodput`` and
    ``efficiency``: predicted by the model for the configuration now running (None before
    there is a model); ``lr_factor``: mean LR multiplier of the last step.
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

    def line(self) -> str:
        micro = f"{self.num_replicas} x {self.local_bsz}"
        if self.accum_steps:
            micro += f" x {self.accum_steps + 1} accum"
        return (f"epoch {self.epoch}: batch {self.global_bsz} ({micro}), "
                f"lr x{_num(self.lr_factor)} (gain {_num(self.gain)}), "
                f"throughput {_num(self.throughput)}/s, goodput {_num(self.goodput)}/s, "
                f"efficiency {_num(self.efficiency, '.2f')}, "
                f"noise scale {_num(self.noise_scale)}, {self.steps} steps, "
                f"progress {_num(self.progress, '.1f')} base iterations")

    def scalars(self) -> dict[str, float]:
        """Numeric fields for logging (None and non-finite values left out)."""
        return {k: float(v) for k, v in asdict(self).items()
                if isinstance(v, (int, float)) and math.isfinite(float(v)) and k != "epoch"}


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

"""Batch-size decisions: which (global batch, micro-batch, accumulation) to run next.

Pure: the throughput model and the noise statistics in, a :class:`BatchConfig` out. The
training loop (:mod:`stratagem.adapt.loop`) calls :meth:`Autoscaler.decide` on rank 0 and
broadcasts the result, so every replica switches at the same step.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from stratagem.adapt.goodput import (
    DEFAULT_SWITCH_THRESHOLD,
    BatchChoice,
    GoodputFunction,
    choose_with_hysteresis,
)
from stratagem.adapt.noise_scale import GradientNoiseScale
from stratagem.adapt.throughput import ThroughputParams


@dataclass(frozen=True)
class BatchConfig:
    """What the loader runs: global batch, micro-batch per replica, accumulation steps."""

    global_bsz: int
    local_bsz: int
    accum_steps: int = 0

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> BatchConfig:
        return cls(int(data["global_bsz"]), int(data["local_bsz"]), int(data["accum_steps"]))

    @classmethod
    def of(cls, global_bsz: int, replicas: int, accum_steps: int = 0) -> BatchConfig:
        """The configuration a loader runs for ``global_bsz`` over ``replicas``."""
        return cls(global_bsz, -(-global_bsz // (replicas * (accum_steps + 1))), accum_steps)


@dataclass
class Autoscaler:
    """Limits of the search and the switching threshold (5% predicted goodput gain)."""

    base_batch_size: int
    max_batch_size: int
    local_bsz_bounds: tuple[int | None, int | None] = (None, None)
    gradient_accumulation: bool = False
    threshold: float = DEFAULT_SWITCH_THRESHOLD
    min_updates: int = 20  # noise-scale updates before the first switch (early ones are noisy)

    def fallback(self, current: BatchConfig, replicas: int) -> BatchConfig:
        """Without a model: keep ``current``'s global batch within the micro-batch limit.
        With accumulation, in the fewest micro-steps that respect the limit on ``replicas``
        (a single replica beyond the base batch takes two, so its noise stays measurable):
        after a restart at another world size the restored configuration is re-derived for
        the new size -- a job grown from one replica to two drops the accumulation it needed
        alone. Without accumulation: the largest global batch within the limit."""
        hi = self.local_bsz_bounds[1]
        if self.gradient_accumulation and hi is not None:
            accum = -(-current.global_bsz // (replicas * hi)) - 1
            if replicas == 1 and current.global_bsz > self.base_batch_size:
                accum = max(accum, 1)
            if accum == current.accum_steps:
                return current
            return BatchConfig.of(current.global_bsz, replicas, accum)
        if hi is None or current.local_bsz <= hi:
            return current
        return BatchConfig.of(max(min(current.global_bsz, replicas * hi), replicas), replicas)

    def decide(self, params: ThroughputParams | None, gns: GradientNoiseScale | None,
               num_nodes: int, num_replicas: int,
               current: BatchConfig) -> tuple[BatchConfig, BatchChoice | None]:
        """The next configuration and its predicted goodput (None: not enough data yet)."""
        if params is None or gns is None or gns.updates < self.min_updates:
            return self.fallback(current, num_replicas), None
        fn = GoodputFunction(params, gns, self.base_batch_size)
        now = BatchChoice(num_nodes, num_replicas, current.global_bsz, current.local_bsz,
                          current.accum_steps, 0.0, 0.0, 0.0)
        choice = choose_with_hysteresis(
            fn, now, num_nodes, num_replicas, self.max_batch_size, self.local_bsz_bounds,
            self.gradient_accumulation, self.threshold)
        if not choice.feasible:
            return self.fallback(current, num_replicas), choice
        return BatchConfig(choice.global_bsz, choice.local_bsz, choice.accum_steps), choice

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["local_bsz_bounds"] = list(self.local_bsz_bounds)
        return d

"""Goodput = throughput x statistical efficiency, and the batch configuration maximising it.

``goodput(N, R, b, a) = R*b*(a+1) / T_step(N, R, b, a) * E(R*b*(a+1))`` for ``N`` nodes,
``R`` replicas, micro-batch ``b`` per replica and ``a`` extra accumulation micro-steps
(see :mod:`stratagem.adapt.throughput` and :mod:`stratagem.adapt.noise_scale`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
from numpy.typing import ArrayLike

from stratagem.adapt.noise_scale import GNSEstimate, GradientNoiseScale
from stratagem.adapt.throughput import ThroughputParams, predict_step_time

DEFAULT_SWITCH_THRESHOLD = 0.05
_CANDIDATES = 64  # target global batch sizes per allocation, geometrically spaced
_EPS = 1e-8  # tolerance for ceil/floor of float ratios


@dataclass(frozen=True)
class BatchChoice:
    """One batch configuration of an allocation and what the model predicts for it."""

    num_nodes: int
    num_replicas: int
    global_bsz: int
    local_bsz: int  # micro-batch per replica
    accum_steps: int  # micro-steps accumulated before the synchronising one
    goodput: float  # base-batch-equivalent samples per second
    throughput: float  # samples per second
    efficiency: float
    feasible: bool = True

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class BatchGrid:
    """:meth:`GoodputFunction.optimize_grid` result: arrays shaped like the allocations."""

    global_bsz: np.ndarray
    local_bsz: np.ndarray
    accum_steps: np.ndarray
    goodput: np.ndarray
    feasible: np.ndarray


class GoodputFunction:
    """Goodput of a job under a fitted throughput model and a noise-scale snapshot."""

    def __init__(
        self,
        throughput_params: ThroughputParams,
        gns_state: GNSEstimate | GradientNoiseScale,
        base_batch_size: int,
    ) -> None:
        if isinstance(gns_state, GradientNoiseScale):
            gns_state = gns_state.estimate()
        self.throughput_params = throughput_params
        self.gns = gns_state
        self.base_batch_size = int(base_batch_size)

    def throughput(
        self,
        num_nodes: ArrayLike,
        num_replicas: ArrayLike,
        local_bsz: ArrayLike,
        accum_steps: ArrayLike = 0,
    ) -> np.ndarray:
        """Samples per second."""
        batch = np.asarray(num_replicas) * np.asarray(local_bsz) * (np.asarray(accum_steps) + 1)
        step = predict_step_time(
            self.throughput_params, num_nodes, num_replicas, local_bsz, accum_steps
        )
        return batch / step

    def efficiency(self, global_bsz: ArrayLike) -> float | np.ndarray:
        """Statistical efficiency relative to the base batch size."""
        return self.gns.efficiency(global_bsz, self.base_batch_size)

    def evaluate(
        self,
        num_nodes: ArrayLike,
        num_replicas: ArrayLike,
        local_bsz: ArrayLike,
        accum_steps: ArrayLike = 0,
    ) -> np.ndarray:
        """Goodput; array arguments broadcast."""
        batch = np.asarray(num_replicas) * np.asarray(local_bsz) * (np.asarray(accum_steps) + 1)
        thr = self.throughput(num_nodes, num_replicas, local_bsz, accum_steps)
        return thr * self.efficiency(batch)

    __call__ = evaluate

    def describe(
        self, num_nodes: int, num_replicas: int, local_bsz: int, accum_steps: int = 0
    ) -> BatchChoice:
        """A :class:`BatchChoice` for one given configuration."""
        batch = num_replicas * local_bsz * (accum_steps + 1)
        thr = float(self.throughput(num_nodes, num_replicas, local_bsz, accum_steps))
        eff = float(self.efficiency(batch))
        return BatchChoice(
            num_nodes, num_replicas, batch, local_bsz, accum_steps, thr * eff, thr, eff
        )

    def optimize_grid(
        self,
        num_nodes: ArrayLike,
        num_replicas: ArrayLike,
        max_batch_size: int | None = None,
        local_bsz_bounds: tuple[int | None, int | None] = (None, None),
        gradient_accumulation: bool = False,
    ) -> BatchGrid:
        """Best configuration for every (nodes, replicas) allocation at once (numpy).

        Global batches between the base batch size and ``max_batch_size`` are tried
        (geometric grid); ``local_bsz_bounds`` bounds the per-replica micro-batch (its upper
        end is the memory limit). With ``gradient_accumulation`` a local batch above that
        limit is split into micro-steps, and a single replica beyond the base batch takes at
        least two micro-steps so the noise scale stays measurable. Allocations without any
        valid configuration get goodput 0 and ``feasible=False``.
        """
        m0 = self.base_batch_size
        max_batch = m0 if max_batch_size is None else int(max_batch_size)
        if max_batch < m0:
            raise ValueError(f"max_batch_size {max_batch} is below the base batch size {m0}")
        lo = int(local_bsz_bounds[0] or 1)
        hi = int(local_bsz_bounds[1] or max_batch)
        nodes, replicas = np.broadcast_arrays(np.asarray(num_nodes), np.asarray(num_replicas))
        shape = nodes.shape
        nodes, replicas = nodes.reshape(1, -1).astype(float), replicas.reshape(1, -1).astype(float)
        low = np.maximum(m0, replicas * lo)
        frac = np.linspace(0.0, 1.0, _CANDIDATES)[:, None]
        targets = low * (np.maximum(max_batch, low) / low) ** frac  # (K, C)
        local = targets / replicas
        if gradient_accumulation:
            accum = np.maximum(np.ceil(local / hi - _EPS) - 1, 0)
            accum = np.where((replicas == 1) & (local > m0), np.maximum(accum, 1), accum)
        else:
            accum = np.zeros_like(local)
        per_micro = local / (accum + 1)
        micro = np.concatenate([np.ceil(per_micro - _EPS), np.floor(per_micro + _EPS)])
        accum = np.concatenate([accum, accum])
        batch = replicas * micro * (accum + 1)
        valid = (micro >= lo) & (micro <= hi) & (batch >= m0) & (batch <= max_batch)
        safe_micro = np.where(valid, micro, max(lo, 1))
        goodput = np.where(valid, self.evaluate(nodes, replicas, safe_micro, accum), -np.inf)
        best = np.argmax(goodput, axis=0)
        cols = np.arange(goodput.shape[1])
        feasible = valid[best, cols]
        fallback = np.clip(np.ceil(low / replicas - _EPS), lo, hi)[0]
        pick_micro = np.where(feasible, micro[best, cols], fallback)
        pick_accum = np.where(feasible, accum[best, cols], 0)
        return BatchGrid(
            global_bsz=(replicas[0] * pick_micro * (pick_accum + 1)).astype(int).reshape(shape),
            local_bsz=pick_micro.astype(int).reshape(shape),
            accum_steps=pick_accum.astype(int).reshape(shape),
            goodput=np.where(feasible, goodput[best, cols], 0.0).reshape(shape),
            feasible=feasible.reshape(shape),
        )

    def optimize(
        self,
        num_nodes: int,
        num_replicas: int,
        max_batch_size: int | None = None,
        local_bsz_bounds: tuple[int | None, int | None] = (None, None),
        gradient_accumulation: bool = False,
    ) -> BatchChoice:
        """Best configuration for one allocation, see :meth:`optimize_grid`."""
        grid = self.optimize_grid(
            num_nodes, num_replicas, max_batch_size, local_bsz_bounds, gradient_accumulation
        )
        choice = self.describe(
            int(num_nodes), int(num_replicas), int(grid.local_bsz), int(grid.accum_steps)
        )
        if not bool(grid.feasible):
            return BatchChoice(**{**choice.to_dict(), "goodput": 0.0, "feasible": False})
        return choice


def should_switch(
    current_goodput: float, candidate_goodput: float, threshold: float = DEFAULT_SWITCH_THRESHOLD
) -> bool:
    """Hysteresis: switch only when the candidate is predicted ``threshold`` (5%) better."""
    return candidate_goodput > (1.0 + threshold) * current_goodput


def choose_with_hysteresis(
    goodput_fn: GoodputFunction,
    current: BatchChoice | None,
    num_nodes: int,
    num_replicas: int,
    max_batch_size: int | None = None,
    local_bsz_bounds: tuple[int | None, int | None] = (None, None),
    gradient_accumulation: bool = False,
    threshold: float = DEFAULT_SWITCH_THRESHOLD,
) -> BatchChoice:
    """The configuration to run next: the optimum, unless the current one is close enough.

    The current configuration is re-scored under the latest model; it is kept if it is
    still valid for the allocation and the optimum is not ``threshold`` better. A changed
    allocation always takes the optimum (the old configuration no longer applies).
    """
    best = goodput_fn.optimize(
        num_nodes, num_replicas, max_batch_size, local_bsz_bounds, gradient_accumulation
    )
    if current is None or (current.num_nodes, current.num_replicas) != (num_nodes, num_replicas):
        return best
    lo, hi = local_bsz_bounds
    max_batch = goodput_fn.base_batch_size if max_batch_size is None else max_batch_size
    still_valid = (
        (lo is None or current.local_bsz >= lo)
        and (hi is None or current.local_bsz <= hi)
        and goodput_fn.base_batch_size <= current.global_bsz <= max_batch
        and (gradient_accumulation or current.accum_steps == 0)
    )
    if not still_valid:
        return best
    now = goodput_fn.describe(num_nodes, num_replicas, current.local_bsz, current.accum_steps)
    return best if should_switch(now.goodput, best.goodput, threshold) else now

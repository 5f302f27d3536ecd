"""Step and sync time of any placement and local batch, from measured configurations.

Measurements come per placement (GPUs per node, e.g. ``(1, 3)``) and local batch size. A
lookup of a measured placement interpolates linearly in the local batch; any other placement
falls back to its (nodes, replicas) group (mean over measured placements of that shape),
then to linear interpolation in replicas at a measured node count, then, between measured
node counts, at the same replicas per node. Outside the measured ranges values are clamped
(never extrapolated): a scheduler should not trust an unmeasured regime beyond its edge.
Measured points come back exactly; where the data is monotone the result is too.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

Placement = tuple[int, ...]


def normalize_placement(placement: Iterable[int]) -> Placement:
    """Drop empty nodes and rotate to the lexicographically smallest rotation."""
    p = tuple(int(g) for g in placement if int(g) > 0)
    if not p:
        return ()
    return min(p[i:] + p[:i] for i in range(len(p)))


def parse_placement(text: str) -> Placement:
    """``"13"`` -> ``(1, 3)``: one digit per node, the GPUs used there."""
    return normalize_placement(int(c) for c in str(text).strip())


@dataclass(frozen=True)
class Measurement:
    """One measured configuration (seconds per optimizer step, without accumulation)."""

    num_nodes: int
    num_replicas: int
    local_bsz: float
    step_time: float
    sync_time: float
    placement: Placement | None = None


class _Curve:
    """Step and sync time against local batch size (duplicates averaged, sorted)."""

    def __init__(self, rows: Sequence[Measurement]) -> None:
        by_bsz: dict[float, list[Measurement]] = defaultdict(list)
        for m in rows:
            by_bsz[float(m.local_bsz)].append(m)
        self.bsz = np.array(sorted(by_bsz))
        self.step = np.array([np.mean([m.step_time for m in by_bsz[b]]) for b in self.bsz])
        self.sync = np.array([np.mean([m.sync_time for m in by_bsz[b]]) for b in self.bsz])

    def __call__(self, local_bsz: float) -> tuple[float, float]:
        return (float(np.interp(local_bsz, self.bsz, self.step)),
                float(np.interp(local_bsz, self.bsz, self.sync)))


class StepTimeTable:
    """Interpolated ``(step_time, sync_time)`` for (placement, local batch); see module doc."""

    def __init__(self, measurements: Iterable[Measurement]) -> None:
        rows = list(measurements)
        if not rows:
            raise ValueError("a step-time table needs at least one measurement")
        exact: dict[Placement, list[Measurement]] = defaultdict(list)
        groups: dict[tuple[int, int], list[Measurement]] = defaultdict(list)
        for m in rows:
            if m.placement:
                exact[normalize_placement(m.placement)].append(m)
            groups[m.num_nodes, m.num_replicas].append(m)
        self._exact = {k: _Curve(v) for k, v in exact.items()}
        self._groups = {k: _Curve(v) for k, v in groups.items()}
        self._replicas: dict[int, list[int]] = defaultdict(list)
        for n, r in sorted(self._groups):
            self._replicas[n].append(r)
        self._nodes = sorted(self._replicas)
        self.min_local_bsz = float(min(m.local_bsz for m in rows))
        self.max_local_bsz = float(max(m.local_bsz for m in rows))
        self._cache: dict[tuple[Placement, float], tuple[float, float]] = {}

    def lookup(self, placement: Iterable[int], local_bsz: float) -> tuple[float, float]:
        """``(step_time, sync_time)`` in seconds for one step of ``local_bsz`` per replica."""
        key = (normalize_placement(placement), float(local_bsz))
        hit = self._cache.get(key)
        if hit is None:
            hit = self._compute(*key)
            self._cache[key] = hit
        return hit

    def _compute(self, placement: Placement, local_bsz: float) -> tuple[float, float]:
        if not placement:
            raise ValueError("an empty placement has no step time")
        curve = self._exact.get(placement)
        if curve is not None:
            return curve(local_bsz)
        return self.by_shape(len(placement), sum(placement), local_bsz)

    def by_shape(self, num_nodes: float, num_replicas: float,
                 local_bsz: float) -> tuple[float, float]:
        """Interpolate by (nodes, replicas) alone: the shape of a placement."""
        curve = self._groups.get((int(num_nodes), int(num_replicas)))
        if curve is not None and num_nodes == int(num_nodes) and num_replicas == int(
                num_replicas):
            return curve(local_bsz)
        density = num_replicas / num_nodes
        nodes = self._nodes
        if num_nodes <= nodes[0] or num_nodes >= nodes[-1]:
            n = nodes[0] if num_nodes <= nodes[0] else nodes[-1]
            return self._at_nodes(n, density * n, local_bsz)
        hi = int(np.searchsorted(nodes, num_nodes))
        n_lo, n_hi = nodes[hi - 1], nodes[hi]
        if n_hi == num_nodes:
            return self._at_nodes(n_hi, num_replicas, local_bsz)
        w = (num_nodes - n_lo) / (n_hi - n_lo)
        lo = self._at_nodes(n_lo, density * n_lo, local_bsz)
        up = self._at_nodes(n_hi, density * n_hi, local_bsz)
        return ((1 - w) * lo[0] + w * up[0], (1 - w) * lo[1] + w * up[1])

    def _at_nodes(self, n: int, replicas: float, local_bsz: float) -> tuple[float, float]:
        rs = self._replicas[n]
        r = min(max(replicas, rs[0]), rs[-1])
        hi = int(np.searchsorted(rs, r))
        if rs[hi] == r:
            return self._groups[n, rs[hi]](local_bsz)
        r_lo, r_hi = rs[hi - 1], rs[hi]
        w = (r - r_lo) / (r_hi - r_lo)
        lo = self._groups[n, r_lo](local_bsz)
        up = self._groups[n, r_hi](local_bsz)
        return ((1 - w) * lo[0] + w * up[0], (1 - w) * lo[1] + w * up[1])

"""Throughput model: predicted seconds per optimizer step for a data-parallel job.

The Pollux model (Qiao et al., OSDI'21), fitted per job from profiled step times:

* compute, one micro-batch:  ``T_c = alpha_c + beta_c * local_bsz``
* gradient sync, the most significant link decides: one replica has none; one node uses
  the intra-node pair ``T_s = alpha_r + beta_r * max(replicas - 2, 0)``; several nodes use
  ``T_s = alpha_n + beta_n * max(replicas - 2, 0)`` (ring all-reduce slows down with size)
* the synchronising micro-batch overlaps compute with sync to a degree ``gamma`` in [1, 10]:
  ``(T_c**gamma + T_s**gamma) ** (1 / gamma)`` (1: none, 10: almost perfect);
  each of the ``accum_steps`` earlier micro-batches costs ``T_c`` alone.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, fields

import numpy as np
from numpy.typing import ArrayLike

GAMMA_MIN, GAMMA_MAX = 1.0, 10.0


@dataclass(frozen=True)
class ThroughputParams:
    """Fitted throughput-model constants (seconds; ``beta_c`` is seconds per sample)."""

    alpha_c: float
    beta_c: float
    alpha_r: float
    beta_r: float
    alpha_n: float
    beta_n: float
    gamma: float

    def to_dict(self) -> dict[str, float]:
        return {k: float(v) for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, data: Mapping[str, float]) -> ThroughputParams:
        return cls(**{f.name: float(data[f.name]) for f in fields(cls)})

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str) -> ThroughputParams:
        return cls.from_dict(json.loads(text))

    def to_array(self) -> np.ndarray:
        return np.array([getattr(self, f.name) for f in fields(self)], dtype=float)

    @classmethod
    def from_array(cls, values: ArrayLike) -> ThroughputParams:
        return cls(*(float(v) for v in np.asarray(values, dtype=float)))


def _out(value: np.ndarray) -> float | np.ndarray:
    return float(value) if np.ndim(value) == 0 else value


def _compute(p: np.ndarray, local_bsz: np.ndarray) -> np.ndarray:
    return p[0] + p[1] * local_bsz


def _sync(p: np.ndarray, nodes: np.ndarray, replicas: np.ndarray) -> np.ndarray:
    hops = np.maximum(replicas - 2.0, 0.0)
    intra = p[2] + p[3] * hops
    inter = p[4] + p[5] * hops
    return np.where(replicas <= 1, 0.0, np.where(nodes > 1, inter, intra))


def _step(p: np.ndarray, nodes, replicas, local_bsz, accum) -> np.ndarray:
    t_c = _compute(p, local_bsz)
    t_s = _sync(p, nodes, replicas)
    gamma = p[6]
    # Factor out the larger term so t**gamma cannot overflow or underflow to 0/0.
    top = np.maximum(np.maximum(t_c, t_s), 1e-300)
    overlap = top * ((t_c / top) ** gamma + (t_s / top) ** gamma) ** (1.0 / gamma)
    return overlap + accum * t_c


def predict_compute_time(params: ThroughputParams, local_bsz: ArrayLike) -> float | np.ndarray:
    """Seconds of forward + backward for one micro-batch of ``local_bsz`` samples."""
    return _out(_compute(params.to_array(), np.asarray(local_bsz, dtype=float)))


def predict_sync_time(
    params: ThroughputParams, num_nodes: ArrayLike, num_replicas: ArrayLike
) -> float | np.ndarray:
    """Seconds of gradient synchronisation alone (0 for a single replica)."""
    p = params.to_array()
    return _out(_sync(p, np.asarray(num_nodes, float), np.asarray(num_replicas, float)))


def predict_step_time(
    params: ThroughputParams,
    num_nodes: ArrayLike,
    num_replicas: ArrayLike,
    local_bsz: ArrayLike,
    accum_steps: ArrayLike = 0,
) -> float | np.ndarray:
    """Seconds per optimizer step; array arguments broadcast.

    ``local_bsz`` is the micro-batch per replica; ``accum_steps`` counts the micro-batches
    accumulated locally *before* the synchronising one (0 = no accumulation), so one step
    processes ``num_replicas * local_bsz * (accum_steps + 1)`` samples.
    """
    args = (np.asarray(a, dtype=float) for a in (num_nodes, num_replicas, local_bsz, accum_steps))
    return _out(_step(params.to_array(), *args))


def predict_throughput(
    params: ThroughputParams,
    num_nodes: ArrayLike,
    num_replicas: ArrayLike,
    local_bsz: ArrayLike,
    accum_steps: ArrayLike = 0,
) -> float | np.ndarray:
    """Samples per second: global batch divided by :func:`predict_step_time`."""
    batch = (
        np.asarray(num_replicas, float)
        * np.asarray(local_bsz, float)
        * (np.asarray(accum_steps, float) + 1.0)
    )
    step = predict_step_time(params, num_nodes, num_replicas, local_bsz, accum_steps)
    return _out(batch / np.asarray(step))


@dataclass(frozen=True)
class ProfileRecord:
    """One profiled configuration.

    ``step_time``: seconds per optimizer step (all micro-batches); ``compute_time``:
    seconds of one micro-batch without synchronisation, when measured.
    """

    num_nodes: int
    num_replicas: int
    local_bsz: int
    step_time: float
    accum_steps: int = 0
    compute_time: float | None = None

    @classmethod
    def from_mapping(cls, row: Mapping[str, object]) -> ProfileRecord:
        """Build from a dict/CSV row; a ``sync_time`` column yields ``compute_time``."""
        accum = int(float(row.get("accum_steps", 0) or 0))
        step = float(row["step_time"])
        compute = row.get("compute_time")
        if compute in (None, "") and row.get("sync_time") not in (None, ""):
            compute = (step - float(row["sync_time"])) / (accum + 1)
        return cls(
            num_nodes=int(float(row["num_nodes"])),
            num_replicas=int(float(row["num_replicas"])),
            local_bsz=int(float(row["local_bsz"])),
            step_time=step,
            accum_steps=accum,
            compute_time=None if compute in (None, "") else float(compute),
        )


# --- fitting -------------------------------------------------------------------------------

_FLOOR = 1e-8  # smallest value of a positive parameter, in units of the median step time
_ROBUST_SCALE = 0.1  # soft-L1 kink: log-errors beyond ~10% count linearly, not squared
_GAMMA_REG = 1e-4  # pull gamma towards 1 (easier to identify alpha/beta)
_RETRO_REG = 1e-3  # prefer small retrogression beta/alpha (an optimistic model)


@dataclass(frozen=True)
class _Data:
    nodes: np.ndarray
    replicas: np.ndarray
    bsz: np.ndarray
    accum: np.ndarray
    step: np.ndarray  # normalised by the time unit
    has_compute: np.ndarray
    compute: np.ndarray  # normalised; 1.0 where unknown (masked out)


def _as_records(records: Iterable[ProfileRecord | Mapping[str, object]]) -> list[ProfileRecord]:
    out = [r if isinstance(r, ProfileRecord) else ProfileRecord.from_mapping(r) for r in records]
    return [r for r in out if np.isfinite(r.step_time) and r.step_time > 0]


def _to_data(records: list[ProfileRecord], unit: float) -> _Data:
    compute = np.array([r.compute_time or np.nan for r in records], dtype=float)
    has_compute = np.isfinite(compute) & (compute > 0)
    return _Data(
        nodes=np.array([r.num_nodes for r in records], dtype=float),
        replicas=np.array([r.num_replicas for r in records], dtype=float),
        bsz=np.array([r.local_bsz for r in records], dtype=float),
        accum=np.array([r.accum_steps for r in records], dtype=float),
        step=np.array([r.step_time for r in records], dtype=float) / unit,
        has_compute=has_compute,
        compute=np.where(has_compute, compute / unit, 1.0),
    )


def _to_natural(u: np.ndarray) -> np.ndarray:
    p = np.exp(np.clip(u, np.log(_FLOOR), 50.0))
    p[6] = GAMMA_MIN + (GAMMA_MAX - GAMMA_MIN) / (1.0 + np.exp(-np.clip(u[6], -50.0, 50.0)))
    return p


def _to_free(p: np.ndarray) -> np.ndarray:
    u = np.log(np.maximum(p, _FLOOR))
    frac = np.clip((p[6] - GAMMA_MIN) / (GAMMA_MAX - GAMMA_MIN), 1e-9, 1 - 1e-9)
    u[6] = np.log(frac / (1.0 - frac))
    return u


def _soft_l1(r: np.ndarray) -> np.ndarray:
    """Residuals whose squares sum to the soft-L1 loss of ``r`` (robust to outliers)."""
    rho = 2.0 * _ROBUST_SCALE**2 * (np.sqrt(1.0 + (r / _ROBUST_SCALE) ** 2) - 1.0)
    return np.sign(r) * np.sqrt(rho)


def _residuals(u: np.ndarray, d: _Data) -> np.ndarray:
    p = _to_natural(u)
    step = _step(p, d.nodes, d.replicas, d.bsz, d.accum)
    parts = [_soft_l1(np.log(step / d.step)) / np.sqrt(d.step.size)]
    if d.has_compute.any():
        comp = _compute(p, d.bsz[d.has_compute])
        err = np.log(comp / d.compute[d.has_compute])
        parts.append(_soft_l1(err) / np.sqrt(err.size))
    reg = [np.sqrt(_GAMMA_REG) * (p[6] - 1.0)]
    reg += [np.sqrt(_RETRO_REG) * p[3] / p[2], np.sqrt(_RETRO_REG) * p[5] / p[4]]
    return np.concatenate(parts + [np.array(reg)])


def _line(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Least-squares ``y ~ a + b x`` with both coefficients kept positive."""
    if np.unique(x).size < 2:
        return float(np.mean(y)) / 2, float(np.mean(y)) / 2 / max(float(np.mean(x)), 1.0)
    b, a = np.polyfit(x, y, 1)
    scale = float(np.median(y))
    return max(a, 0.05 * scale), max(b, 0.05 * scale / float(np.max(x)))


def _initial(d: _Data) -> np.ndarray:
    """Data-driven starting point (normalised units)."""
    if d.has_compute.sum() >= 2:
        alpha_c, beta_c = _line(d.bsz[d.has_compute], d.compute[d.has_compute])
    else:
        single = d.replicas <= 1
        sel = single if single.any() else np.ones_like(single)
        alpha_c, beta_c = _line(d.bsz[sel], (d.step / (d.accum + 1.0))[sel])
    comp = alpha_c + beta_c * d.bsz
    sync = np.maximum(d.step - (d.accum + 1.0) * comp, 0.05 * comp)
    p = np.array([alpha_c, beta_c, 0.0, 0.0, 0.0, 0.0, 1.5])
    for col, mask in ((2, (d.nodes <= 1) & (d.replicas > 1)), (4, d.nodes > 1)):
        if mask.any():
            p[col] = float(np.median(sync[mask]))
            p[col + 1] = 0.01 * p[col]
    return np.maximum(p, _FLOOR)


def fit_throughput(
    profile_records: Iterable[ProfileRecord | Mapping[str, object]],
) -> ThroughputParams:
    """Fit :class:`ThroughputParams` to profiled step (and compute) times.

    Minimises the soft-L1 loss of log-errors (relative, robust to noisy or outlying
    timings) with Levenberg–Marquardt; bounds hold through a reparametrisation
    (positive constants, ``gamma`` in [1, 10]). Unseen regimes get optimistic priors:
    one local batch size fixes ``alpha_c`` at half the compute time; without replicas
    above 2 the retrogression terms stay 0; without single-node multi-replica data the
    intra-node sync stays 0; without multi-node data the inter-node sync is set to 1.1x the
    intra-node one (crossing nodes is never faster than staying inside one).
    """
    from stratagem.adapt._lsq import levenberg_marquardt

    records = _as_records(profile_records)
    if not records:
        raise ValueError("fit_throughput needs at least one record with a positive step_time")
    unit = float(np.median([r.step_time / (r.accum_steps + 1) for r in records]))
    d = _to_data(records, unit)
    p0 = _initial(d)
    free = np.ones(7, dtype=bool)
    if np.unique(d.bsz).size == 1:
        per_micro = d.compute[d.has_compute] if d.has_compute.any() else d.step / (d.accum + 1)
        p0[0] = float(np.mean(per_micro)) / 2
        p0[1] = p0[0] / float(d.bsz[0])
        free[0] = False
    multi_node = d.nodes > 1
    intra = (d.nodes <= 1) & (d.replicas > 1)
    if not multi_node.any():
        free[4:6] = False
    if not intra.any():
        free[2:4] = False
    if not (d.replicas > 2).any():
        p0[[3, 5]] = _FLOOR
        free[[3, 5]] = False
    if not (d.replicas > 1).any():
        free[6] = False
    best = None
    for gamma in (1.5, 4.0):
        p0[6] = gamma
        result = levenberg_marquardt(lambda u: _residuals(u, d), _to_free(p0), free)
        if best is None or result.cost < best.cost:
            best = result
    p = _to_natural(best.x)
    if not multi_node.any():
        p[4] = max(p[4], 1.1 * p[2])
        p[5] = max(p[5], 1.1 * p[3])
    p[:6] *= unit
    return ThroughputParams.from_array(p)

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
import math
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
_STALL = (10, 1e-5)  # stop when 10 iterations improve the loss by < 1e-5 of it (a crawl)


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


_LOG_FLOOR = float(np.log(_FLOOR))


def _to_natural(u: np.ndarray) -> np.ndarray:
    p = np.exp(np.minimum(np.maximum(u, _LOG_FLOOR), 50.0))
    g = min(max(float(u[6]), -50.0), 50.0)
    p[6] = GAMMA_MIN + (GAMMA_MAX - GAMMA_MIN) / (1.0 + math.exp(-g))
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


def _soft_l1_slope(r: np.ndarray) -> np.ndarray:
    """Derivative of :func:`_soft_l1` (1 at 0, falling like ``1/sqrt(|r|)`` in the tails)."""
    q = np.sqrt(1.0 + (r / _ROBUST_SCALE) ** 2)
    return np.sqrt((q + 1.0) / 2.0) / q


class _Objective:
    """The fit's residuals and their analytic Jacobian in the free parameters ``u``.

    Residuals: soft-L1 of the log-errors of the step times (and of the compute times where
    measured), each group scaled by ``1/sqrt(size)``, then three regularisers. The Jacobian
    follows the chain rule through the soft-L1 loss, the log-error, the overlap power sum and
    the reparametrisation, replacing forward differences (seven more residual evaluations per
    iteration). Per-record constants are computed once; the intermediates of the last
    residual evaluation are reused by the Jacobian at the same point.
    """

    def __init__(self, d: _Data) -> None:
        self.d = d
        multi = d.replicas > 1
        self.inter = (multi & (d.nodes > 1)).astype(float)
        self.intra = (multi & (d.nodes <= 1)).astype(float)
        self.hops = np.maximum(d.replicas - 2.0, 0.0)
        self.log_step = np.log(d.step)
        self.scale = 1.0 / math.sqrt(d.step.size)
        self.cbsz = d.bsz[d.has_compute]
        self.log_comp = np.log(d.compute[d.has_compute])
        self.cscale = 1.0 / math.sqrt(max(self.cbsz.size, 1))
        self._key: bytes | None = None
        self._state: tuple = ()

    def _forward(self, u: np.ndarray) -> tuple:
        key = u.tobytes()
        if key == self._key:
            return self._state
        d, p = self.d, _to_natural(u)
        t_c = p[0] + p[1] * d.bsz
        t_s = self.intra * (p[2] + p[3] * self.hops) + self.inter * (p[4] + p[5] * self.hops)
        gamma = p[6]
        # Factor out the larger term so t**gamma cannot overflow or underflow to 0/0.
        top = np.maximum(np.maximum(t_c, t_s), 1e-300)
        a, c = t_c / top, t_s / top
        a_g, c_g = a**gamma, c**gamma
        total = a_g + c_g
        root = total ** (1.0 / gamma)
        step = top * root + d.accum * t_c
        err = np.log(step) - self.log_step
        comp = p[0] + p[1] * self.cbsz
        cerr = np.log(comp) - self.log_comp
        reg = np.array([math.sqrt(_GAMMA_REG) * (gamma - 1.0),
                        math.sqrt(_RETRO_REG) * p[3] / p[2],
                        math.sqrt(_RETRO_REG) * p[5] / p[4]])
        res = np.concatenate([_soft_l1(err) * self.scale, _soft_l1(cerr) * self.cscale, reg])
        self._key = key
        self._state = (p, t_c, top, a, c, a_g, c_g, total, root, step, err, comp, cerr, res)
        return self._state

    def residuals(self, u: np.ndarray) -> np.ndarray:
        return self._forward(u)[-1]

    def jacobian(self, u: np.ndarray) -> np.ndarray:
        p, t_c, top, a, c, a_g, c_g, total, root, step, err, comp, cerr, _ = self._forward(u)
        d, gamma = self.d, p[6]
        # d overlap / d t_c and d t_s: (t / overlap) ** (gamma - 1).
        d_tc = (a / root) ** (gamma - 1.0) + d.accum
        d_ts = np.where(c > 0, (c / root) ** (gamma - 1.0), 0.0)
        log_a = np.log(np.where(a > 0, a, 1.0))
        log_c = np.log(np.where(c > 0, c, 1.0))
        d_gamma = top * root * (-np.log(total) / gamma**2
                                + (a_g * log_a + c_g * log_c) / (gamma * total))
        n, m = step.size, comp.size
        jac = np.zeros((n + m + 3, 7))
        w = _soft_l1_slope(err) * self.scale / step
        jac[:n, 0] = d_tc * w
        jac[:n, 1] = jac[:n, 0] * d.bsz
        jac[:n, 2] = self.intra * d_ts * w
        jac[:n, 3] = jac[:n, 2] * self.hops
        jac[:n, 4] = self.inter * d_ts * w
        jac[:n, 5] = jac[:n, 4] * self.hops
        jac[:n, 6] = d_gamma * w
        if m:
            wc = _soft_l1_slope(cerr) * self.cscale / comp
            jac[n:n + m, 0] = wc
            jac[n:n + m, 1] = wc * self.cbsz
        sr = math.sqrt(_RETRO_REG)
        jac[n + m, 6] = math.sqrt(_GAMMA_REG)
        jac[n + m + 1, 2], jac[n + m + 1, 3] = -sr * p[3] / p[2] ** 2, sr / p[2]
        jac[n + m + 2, 4], jac[n + m + 2, 5] = -sr * p[5] / p[4] ** 2, sr / p[4]
        # d p / d u: exp inside the clip range, the scaled logistic's slope for gamma.
        dp = np.where((u > _LOG_FLOOR) & (u < 50.0), p, 0.0)
        frac = (gamma - GAMMA_MIN) / (GAMMA_MAX - GAMMA_MIN)
        dp[6] = (GAMMA_MAX - GAMMA_MIN) * frac * (1.0 - frac) if abs(u[6]) < 50.0 else 0.0
        return jac * dp


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
    one local batch size fixes ``alpha_c`` at half the compute time; a regime (one node,
    several nodes) seen at fewer than two replica counts keeps its retrogression term at 0
    (its one count cannot tell alpha from beta); without single-node multi-replica data the
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
    hops = np.maximum(d.replicas - 2.0, 0.0)
    for col, mask in ((3, intra), (5, multi_node & (d.replicas > 1))):
        # One replica count in a regime cannot tell its alpha from its beta; the optimum
        # puts it all in alpha (the regulariser), which the solver would only creep towards.
        if np.unique(hops[mask]).size < 2:
            p0[col] = _FLOOR
            free[col] = False
    if not (d.replicas > 1).any():
        free[6] = False
    best = None
    objective = _Objective(d)
    for gamma in (1.5, 4.0):
        p0[6] = gamma
        result = levenberg_marquardt(objective.residuals, _to_free(p0), free,
                                     jac=objective.jacobian, stall=_STALL)
        if best is None or result.cost < best.cost:
            best = result
    p = _to_natural(best.x)
    if not multi_node.any():
        p[4] = max(p[4], 1.1 * p[2])
        p[5] = max(p[5], 1.1 * p[3])
    p[:6] *= unit
    return ThroughputParams.from_array(p)

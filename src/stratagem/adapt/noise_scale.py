"""Gradient noise scale: online estimates of |G|^2 and tr(Sigma), and what follows from them.

Notation: ``G`` is the true (full-data) gradient, ``Sigma`` the covariance of a *single
sample's* gradient, so a micro-batch of ``b`` samples has ``E|g|^2 = |G|^2 + tr(Sigma) / b``.
``var`` below is always ``tr(Sigma)`` per sample, and the noise scale
``B_noise = tr(Sigma) / |G|^2`` is a batch size in samples (McCandlish et al., 2018).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

import numpy as np
from numpy.typing import ArrayLike


def _gain(sqr: ArrayLike, var: ArrayLike, batch_size: ArrayLike, base: float) -> np.ndarray:
    """AdaScale gain ``r = (var/M0 + sqr) / (var/M + sqr)``; 1 where nothing is known."""
    sqr = np.maximum(np.asarray(sqr, dtype=float), 0.0)
    var = np.maximum(np.asarray(var, dtype=float), 0.0)
    m = np.asarray(batch_size, dtype=float)
    num = var / base + sqr
    den = var / m + sqr
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(den > 0, num / np.where(den > 0, den, 1.0), 1.0)


@dataclass(frozen=True)
class GNSEstimate:
    """A snapshot of the gradient statistics: ``sqr_norm`` = |G|^2, ``var`` = tr(Sigma)."""

    sqr_norm: float
    var: float

    @classmethod
    def from_base_batch_variance(
        cls, sqr_norm: float, var_at_base: float, base_batch_size: int
    ) -> GNSEstimate:
        """Convert AdaptDL/Pollux units, whose ``var`` is the variance of a base-batch mean."""
        return cls(sqr_norm=float(sqr_norm), var=float(var_at_base) * base_batch_size)

    @property
    def noise_scale(self) -> float:
        """``B_noise = tr(Sigma) / |G|^2`` in samples (``inf`` when |G|^2 is 0)."""
        var, sqr = max(self.var, 0.0), max(self.sqr_norm, 0.0)
        if sqr > 0:
            return var / sqr
        return float("inf") if var > 0 else 0.0

    def gain(self, batch_size: ArrayLike, base_batch_size: float) -> float | np.ndarray:
        """How many base-batch iterations one iteration at ``batch_size`` is worth.

        ``r(M) = (tr(Sigma)/M0 + |G|^2) / (tr(Sigma)/M + |G|^2)``, between 1 and ``M/M0``.
        """
        out = _gain(self.sqr_norm, self.var, batch_size, float(base_batch_size))
        return float(out) if out.ndim == 0 else out

    def efficiency(self, batch_size: ArrayLike, base_batch_size: float) -> float | np.ndarray:
        """Pollux statistical efficiency ``E(M) = r(M) * M0 / M = (phi + M0) / (phi + M)``.

        Progress per sample at batch ``M`` relative to the base batch ``M0``; ``phi`` is the
        noise scale. Unknown statistics (both zero) count as no gain: ``E = M0 / M``.
        """
        m = np.asarray(batch_size, dtype=float)
        out = _gain(self.sqr_norm, self.var, m, float(base_batch_size)) * base_batch_size / m
        return float(out) if out.ndim == 0 else out

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, float]) -> GNSEstimate:
        return cls(sqr_norm=float(data["sqr_norm"]), var=float(data["var"]))


def unbiased_estimates(
    local_sqr_norms: ArrayLike, mean_sqr_norm: ArrayLike, micro_batch_size: int | Sequence[int]
) -> tuple[np.ndarray, np.ndarray]:
    """One-step unbiased estimates of (|G|^2, tr(Sigma)), per parameter group.

    ``local_sqr_norms[i]``: |g_i|^2 of micro-batch ``i``'s mean gradient (shape ``(n,)`` or
    ``(n, groups)``, ``n >= 2``); ``mean_sqr_norm``: |mean_i g_i|^2 of their equal-weight
    average; ``micro_batch_size``: samples behind each ``g_i`` (one int or one per ``i``).
    With ``c_S = mean_i(1/b_i)`` and ``c_T = sum_i(1/b_i) / n^2``,
    ``E[mean |g_i|^2] = |G|^2 + c_S tr(Sigma)`` and ``E|mean g|^2 = |G|^2 + c_T tr(Sigma)``;
    solving the pair gives the estimators (for equal ``b``: ``(nT - S)/(n-1)`` and
    ``(S - T) n b / (n-1)``).
    """
    local = np.asarray(local_sqr_norms, dtype=float)
    n = local.shape[0]
    if n < 2:
        raise ValueError("need at least two micro-batch gradients to separate noise from signal")
    inv_b = 1.0 / np.broadcast_to(np.asarray(micro_batch_size, dtype=float), (n,))
    c_s = inv_b.mean()
    c_t = inv_b.sum() / n**2
    s = local.mean(axis=0)
    t = np.asarray(mean_sqr_norm, dtype=float)
    var = (s - t) / (c_s - c_t)
    return t - c_t * var, var


class GradientNoiseScale:
    """Online gradient-noise-scale tracker with bias-corrected exponential moving averages.

    Feed it, once per optimizer step, the squared norms of the per-replica / per-micro-batch
    gradients and of their average (:meth:`update`). Each step's unbiased estimates enter an
    EMA whose decay ``smoothing ** (samples / base_batch_size)`` is per base batch of
    samples, so the memory in samples is the same at every batch size; dividing by the
    accumulated weight (as Adam does) removes the bias towards the zero start.

    Statistics are kept per parameter group (``num_groups``); the properties sum them.
    With ``preconditioned=True`` the caller passes norms of preconditioned gradients
    (``g / (sqrt(v_hat) + eps)`` for Adam-type optimizers), as AdamScale needs.
    """

    def __init__(
        self,
        base_batch_size: int,
        smoothing: float = 0.999,
        num_groups: int = 1,
        preconditioned: bool = False,
    ) -> None:
        if base_batch_size <= 0 or not 0.0 < smoothing < 1.0:
            raise ValueError("need base_batch_size > 0 and 0 < smoothing < 1")
        self.base_batch_size = int(base_batch_size)
        self.smoothing = float(smoothing)
        self.num_groups = int(num_groups)
        self.preconditioned = bool(preconditioned)
        self._reset()
        self.biased = False
        self.updates = 0

    def _reset(self) -> None:
        self._sqr_acc = np.zeros(self.num_groups)
        self._var_acc = np.zeros(self.num_groups)
        self._weight = 0.0

    def update(
        self,
        local_sqr_norms: ArrayLike,
        mean_sqr_norm: ArrayLike,
        micro_batch_size: int | Sequence[int],
        *,
        biased: bool = False,
    ) -> bool:
        """Add one step's statistics; returns False (and ignores them) if any is non-finite.

        ``local_sqr_norms``: shape ``(n,)`` or ``(n, num_groups)``, one row per micro-batch
        gradient (every replica, every accumulation micro-step), each the mean over
        ``micro_batch_size`` samples; ``mean_sqr_norm``: squared norm of their average.
        ``biased=True`` marks the single-replica fallback built from two *consecutive*
        steps' gradients (the parameters moved in between): when real multi-gradient data
        arrives afterwards, the averages restart from it.
        """
        local = np.asarray(local_sqr_norms, dtype=float).reshape(-1, self.num_groups)
        mean = np.asarray(mean_sqr_norm, dtype=float).reshape(self.num_groups)
        if not (np.all(np.isfinite(local)) and np.all(np.isfinite(mean))):
            return False
        sqr, var = unbiased_estimates(local, mean, micro_batch_size)
        sizes = np.broadcast_to(np.asarray(micro_batch_size, dtype=float), (local.shape[0],))
        if self.biased and not biased:
            self._reset()
        self.biased = biased
        theta = self.smoothing ** (float(sizes.sum()) / self.base_batch_size)
        self._sqr_acc = theta * self._sqr_acc + (1.0 - theta) * sqr
        self._var_acc = theta * self._var_acc + (1.0 - theta) * var
        self._weight = theta * self._weight + (1.0 - theta)
        self.updates += 1
        return True

    @property
    def ready(self) -> bool:
        """Whether any statistics have been seen (otherwise everything reads as unknown)."""
        return self._weight > 0.0

    @property
    def group_sqr_norms(self) -> np.ndarray:
        return self._sqr_acc / self._weight if self.ready else np.zeros(self.num_groups)

    @property
    def group_vars(self) -> np.ndarray:
        return self._var_acc / self._weight if self.ready else np.zeros(self.num_groups)

    @property
    def sqr_norm(self) -> float:
        """Estimate of |G|^2 (negative per-group estimates count as 0)."""
        return float(np.maximum(self.group_sqr_norms, 0.0).sum())

    @property
    def var(self) -> float:
        """Estimate of tr(Sigma) per sample (negative per-group estimates count as 0)."""
        return float(np.maximum(self.group_vars, 0.0).sum())

    @property
    def noise_scale(self) -> float | None:
        """``B_noise = var / sqr_norm`` in samples, or None before the first update."""
        return self.estimate().noise_scale if self.ready else None

    def estimate(self) -> GNSEstimate:
        return GNSEstimate(sqr_norm=self.sqr_norm, var=self.var)

    def group_estimates(self) -> list[GNSEstimate]:
        pairs = zip(self.group_sqr_norms, self.group_vars, strict=True)
        return [GNSEstimate(float(max(s, 0.0)), float(max(v, 0.0))) for s, v in pairs]

    def gain(
        self, batch_size: ArrayLike, base_batch_size: float | None = None
    ) -> float | np.ndarray:
        """AdaScale gain, see :meth:`GNSEstimate.gain` (base defaults to the tracker's)."""
        return self.estimate().gain(batch_size, base_batch_size or self.base_batch_size)

    def efficiency(
        self, batch_size: ArrayLike, base_batch_size: float | None = None
    ) -> float | np.ndarray:
        """Statistical efficiency, see :meth:`GNSEstimate.efficiency`."""
        return self.estimate().efficiency(batch_size, base_batch_size or self.base_batch_size)

    def state_dict(self) -> dict:
        return {
            "base_batch_size": self.base_batch_size,
            "smoothing": self.smoothing,
            "preconditioned": self.preconditioned,
            "sqr_acc": self._sqr_acc.tolist(),
            "var_acc": self._var_acc.tolist(),
            "weight": self._weight,
            "biased": self.biased,
            "updates": self.updates,
        }

    def load_state_dict(self, state: Mapping) -> None:
        self.base_batch_size = int(state["base_batch_size"])
        self.smoothing = float(state["smoothing"])
        self.preconditioned = bool(state["preconditioned"])
        self._sqr_acc = np.asarray(state["sqr_acc"], dtype=float)
        self._var_acc = np.asarray(state["var_acc"], dtype=float)
        self.num_groups = self._sqr_acc.size
        self._weight = float(state["weight"])
        self.biased = bool(state["biased"])
        self.updates = int(state["updates"])

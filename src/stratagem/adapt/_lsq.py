"""A small Levenberg–Marquardt least-squares solver (numpy only).

Used by the throughput fit: a handful of parameters, a few hundred residuals. Bounds are
handled by the caller through a smooth reparametrisation, so the solver itself is
unconstrained; parameters can be frozen with a mask.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

Residuals = Callable[[np.ndarray], np.ndarray]
Jacobian = Callable[[np.ndarray], np.ndarray]


@dataclass(frozen=True)
class LsqResult:
    """Solution ``x``, its cost ``0.5 * sum(r**2)`` and the iterations used."""

    x: np.ndarray
    cost: float
    iterations: int
    converged: bool


def _jacobian(fun: Residuals, x: np.ndarray, r0: np.ndarray, free: np.ndarray) -> np.ndarray:
    """Forward-difference Jacobian; frozen columns stay zero."""
    jac = np.zeros((r0.size, x.size))
    for j in np.flatnonzero(free):
        step = 1e-6 * max(1.0, abs(x[j]))
        xj = x.copy()
        xj[j] += step
        jac[:, j] = (fun(xj) - r0) / step
    return jac


def levenberg_marquardt(
    fun: Residuals,
    x0: np.ndarray,
    free: np.ndarray | None = None,
    max_iter: int = 200,
    tol: float = 1e-10,
    jac: Jacobian | None = None,
    stall: tuple[int, float] | None = None,
) -> LsqResult:
    """Minimise ``0.5 * |fun(x)|**2`` from ``x0``, moving only where ``free`` is True.

    Marquardt's scaled damping (``J^T J + lam * diag(J^T J)``) with a multiplicative
    trust update; non-finite trial points are rejected like uphill ones. ``jac``: the
    analytic Jacobian of ``fun`` (rows: residuals, columns: parameters); without it, forward
    differences (one extra ``fun`` call per free parameter and iteration). ``stall``:
    ``(k, rtol)`` also stops once ``k`` iterations together lowered the cost by less than
    ``rtol`` of it (a crawl along a flat valley, where the answer no longer moves).
    """
    x = np.asarray(x0, dtype=float).copy()
    free = np.ones(x.size, dtype=bool) if free is None else np.asarray(free, dtype=bool)
    r = fun(x)
    cost = 0.5 * float(r @ r)
    lam = 1e-3
    converged = False
    it = 0
    history = [cost]
    for it in range(1, max_iter + 1):  # noqa: B007 - iteration count is reported
        jmat = _jacobian(fun, x, r, free) if jac is None else np.where(free, jac(x), 0.0)
        jtj = jmat.T @ jmat
        grad = jmat.T @ r
        if np.max(np.abs(grad[free]), initial=0.0) < tol:
            converged = True
            break
        diag = np.where(free, np.maximum(np.diag(jtj), 1e-12), 1.0)
        improved = False
        while lam < 1e12:
            system = jtj + lam * np.diag(diag)
            try:
                delta = -np.linalg.solve(system, grad)
            except np.linalg.LinAlgError:
                lam *= 10.0
                continue
            delta[~free] = 0.0
            trial = x + delta
            r_trial = fun(trial)
            cost_trial = 0.5 * float(r_trial @ r_trial)
            if np.isfinite(cost_trial) and cost_trial < cost:
                small = cost - cost_trial < tol * max(cost, 1e-300)
                x, r, cost = trial, r_trial, cost_trial
                lam = max(lam / 3.0, 1e-12)
                improved = True
                converged = small
                break
            lam *= 4.0
        if not improved or converged:
            converged = True
            break
        history.append(cost)
        if (stall is not None and len(history) > stall[0]
                and history[-1 - stall[0]] - cost < stall[1] * max(cost, 1e-300)):
            converged = True
            break
    return LsqResult(x=x, cost=cost, iterations=it, converged=converged)

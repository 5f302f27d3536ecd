"""Gradient noise scale: estimators against a linear-regression problem with known noise."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from stratagem.adapt import (
    ConsecutiveGradients,
    GNSEstimate,
    GradientNoiseScale,
    adam_preconditioner,
    group_sqr_norms,
    param_group_grads,
    unbiased_estimates,
)

DIM, SIGMA = 20, 1.0


def _problem(seed: int = 0):
    """Least squares ``0.5 (x.w - y)^2`` with x ~ N(0, I), y = x.w* + N(0, SIGMA^2), at w.

    Per-sample gradient ``x (x.delta - eps)`` with delta = w - w*, so (Gaussian moments)
    |G|^2 = |delta|^2 and tr(Sigma) = (d + 1)|delta|^2 + d sigma^2.
    """
    rng = np.random.default_rng(seed)
    w_star = rng.normal(size=DIM)
    delta = rng.normal(size=DIM)
    delta /= np.linalg.norm(delta)  # |G|^2 = 1
    return rng, w_star, w_star + delta, delta


def _true_stats(delta: np.ndarray) -> tuple[float, float]:
    sqr = float(delta @ delta)
    return sqr, (DIM + 1) * sqr + DIM * SIGMA**2


def _micro_grads(rng, w_star, w, n: int, b: int, steps: int) -> np.ndarray:
    """Mean gradients of ``n`` micro-batches of ``b`` samples, for ``steps`` steps."""
    x = rng.normal(size=(steps, n, b, DIM))
    y = x @ w_star + SIGMA * rng.normal(size=(steps, n, b))
    resid = x @ w - y
    return (x * resid[..., None]).mean(axis=2)  # (steps, n, DIM)


def test_analytic_noise_matches_large_sample():
    rng, w_star, w, delta = _problem()
    x = rng.normal(size=(200_000, DIM))
    y = x @ w_star + SIGMA * rng.normal(size=200_000)
    g = x * (x @ w - y)[:, None]
    sqr, var = _true_stats(delta)
    assert np.sum(g.mean(0) ** 2) == pytest.approx(sqr, rel=0.05)
    assert np.sum(g.var(axis=0, ddof=1)) == pytest.approx(var, rel=0.02)


def test_one_step_estimators_are_unbiased():
    rng, w_star, w, delta = _problem(1)
    grads = _micro_grads(rng, w_star, w, n=8, b=16, steps=4000)
    local = np.sum(grads**2, axis=-1)
    total = np.sum(grads.mean(axis=1) ** 2, axis=-1)
    sqr, var = unbiased_estimates(local.T, total, 16)
    true_sqr, true_var = _true_stats(delta)
    assert sqr.mean() == pytest.approx(true_sqr, rel=0.03)
    assert var.mean() == pytest.approx(true_var, rel=0.02)


def test_unequal_micro_batches_stay_unbiased():
    rng, w_star, w, delta = _problem(2)
    sizes = [4, 8, 32, 20]
    steps = 4000
    grads = np.stack(
        [_micro_grads(rng, w_star, w, 1, b, steps)[:, 0] for b in sizes], axis=1
    )  # equal-weight average over micro-batches of different sizes
    local = np.sum(grads**2, axis=-1)
    total = np.sum(grads.mean(axis=1) ** 2, axis=-1)
    sqr, var = unbiased_estimates(local.T, total, sizes)
    true_sqr, true_var = _true_stats(delta)
    assert sqr.mean() == pytest.approx(true_sqr, rel=0.08)
    assert var.mean() == pytest.approx(true_var, rel=0.03)


def test_online_tracker_recovers_noise_scale():
    rng, w_star, w, delta = _problem(3)
    replicas, accum, micro = 4, 2, 16
    grads = _micro_grads(rng, w_star, w, replicas * accum, micro, steps=3000)
    gns = GradientNoiseScale(base_batch_size=32, smoothing=0.999)
    for step in grads:
        assert gns.update(np.sum(step**2, axis=-1), np.sum(step.mean(0) ** 2), micro)
    true_sqr, true_var = _true_stats(delta)
    # A missing n/(n-1) correction alone would be off by 8/7 (14%).
    assert gns.sqr_norm == pytest.approx(true_sqr, rel=0.08)
    assert gns.var == pytest.approx(true_var, rel=0.05)
    assert gns.noise_scale == pytest.approx(true_var / true_sqr, rel=0.10)


def test_torch_autograd_path_matches_numpy_and_truth():
    rng, w_star, w, delta = _problem(4)
    model = torch.nn.Linear(DIM, 1, bias=False, dtype=torch.float64)
    with torch.no_grad():
        model.weight.copy_(torch.from_numpy(w)[None])
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    gns = GradientNoiseScale(base_batch_size=16)
    replicas, micro = 4, 16
    for _ in range(300):
        x = rng.normal(size=(replicas, micro, DIM))
        y = x @ w_star + SIGMA * rng.normal(size=(replicas, micro))
        per_replica = []
        for r in range(replicas):
            opt.zero_grad()
            pred = model(torch.from_numpy(x[r])).squeeze(-1)
            (0.5 * (pred - torch.from_numpy(y[r])).pow(2).mean()).backward()
            per_replica.append([[t.clone() for t in grp] for grp in param_group_grads(opt)])
        local = np.stack([group_sqr_norms(g) for g in per_replica])
        mean = [[sum(pr[0][0] for pr in per_replica) / replicas]]
        expected = np.sum(((x * (x @ w - y)[..., None]).mean(1)) ** 2, axis=-1)
        np.testing.assert_allclose(local[:, 0], expected, rtol=1e-10)
        gns.update(local, group_sqr_norms(mean), micro)
    true_sqr, true_var = _true_stats(delta)
    assert gns.var == pytest.approx(true_var, rel=0.10)
    assert gns.sqr_norm == pytest.approx(true_sqr, rel=0.15)


def test_bias_correction_and_ema_weights():
    gns = GradientNoiseScale(base_batch_size=10, smoothing=0.9)
    assert not gns.ready and gns.noise_scale is None
    sqr1, var1 = unbiased_estimates([3.0, 5.0], 2.5, 10)
    gns.update([3.0, 5.0], 2.5, 10)  # 20 samples: theta = 0.9**2
    # One update: bias correction returns the raw estimate exactly, not 19% of it.
    assert gns.sqr_norm == pytest.approx(float(sqr1))
    assert gns.var == pytest.approx(float(var1))
    sqr2, var2 = unbiased_estimates([4.0, 4.0, 6.0], 3.0, 10)
    gns.update([4.0, 4.0, 6.0], 3.0, 10)  # 30 samples: theta = 0.9**3
    t1, t2 = 0.9**2, 0.9**3
    w1, w2 = (1 - t1) * t2, 1 - t2
    assert gns.var == pytest.approx((w1 * var1 + w2 * var2) / (w1 + w2))
    assert gns.sqr_norm == pytest.approx((w1 * sqr1 + w2 * sqr2) / (w1 + w2))


def test_equal_size_closed_form():
    # n=4 micro-batches of b=8: |G|^2 = (nT - S)/(n-1), tr(Sigma) = (S - T) n b / (n-1).
    local, t = np.array([5.0, 7.0, 6.0, 8.0]), 3.0
    sqr, var = unbiased_estimates(local, t, 8)
    assert float(sqr) == pytest.approx((4 * 3.0 - 6.5) / 3)
    assert float(var) == pytest.approx((6.5 - 3.0) * 4 * 8 / 3)


def test_non_finite_statistics_are_skipped():
    gns = GradientNoiseScale(base_batch_size=8)
    assert not gns.update([1.0, float("inf")], 0.5, 8)
    assert not gns.ready


def test_consecutive_fallback_and_reset_on_real_data():
    rng, w_star, w, delta = _problem(5)
    grads = _micro_grads(rng, w_star, w, n=1, b=32, steps=3000)[:, 0]
    pairs = ConsecutiveGradients()
    gns = GradientNoiseScale(base_batch_size=32)
    assert pairs.push([[torch.from_numpy(grads[0])]]) is None
    for g in grads[1:]:
        local, mean = pairs.push([[torch.from_numpy(g)]])
        gns.update(local, mean, 32, biased=True)
    true_sqr, true_var = _true_stats(delta)
    assert gns.biased
    assert gns.var == pytest.approx(true_var, rel=0.08)  # parameters fixed: no bias here
    # Real multi-replica statistics replace the biased history instead of mixing with it.
    gns.update([3.0, 5.0], 2.5, 32)
    assert not gns.biased
    assert gns.var == pytest.approx(float(unbiased_estimates([3.0, 5.0], 2.5, 32)[1]))


def test_adam_preconditioned_norms():
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(5, dtype=torch.float64))
    opt = torch.optim.Adam([p], lr=0.1, eps=1e-3, betas=(0.9, 0.99))
    p.grad = torch.randn(5, dtype=torch.float64)
    assert adam_preconditioner(opt) is None  # no state before the first step
    opt.step()
    p.grad = torch.randn(5, dtype=torch.float64)
    opt.step()
    pre = adam_preconditioner(opt)
    v_hat = opt.state[p]["exp_avg_sq"] / (1 - 0.99**2)
    torch.testing.assert_close(pre[0][0], v_hat.sqrt() + 1e-3)
    expected = float(((p.grad / (v_hat.sqrt() + 1e-3)) ** 2).sum())
    assert group_sqr_norms(param_group_grads(opt), pre)[0] == pytest.approx(expected)


def test_efficiency_and_gain_hand_computed():
    est = GNSEstimate(sqr_norm=2.0, var=6.0)  # noise scale 3 samples
    assert est.noise_scale == pytest.approx(3.0)
    # E(M) = (phi + M0) / (phi + M) = 7 / 15; r = E * M / M0 = 1.4.
    assert est.efficiency(12, 4) == pytest.approx(7 / 15)
    assert est.gain(12, 4) == pytest.approx((6 / 4 + 2) / (6 / 12 + 2))
    assert est.gain(12, 4) == pytest.approx(1.4)
    assert est.efficiency(4, 4) == pytest.approx(1.0)
    np.testing.assert_allclose(est.efficiency(np.array([4, 12]), 4), [1.0, 7 / 15])
    # Unknown statistics: no gain. Pure noise: perfect scaling.
    assert GNSEstimate(0.0, 0.0).efficiency(12, 4) == pytest.approx(1 / 3)
    assert GNSEstimate(0.0, 5.0).efficiency(12, 4) == pytest.approx(1.0)
    converted = GNSEstimate.from_base_batch_variance(2.0, 1.5, 4)
    assert converted == est


def test_state_dict_roundtrip():
    gns = GradientNoiseScale(base_batch_size=8, num_groups=2)
    gns.update([[1.0, 2.0], [3.0, 4.0]], [1.5, 2.5], 8)
    clone = GradientNoiseScale(base_batch_size=1)
    clone.load_state_dict(gns.state_dict())
    assert clone.num_groups == 2
    np.testing.assert_allclose(clone.group_vars, gns.group_vars)
    assert clone.noise_scale == gns.noise_scale

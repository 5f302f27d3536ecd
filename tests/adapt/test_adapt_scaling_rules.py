"""Scaling rules: factors for known inputs, application to torch optimizers, progress."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from stratagem.adapt import (
    LEGW,
    AdamScale,
    AdaScale,
    GradientNoiseScale,
    LinearScale,
    ProgressTracker,
    SqrtScale,
    default_rule_for,
    scaled_lr,
    scaled_step,
    unbiased_estimates,
)

BASE = 32


def _gns(local=(6.0, 10.0), mean=5.0, groups=1) -> GradientNoiseScale:
    gns = GradientNoiseScale(base_batch_size=BASE, num_groups=groups)
    gns.update(local, mean, BASE)
    return gns


def test_fixed_rules():
    np.testing.assert_allclose(LinearScale().lr_factors(4.0, num_groups=2), [4.0, 4.0])
    np.testing.assert_allclose(SqrtScale().lr_factors(4.0), [2.0])
    np.testing.assert_allclose(SqrtScale().lr_factors(2.0), [math.sqrt(2.0)])


def test_adascale_gain_hand_computed():
    gns = _gns()
    # Two micro-batches of 32: |G|^2 = 2T - S = 2, tr(Sigma) = (S - T) * 2 * 32 = 192.
    assert gns.sqr_norm == pytest.approx(2.0) and gns.var == pytest.approx(192.0)
    # Variance of a base-batch mean: 192 / 32 = 6. r(S=4) = (6 + 2) / (6 / 4 + 2) = 16 / 7.
    expected = (6 + 2) / (6 / 4 + 2)
    np.testing.assert_allclose(AdaScale().lr_factors(4.0, gns), [expected])
    assert AdaScale().gain(4.0, gns) == pytest.approx(expected)
    np.testing.assert_allclose(AdamScale().lr_factors(4.0, gns), [math.sqrt(expected)])
    assert AdamScale().gain(4.0, gns) == pytest.approx(expected)
    # At the base batch nothing changes; the gain never exceeds the scale.
    np.testing.assert_allclose(AdaScale().lr_factors(1.0, gns), [1.0])
    assert 1.0 <= AdaScale().gain(64.0, gns) <= 64.0


def test_adascale_without_statistics_keeps_lr():
    np.testing.assert_allclose(AdaScale().lr_factors(8.0, None, num_groups=3), [1.0] * 3)
    assert AdaScale().gain(8.0, GradientNoiseScale(BASE)) == 1.0


def test_adascale_per_group():
    gns = _gns(local=[[6.0, 1.0], [10.0, 1.2]], mean=[5.0, 1.0], groups=2)
    factors = AdaScale().lr_factors(4.0, gns, num_groups=2)
    for factor, group in zip(factors, range(2), strict=True):
        sqr, var = (
            float(v)
            for v in unbiased_estimates(
                np.array([[6.0, 1.0], [10.0, 1.2]])[:, group], [5.0, 1.0][group], BASE
            )
        )
        v0 = var / BASE
        assert factor == pytest.approx((v0 + sqr) / (v0 / 4 + sqr))
    assert factors[0] != pytest.approx(factors[1])


def test_legw_warmup():
    rule = LEGW(base_warmup_epochs=2, dataset_size=3200, base_batch_size=BASE)
    # Warmup lasts 2 epochs * S=4 -> 2 * 4 * 3200 / 32 = 800 base iterations.
    np.testing.assert_allclose(rule.lr_factors(4.0, progress=0.0), [0.0])
    np.testing.assert_allclose(rule.lr_factors(4.0, progress=400.0), [1.0])
    np.testing.assert_allclose(rule.lr_factors(4.0, progress=5000.0), [2.0])


def test_default_rule_for_optimizer():
    params = [torch.nn.Parameter(torch.zeros(2))]
    assert isinstance(default_rule_for(torch.optim.SGD(params, lr=0.1)), AdaScale)
    for cls in (torch.optim.Adam, torch.optim.AdamW, torch.optim.RMSprop):
        assert isinstance(default_rule_for(cls(params, lr=0.1)), AdamScale)


def test_scaled_step_applies_factor_then_restores_lr():
    p = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    q = torch.nn.Parameter(torch.tensor([3.0]))
    opt = torch.optim.SGD([{"params": [p], "lr": 0.1}, {"params": [q], "lr": 0.01}])
    p.grad = torch.tensor([1.0, -1.0])
    q.grad = torch.tensor([2.0])
    tracker = ProgressTracker(base_batch_size=BASE)
    gns = _gns()
    scaled_step(
        opt, LinearScale(), batch_size=4 * BASE, base_batch_size=BASE, gns=gns, tracker=tracker
    )
    torch.testing.assert_close(p.detach(), torch.tensor([1.0 - 0.4, 2.0 + 0.4]))
    torch.testing.assert_close(q.detach(), torch.tensor([3.0 - 0.08]))
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.01]
    # Progress is the measured gain, not the nominal scale.
    assert tracker.progress == pytest.approx(AdaScale().gain(4.0, gns))
    assert (tracker.steps, tracker.samples) == (1, 4 * BASE)


def test_lr_restored_when_step_fails():
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.5)
    with pytest.raises(RuntimeError), scaled_lr(opt, [3.0]):
        assert opt.param_groups[0]["lr"] == 1.5
        raise RuntimeError("boom")
    assert opt.param_groups[0]["lr"] == 0.5
    with pytest.raises(ValueError), scaled_lr(opt, [1.0, 2.0]):
        pass  # one factor per param group is required


def test_adamscale_step_matches_adam_at_scaled_lr():
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(4))
    ref = torch.nn.Parameter(p.detach().clone())
    opt = torch.optim.Adam([p], lr=0.01)
    gns = _gns()
    factor = math.sqrt(AdaScale().gain(8.0, gns))
    ref_opt = torch.optim.Adam([ref], lr=0.01 * factor)
    for _ in range(3):
        grad = torch.randn(4)
        p.grad, ref.grad = grad.clone(), grad.clone()
        scaled_step(opt, default_rule_for(opt), 8 * BASE, BASE, gns=gns)
        ref_opt.step()
    torch.testing.assert_close(p.detach(), ref.detach())
    assert opt.param_groups[0]["lr"] == 0.01


def test_progress_tracker_epochs_and_scheduler():
    tracker = ProgressTracker(base_batch_size=BASE)
    for gain in (1.0, 2.5, 0.75):
        tracker.update(gain, batch_size=4 * BASE)
    assert tracker.progress == pytest.approx(4.25)
    assert tracker.epochs(dataset_size=BASE * 10) == pytest.approx(0.425)
    assert tracker.scheduler_steps_due() == 4
    assert tracker.scheduler_steps_due() == 0
    tracker.update(0.8, BASE)
    assert tracker.scheduler_steps_due() == 1
    clone = ProgressTracker(base_batch_size=1)
    clone.load_state_dict(tracker.state_dict())
    assert clone == tracker
    with pytest.raises(ValueError):
        tracker.update(float("nan"), BASE)

"""Goodput: the optimizer's choices follow the noise scale, memory limits and hysteresis."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from stratagem.adapt import (
    BatchChoice,
    GNSEstimate,
    GoodputFunction,
    GradientNoiseScale,
    ThroughputParams,
    choose_with_hysteresis,
    predict_step_time,
    should_switch,
)

PARAMS = ThroughputParams(
    alpha_c=0.02, beta_c=0.002, alpha_r=0.03, beta_r=0.002, alpha_n=0.1, beta_n=0.01, gamma=2.0
)
BASE = 64


def _fn(noise_scale: float) -> GoodputFunction:
    return GoodputFunction(PARAMS, GNSEstimate(sqr_norm=1.0, var=noise_scale), BASE)


def _brute_force(fn: GoodputFunction, nodes, replicas, max_batch, max_local, accumulation):
    best = 0.0
    for local, accum in itertools.product(
        range(1, max_local + 1), range(0, 8 if accumulation else 1)
    ):
        batch = replicas * local * (accum + 1)
        if BASE <= batch <= max_batch:
            best = max(best, float(fn.evaluate(nodes, replicas, local, accum)))
    return best


def test_goodput_is_throughput_times_efficiency():
    fn = _fn(1000.0)
    step = predict_step_time(PARAMS, 2, 8, 32, 1)
    batch = 8 * 32 * 2
    efficiency = (1000 + BASE) / (1000 + batch)
    assert fn.evaluate(2, 8, 32, 1) == pytest.approx(batch / step * efficiency)
    choice = fn.describe(2, 8, 32, 1)
    assert choice.global_bsz == batch
    assert choice.goodput == pytest.approx(choice.throughput * choice.efficiency)


def test_larger_noise_scale_picks_larger_batches():
    chosen = [
        _fn(phi).optimize(2, 8, max_batch_size=16384, local_bsz_bounds=(None, 1024)).global_bsz
        for phi in (10.0, 300.0, 3000.0, 30000.0)
    ]
    assert chosen == sorted(chosen)
    assert chosen[0] <= 4 * BASE  # small noise: little beyond what fixed per-step costs justify
    assert chosen[-1] >= 8 * chosen[0]


def test_small_noise_scale_stays_at_base_batch():
    choice = _fn(1.0).optimize(1, 1, max_batch_size=4096)
    assert choice.global_bsz == BASE and choice.accum_steps == 0
    assert choice.efficiency == pytest.approx(1.0)


def test_optimizer_matches_brute_force():
    for phi, nodes, replicas, accum in [
        (500.0, 1, 2, False),
        (5000.0, 2, 4, True),
        (50.0, 1, 1, True),
    ]:
        fn = _fn(phi)
        choice = fn.optimize(nodes, replicas, 4096, (None, 256), accum)
        best = _brute_force(fn, nodes, replicas, 4096, 256, accum)
        assert choice.feasible
        assert choice.goodput >= 0.98 * best
        assert choice.goodput <= best * (1 + 1e-9)


def test_memory_limit_uses_accumulation():
    fn = _fn(1e5)
    without = fn.optimize(1, 2, max_batch_size=1024, local_bsz_bounds=(None, 48))
    assert without.local_bsz <= 48 and without.accum_steps == 0
    with_accum = fn.optimize(1, 2, 1024, (None, 48), gradient_accumulation=True)
    assert with_accum.local_bsz <= 48 and with_accum.accum_steps >= 1
    assert with_accum.global_bsz == 2 * with_accum.local_bsz * (with_accum.accum_steps + 1)
    assert with_accum.global_bsz > without.global_bsz
    assert with_accum.goodput > without.goodput


def test_single_replica_accumulates_to_keep_noise_measurable():
    choice = _fn(1e5).optimize(1, 1, max_batch_size=1024, gradient_accumulation=True)
    assert choice.global_bsz > BASE
    assert choice.accum_steps >= 1


def test_infeasible_allocation_has_zero_goodput():
    choice = _fn(100.0).optimize(4, 16, max_batch_size=BASE, local_bsz_bounds=(8, None))
    assert not choice.feasible and choice.goodput == 0.0
    with pytest.raises(ValueError):
        _fn(100.0).optimize(1, 1, max_batch_size=BASE // 2)


def test_grid_matches_scalar_optimize():
    fn = _fn(2000.0)
    nodes = np.array([1, 1, 2, 4, 4])
    replicas = np.array([1, 4, 8, 16, 64])
    grid = fn.optimize_grid(nodes, replicas, 8192, (4, 512), True)
    for i, (n, r) in enumerate(zip(nodes, replicas, strict=True)):
        one = fn.optimize(int(n), int(r), 8192, (4, 512), True)
        assert (grid.global_bsz[i], grid.local_bsz[i], grid.accum_steps[i]) == (
            one.global_bsz,
            one.local_bsz,
            one.accum_steps,
        )
        assert grid.goodput[i] == pytest.approx(one.goodput)


def test_accepts_live_tracker():
    gns = GradientNoiseScale(base_batch_size=BASE)
    gns.update([3.0, 5.0], 2.5, 32)
    fn = GoodputFunction(PARAMS, gns, BASE)
    assert fn.gns == gns.estimate()


def test_hysteresis_threshold():
    assert not should_switch(100.0, 104.9)
    assert should_switch(100.0, 105.1)
    assert not should_switch(100.0, 110.0, threshold=0.2)


def test_choose_with_hysteresis_keeps_close_configs():
    fn = _fn(3000.0)
    best = fn.optimize(2, 8, 8192)
    # A neighbour within 5% of the optimum is kept (re-scored under the current model).
    near = fn.describe(2, 8, best.local_bsz - 1, 0)
    assert near.goodput > best.goodput / 1.05
    kept = choose_with_hysteresis(fn, near, 2, 8, 8192)
    assert (kept.local_bsz, kept.accum_steps) == (near.local_bsz, 0)
    # A clearly worse configuration is replaced by the optimum.
    poor = fn.describe(2, 8, 8, 0)
    assert poor.goodput < best.goodput / 1.05
    assert choose_with_hysteresis(fn, poor, 2, 8, 8192).local_bsz == best.local_bsz
    # A new allocation always takes its own optimum.
    moved = choose_with_hysteresis(fn, near, 4, 16, 8192)
    assert (moved.num_nodes, moved.num_replicas) == (4, 16)
    assert moved.local_bsz == fn.optimize(4, 16, 8192).local_bsz
    # A current configuration that broke a new memory limit is replaced.
    over = choose_with_hysteresis(fn, near, 2, 8, 8192, local_bsz_bounds=(None, 16))
    assert over.local_bsz <= 16


def test_choice_serialises():
    choice = _fn(100.0).optimize(1, 2, 1024)
    assert BatchChoice(**choice.to_dict()) == choice

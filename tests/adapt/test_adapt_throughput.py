"""Throughput model: closed-form predictions, and fits that recover known constants."""

from __future__ import annotations

import time

import numpy as np
import pytest

from stratagem.adapt import (
    ProfileRecord,
    ThroughputParams,
    fit_throughput,
    predict_compute_time,
    predict_step_time,
    predict_sync_time,
    predict_throughput,
)

TRUE = ThroughputParams(
    alpha_c=0.02, beta_c=0.004, alpha_r=0.03, beta_r=0.002, alpha_n=0.12, beta_n=0.01, gamma=2.5
)


def _synthetic(rng, noise: float = 0.05) -> list[ProfileRecord]:
    """Timings from TRUE with uniform +-``noise`` multiplicative noise."""
    records = []
    for nodes in (1, 2, 4, 8):
        for per_node in (1, 2, 4):
            for bsz in (16, 32, 64, 128):
                for accum in (0, 1):
                    replicas = nodes * per_node
                    step = predict_step_time(TRUE, nodes, replicas, bsz, accum)
                    comp = predict_compute_time(TRUE, bsz)
                    records.append(
                        ProfileRecord(
                            nodes,
                            replicas,
                            bsz,
                            step * rng.uniform(1 - noise, 1 + noise),
                            accum,
                            comp * rng.uniform(1 - noise, 1 + noise),
                        )
                    )
    return records


def _grid() -> np.ndarray:
    rows = [
        (n, n * k, b, a)
        for n in (1, 2, 3, 4, 6, 8)
        for k in (1, 2, 3, 4)
        for b in (8, 16, 24, 48, 96, 128, 200)
        for a in (0, 1, 3)
    ]
    return np.array(rows, dtype=float).T


def test_prediction_matches_hand_computation():
    p = ThroughputParams(0.1, 0.01, 0.05, 0.002, 0.2, 0.01, 1.0)
    assert predict_compute_time(p, 10) == pytest.approx(0.2)
    assert predict_sync_time(p, 1, 1) == 0.0
    assert predict_sync_time(p, 1, 4) == pytest.approx(0.05 + 0.002 * 2)
    assert predict_sync_time(p, 2, 8) == pytest.approx(0.2 + 0.01 * 6)
    # gamma = 1: no overlap, compute + sync; two accumulation micro-steps add compute only.
    assert predict_step_time(p, 2, 8, 10, 2) == pytest.approx(0.2 + 0.26 + 2 * 0.2)
    assert predict_step_time(p, 1, 1, 10) == pytest.approx(0.2)
    assert predict_throughput(p, 2, 8, 10, 2) == pytest.approx(8 * 10 * 3 / 0.86)
    # Large gamma: close to max(compute, sync).
    q = ThroughputParams(**{**p.to_dict(), "gamma": 10.0})
    assert predict_step_time(q, 2, 8, 10) == pytest.approx(0.26, rel=0.01)
    out = predict_step_time(p, np.array([1, 2]), np.array([1, 8]), 10)
    np.testing.assert_allclose(out, [0.2, 0.46])


def test_params_serialise():
    assert ThroughputParams.from_json(TRUE.to_json()) == TRUE
    assert ThroughputParams.from_dict(TRUE.to_dict()) == TRUE


def test_fit_recovers_known_model_from_noisy_timings():
    records = _synthetic(np.random.default_rng(0))
    start = time.perf_counter()
    fit = fit_throughput(records)
    print(
        f"\nthroughput fit: {len(records)} records in {1e3 * (time.perf_counter() - start):.1f} ms"
    )
    grid = _grid()
    rel = np.abs(predict_step_time(fit, *grid) / predict_step_time(TRUE, *grid) - 1)
    print(f"grid prediction error: median {np.median(rel):.3%}, max {rel.max():.3%}")
    assert rel.max() < 0.10
    assert fit.alpha_c == pytest.approx(TRUE.alpha_c, rel=0.10)
    assert fit.beta_c == pytest.approx(TRUE.beta_c, rel=0.05)
    assert fit.alpha_n == pytest.approx(TRUE.alpha_n, rel=0.15)
    assert fit.beta_n == pytest.approx(TRUE.beta_n, rel=0.15)
    assert 1.0 <= fit.gamma <= 10.0


def test_fit_is_robust_to_outliers():
    rng = np.random.default_rng(1)
    records = _synthetic(rng)
    for i in rng.choice(len(records), size=len(records) // 20, replace=False):
        r = records[i]
        records[i] = ProfileRecord(
            r.num_nodes, r.num_replicas, r.local_bsz, 3 * r.step_time, r.accum_steps, r.compute_time
        )
    fit = fit_throughput(records)
    grid = _grid()
    rel = np.abs(predict_step_time(fit, *grid) / predict_step_time(TRUE, *grid) - 1)
    assert np.median(rel) < 0.05
    assert rel.max() < 0.15


def test_fit_without_compute_times():
    rng = np.random.default_rng(2)
    records = [
        ProfileRecord(r.num_nodes, r.num_replicas, r.local_bsz, r.step_time, r.accum_steps)
        for r in _synthetic(rng)
    ]
    fit = fit_throughput(records)
    grid = _grid()
    rel = np.abs(predict_step_time(fit, *grid) / predict_step_time(TRUE, *grid) - 1)
    assert rel.max() < 0.15


def test_priors_with_a_single_configuration():
    fit = fit_throughput([ProfileRecord(1, 1, 32, step_time=0.3, compute_time=0.3)])
    # One batch size: compute split evenly between fixed and per-sample cost.
    assert fit.alpha_c == pytest.approx(0.15)
    assert predict_compute_time(fit, 32) == pytest.approx(0.3, rel=1e-3)
    # No sync observed: optimistic (near-free sync), but crossing nodes never beats staying.
    assert predict_sync_time(fit, 1, 4) < 1e-6
    assert fit.alpha_n >= 1.1 * fit.alpha_r * (1 - 1e-9)
    assert fit.beta_n >= 1.1 * fit.beta_r * (1 - 1e-9)
    assert 1.0 <= fit.gamma <= 10.0


def test_single_node_data_makes_multi_node_no_faster():
    records = [r for r in _synthetic(np.random.default_rng(3)) if r.num_nodes == 1]
    fit = fit_throughput(records)
    assert fit.alpha_n >= 1.1 * fit.alpha_r * (1 - 1e-9)
    assert fit.beta_n >= 1.1 * fit.beta_r * (1 - 1e-9)
    for replicas in (2, 4, 8, 16):
        assert predict_step_time(fit, 4, replicas, 32) >= predict_step_time(fit, 1, replicas, 32)


def test_record_from_csv_row():
    row = {
        "num_nodes": "2",
        "num_replicas": "8",
        "local_bsz": "32",
        "step_time": "0.5",
        "sync_time": "0.2",
    }
    rec = ProfileRecord.from_mapping(row)
    assert (rec.num_nodes, rec.num_replicas, rec.local_bsz, rec.accum_steps) == (2, 8, 32, 0)
    assert rec.compute_time == pytest.approx(0.3)


def test_fit_rejects_empty_profile():
    with pytest.raises(ValueError):
        fit_throughput([ProfileRecord(1, 1, 8, step_time=0.0)])

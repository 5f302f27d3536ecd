"""Throughput fit on the real Pollux job profiles (16 nodes x 4 GPUs, six applications).

Tolerances, for configurations (nodes, replicas) held out of the fit: median relative
step-time error <= 10%, 90th percentile <= 30%, throughput rank correlation >= 0.95. Why
not tighter: placements with the same nodes, replicas and local batch but a different spread
of GPUs (e.g. "13" vs "22") differ by 6-17% (median max/min ratio per app) and up to 1.8x in
these files; a model of nodes and replicas alone cannot tell them apart, so even a perfect
average carries that scatter. Observed: medians 4-8%, p90 11-27%, rank correlation >= 0.965.
"""

from __future__ import annotations

import csv
import os
import time
from pathlib import Path

import numpy as np
import pytest

from stratagem.adapt import ProfileRecord, fit_throughput, predict_step_time
from stratagem.sched.simulator.bundled import POLLUX_DIR

# The data set bundled with the package, or another copy at $STRATAGEM_POLLUX_DATA.
ROOT = Path(os.environ.get("STRATAGEM_POLLUX_DATA") or POLLUX_DIR) / "profiles"
APPS = ["bert", "cifar10", "deepspeech2", "imagenet", "ncf", "yolov3"]



def _load(app: str, placements: bool = True) -> list[ProfileRecord]:
    """scalability.csv rows, plus placements.csv (digit per node = GPUs used there)."""
    with open(ROOT / app / "scalability.csv") as f:
        records = [ProfileRecord.from_mapping(row) for row in csv.DictReader(f)]
    if not placements:
        return records
    with open(ROOT / app / "placements.csv") as f:
        for row in csv.DictReader(f):
            gpus = [int(c) for c in row["placement"] if c != "0"]
            records.append(
                ProfileRecord.from_mapping(
                    {**row, "num_nodes": len(gpus), "num_replicas": sum(gpus)}
                )
            )
    return records


def _arrays(records: list[ProfileRecord]) -> tuple[np.ndarray, np.ndarray]:
    cfg = np.array([(r.num_nodes, r.num_replicas, r.local_bsz) for r in records], dtype=float).T
    return cfg, np.array([r.step_time for r in records])


def _rank_corr(a: np.ndarray, b: np.ndarray) -> float:
    ranks = [np.argsort(np.argsort(x)) for x in (a, b)]
    return float(np.corrcoef(*ranks)[0, 1])


@pytest.mark.parametrize("app", APPS)
def test_fit_predicts_held_out_configurations(app):
    records = _load(app)
    configs = sorted({(r.num_nodes, r.num_replicas) for r in records})
    rng = np.random.default_rng(0)
    held = {configs[i] for i in rng.permutation(len(configs))[: len(configs) // 4]}
    train = [r for r in records if (r.num_nodes, r.num_replicas) not in held]
    test = [r for r in records if (r.num_nodes, r.num_replicas) in held]
    start = time.perf_counter()
    params = fit_throughput(train)
    elapsed = time.perf_counter() - start
    cfg, true = _arrays(test)
    pred = predict_step_time(params, *cfg)
    rel = np.abs(pred / true - 1)
    rho = _rank_corr(cfg[1] * cfg[2] / pred, cfg[1] * cfg[2] / true)
    print(
        f"\n{app}: fit {len(train)} records in {1e3 * elapsed:.0f} ms; {len(test)} held out: "
        f"median {np.median(rel):.1%}, p90 {np.quantile(rel, 0.9):.1%}, rank corr {rho:.3f}"
    )
    assert np.median(rel) <= 0.10
    assert np.quantile(rel, 0.9) <= 0.30
    assert rho >= 0.95


@pytest.mark.parametrize("app", APPS)
def test_scalability_only_interpolates_twelve_nodes(app):
    """Fit 6, 8 and 16 nodes from scalability.csv only; predict 12 nodes."""
    records = _load(app, placements=False)
    train = [r for r in records if r.num_nodes != 12]
    test = [r for r in records if r.num_nodes == 12]
    cfg, true = _arrays(test)
    rel = np.abs(predict_step_time(fit_throughput(train), *cfg) / true - 1)
    print(f"\n{app}: 12 nodes from 6/8/16: median {np.median(rel):.1%}")
    assert np.median(rel) <= 0.12


def _subsets(app: str, rng: np.random.Generator) -> list[list[ProfileRecord]]:
    """What a job's online profiler holds: a few configurations, up to a few dozen."""
    records = _load(app)
    return [[records[i] for i in rng.choice(len(records), k, replace=False)]
            for k in (2, 4, 9, 30)]


@pytest.mark.parametrize("app", APPS)
def test_analytic_jacobian_matches_finite_differences(app):
    from stratagem.adapt import _lsq, throughput

    rng = np.random.default_rng(7)
    for records in _subsets(app, rng):
        unit = float(np.median([r.step_time / (r.accum_steps + 1) for r in records]))
        data = throughput._to_data(records, unit)
        objective = throughput._Objective(data)
        u = throughput._to_free(throughput._initial(data)) + rng.normal(0.0, 0.5, 7)
        r0 = objective.residuals(u)
        numeric = _lsq._jacobian(objective.residuals, u, r0, np.ones(7, dtype=bool))
        analytic = objective.jacobian(u)
        assert np.max(np.abs(analytic - numeric)) <= 1e-4 * np.max(np.abs(numeric))


@pytest.mark.parametrize("app", APPS)
def test_fast_fit_matches_the_finite_difference_solver(app, monkeypatch):
    """The fit with the analytic Jacobian and the stall stop predicts what the reference
    solver (forward differences, cost-decrease stop only) predicts, on the configurations
    fitted (<= 0.1%) and on the whole profile (<= 2%: regimes seen at one replica count,
    where the reference creeps towards the optimum the fast fit takes directly)."""
    from stratagem.adapt import _lsq

    rng = np.random.default_rng(11)
    subsets = _subsets(app, rng)
    fast = [fit_throughput(s) for s in subsets]
    solver = _lsq.levenberg_marquardt

    def reference(fun, x0, free=None, max_iter=200, tol=1e-10, jac=None, stall=None):
        return solver(fun, x0, free, max_iter=max_iter, tol=tol)

    monkeypatch.setattr(_lsq, "levenberg_marquardt", reference)
    slow = [fit_throughput(s) for s in subsets]
    cfg_all, _ = _arrays(_load(app))
    for records, a, b in zip(subsets, fast, slow, strict=True):
        cfg, _ = _arrays(records)
        seen = predict_step_time(a, *cfg) / predict_step_time(b, *cfg)
        everywhere = predict_step_time(a, *cfg_all) / predict_step_time(b, *cfg_all)
        assert np.max(np.abs(seen - 1)) <= 1e-3
        assert np.max(np.abs(everywhere - 1)) <= 2e-2

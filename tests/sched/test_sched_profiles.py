"""Application profiles: loading, epochs, and the goodput model against the measurements."""

from __future__ import annotations

import csv
import json
from collections import defaultdict

import numpy as np
import pytest

from stratagem.adapt import GNSEstimate, ThroughputParams, predict_step_time
from stratagem.errors import StratagemError
from stratagem.sched.simulator.profile import load_hints_profile, load_profile, load_profiles

APPS = ["bert", "cifar10", "deepspeech2", "imagenet", "ncf", "yolov3"]
EPOCHS = {"bert": 2, "cifar10": 100, "ncf": 10, "imagenet": 90, "deepspeech2": 80,
          "yolov3": 50}


def test_epoch_budgets_and_batch_limits_follow_the_readme(pollux_profiles):
    for app, epochs in EPOCHS.items():
        p = pollux_profiles[app]
        assert p.epochs == epochs
        assert p.epoch_of(0.0) == 0 and p.epoch_of(p.total_progress) == epochs
        assert p.base_batch_size < p.max_batch_size
    assert pollux_profiles["yolov3"].max_local_bsz == 8
    assert pollux_profiles["cifar10"].base_batch_size == 128


@pytest.mark.parametrize("app", APPS)
def test_goodput_model_matches_measured_step_times(pollux_profiles, app):
    """The throughput model fitted on the profile, at every measured (nodes, replicas,
    local batch): mean relative error <= 15%, median <= 10%. Observed: means 7-12%, medians
    4-9%. Single points reach 40-46% where placements of one shape differ (e.g. "13" vs
    "22", up to 1.8x apart in these files), which a model of nodes and replicas cannot
    separate; the per-shape mean is what it is compared with."""
    p = pollux_profiles[app]
    groups = defaultdict(list)
    for r in p.records:
        groups[r.num_nodes, r.num_replicas, r.local_bsz].append(r.step_time)
    cfg = np.array(list(groups), dtype=float).T
    true = np.array([np.mean(v) for v in groups.values()])
    rel = np.abs(predict_step_time(p.throughput_params, *cfg) / true - 1)
    assert rel.mean() <= 0.15 and np.median(rel) <= 0.10, (rel.mean(), np.median(rel))


@pytest.mark.parametrize("app", APPS)
def test_goodput_model_matches_measured_efficiency(pollux_data, pollux_profiles, app):
    """Statistical efficiency the model derives from each epoch's gradient statistics vs the
    measured one: progress per iteration at batch B over the base batch's, per epoch.
    Every point within 15% (observed: at most 9%)."""
    p = pollux_profiles[app]
    for path in (pollux_data / "profiles" / app).glob("validation-*.csv"):
        batch = int(path.stem.split("-")[1])
        with path.open() as f:
            rows = list(csv.DictReader(f))
        for prev, row in zip(rows[:-1], rows[1:], strict=True):
            gain = (float(row["progress"]) - float(prev["progress"])) / (
                float(row["iteration"]) - float(prev["iteration"]))
            measured = gain * p.base_batch_size / batch
            est = GNSEstimate.from_base_batch_variance(
                float(row["grad_sqr"]), float(row["grad_var"]), p.base_batch_size)
            model = est.efficiency(batch, p.base_batch_size)
            assert model == pytest.approx(measured, rel=0.15), (batch, row)
        assert p.gns(batch, 1).efficiency(batch, p.base_batch_size) == pytest.approx(
            GNSEstimate.from_base_batch_variance(float(rows[1]["grad_sqr"]),
                                                 float(rows[1]["grad_var"]),
                                                 p.base_batch_size)
            .efficiency(batch, p.base_batch_size))


def _hints(tmp_path, **extra):
    params = ThroughputParams(0.01, 0.001, 0.005, 0.0, 0.02, 0.001, 1.5)
    doc = {
        "version": 1,
        "batch": {"base_batch_size": 32, "max_batch_size": 512, "local_bsz_bounds": [8, 128],
                  "gradient_accumulation": True},
        "throughput_params": params.to_dict(),
        "gradient": {"sqr_norm": 0.5, "var": 64.0},
        "progress": {"progress": 300.0}, "epoch": 3,
        "profile": [{"num_nodes": 1, "num_replicas": 2, "local_bsz": 32, "accum_steps": 0,
                     "step_time": 0.123, "compute_time": 0.1, "count": 40}],
        **extra}
    d = tmp_path / "myjob"
    d.mkdir()
    (d / "hints.json").write_text(json.dumps(doc))
    return d, params


def test_hints_of_a_stratagem_job_become_a_profile(tmp_path):
    d, params = _hints(tmp_path)
    (d / "profile.json").write_text(json.dumps({"epochs": 10}))
    p = load_profile(d)
    assert p.epochs == 10 and p.epoch_ends[0] == pytest.approx(100.0)  # 300 over 3 epochs
    assert p.step_time((2,), 32) == pytest.approx((0.123, 0.023))  # measured: as measured
    step, _ = p.step_time((4, 4), 64)  # unmeasured: the job's own model, on a grid
    assert step == pytest.approx(float(predict_step_time(params, 2, 8, 64)), rel=0.01)
    est = p.gns(128, 5)
    assert (est.sqr_norm, est.var) == pytest.approx((0.5, 64.0))
    assert (p.base_batch_size, p.max_batch_size, p.min_local_bsz, p.max_local_bsz) == (
        32, 512, 8, 128)


def test_bad_profiles_give_clear_errors(tmp_path):
    with pytest.raises(StratagemError, match="not found"):
        load_profiles(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(StratagemError, match="neither placements.csv nor hints.json"):
        load_profile(tmp_path / "empty")
    d, _ = _hints(tmp_path, batch={})
    with pytest.raises(StratagemError, match="incomplete"):
        load_hints_profile(d)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "placements.csv").write_text("placement,local_bsz,step_time,sync_time\n1,x,1,0\n")
    with pytest.raises(StratagemError, match="local_bsz"):
        load_profile(bad)

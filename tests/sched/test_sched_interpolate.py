"""Step-time interpolation: exact at measured points, monotone where the data is."""

from __future__ import annotations

import csv
from collections import defaultdict

import numpy as np
import pytest

from stratagem.sched.simulator.interpolate import (
    Measurement,
    StepTimeTable,
    normalize_placement,
    parse_placement,
)

APPS = ["bert", "cifar10", "deepspeech2", "imagenet", "ncf", "yolov3"]


def test_placements_are_rotation_invariant():
    assert normalize_placement((3, 1)) == (1, 3)
    assert normalize_placement((2, 0, 1, 3)) == (1, 3, 2)
    assert parse_placement("4123") == (1, 2, 3, 4)
    assert normalize_placement(()) == ()


@pytest.mark.parametrize("app", APPS)
def test_measured_points_come_back_exactly(pollux_data, pollux_profiles, app):
    table = pollux_profiles[app].steps
    d = pollux_data / "profiles" / app
    rows = defaultdict(list)
    with open(d / "placements.csv") as f:
        for r in csv.DictReader(f):
            rows[parse_placement(r["placement"]), float(r["local_bsz"])].append(
                (float(r["step_time"]), float(r["sync_time"])))
    for (placement, bsz), values in rows.items():
        step, sync = np.mean(values, axis=0)
        rotated = placement[1:] + placement[:1]
        assert table.lookup(rotated, bsz) == pytest.approx((step, sync), rel=1e-12)
    with open(d / "scalability.csv") as f:  # nodes > 4: no placement of this shape measured
        for r in csv.DictReader(f):
            n, k, b = int(r["num_nodes"]), int(r["num_replicas"]), float(r["local_bsz"])
            got = table.by_shape(n, k, b)
            assert got == pytest.approx((float(r["step_time"]), float(r["sync_time"])))


@pytest.mark.parametrize("app", APPS)
def test_monotone_in_local_batch_where_measurements_are(pollux_data, pollux_profiles, app):
    table = pollux_profiles[app].steps
    curves = defaultdict(dict)
    with open(pollux_data / "profiles" / app / "placements.csv") as f:
        for r in csv.DictReader(f):
            curves[parse_placement(r["placement"])][float(r["local_bsz"])] = float(
                r["step_time"])
    for placement, curve in curves.items():
        b = np.array(sorted(curve))
        for lo, hi in zip(b[:-1], b[1:], strict=True):  # between two measurements: between
            inside = [table.lookup(placement, x)[0] for x in np.linspace(lo, hi, 9)]
            ends = sorted((curve[lo], curve[hi]))
            assert ends[0] - 1e-12 <= min(inside) and max(inside) <= ends[1] + 1e-12
            if curve[hi] >= curve[lo]:
                assert np.all(np.diff(inside) >= -1e-12), placement


def _synthetic() -> StepTimeTable:
    """Step time strictly increasing in nodes, replicas and local batch; measured at
    1, 2, 4 and 8 nodes, 1-4 replicas per node, local batch 16 and 64."""
    rows = []
    for n in (1, 2, 4, 8):
        for per in range(1, 5):
            for b in (16, 64):
                step = 0.01 * b + 0.05 * n + 0.02 * n * per
                rows.append(Measurement(n, n * per, b, step, 0.05 * n))
    return StepTimeTable(rows)


def test_unmeasured_shapes_interpolate_between_neighbours_and_stay_monotone():
    table = _synthetic()
    # 3 nodes x 2 per node: halfway between (2, 4) and (4, 8), exact for data linear in n.
    assert table.by_shape(3, 6, 16)[0] == pytest.approx(0.16 + 0.15 + 0.12)
    for nodes in (1, 2, 3, 5, 6, 8):  # measured and unmeasured node counts
        steps = [table.by_shape(nodes, r, 32)[0] for r in range(nodes, 4 * nodes + 1)]
        assert np.all(np.diff(steps) > 0), nodes
    per_node = [table.by_shape(n, 2 * n, 32)[0] for n in range(1, 9)]
    assert np.all(np.diff(per_node) > 0)
    batches = [table.by_shape(5, 10, b)[0] for b in range(16, 65)]
    assert np.all(np.diff(batches) > 0)


def test_outside_the_measured_range_values_are_clamped():
    table = _synthetic()
    assert table.by_shape(8, 32, 64) == table.by_shape(20, 80, 64)  # beyond 8 nodes
    assert table.by_shape(1, 1, 16) == table.by_shape(1, 1, 2)  # below the smallest batch

"""Cost-aware target cluster size, and the request to Ray's autoscaler."""

from __future__ import annotations

from stratagem.adapt import GoodputFunction, ThroughputParams
from stratagem.adapt.noise_scale import GNSEstimate
from stratagem.sched.policy import JobView
from stratagem.service.autoscale import (
    AutoscaleOptions,
    request_nodes,
    target_nodes,
    utility_curve,
)


def linear(name: str, low: int = 1, high: int = 4) -> JobView:
    return JobView(name=name, submit_time=0.0, min_replicas=low, max_replicas=high)


def test_linear_jobs_grow_until_their_maximum():
    jobs = [linear("a"), linear("b")]  # speedup r at r replicas, at most 4 each
    assert utility_curve(jobs, 2, 6) == [0, 2, 4, 6, 8, 8, 8]
    assert target_nodes(jobs, 2, AutoscaleOptions(node_cost=1.0, max_nodes=6)) == 4
    assert target_nodes(jobs, 2, AutoscaleOptions(node_cost=2.5, max_nodes=6)) == 1
    assert target_nodes(jobs, 2, AutoscaleOptions(node_cost=1.0, max_nodes=3)) == 3
    assert target_nodes([], 2, AutoscaleOptions(min_nodes=1)) == 1


def test_minimum_replicas_are_always_provided():
    jobs = [linear("a", 3, 3), linear("b", 2, 2)]
    assert target_nodes(jobs, 2, AutoscaleOptions(node_cost=1e9, max_nodes=8)) == 3


def test_diminishing_goodput_stops_growth_at_the_cost():
    # communication-bound: 1 s of sync per step, tiny compute: extra replicas add little
    slow_sync = GoodputFunction(ThroughputParams(0.001, 1e-5, 1.0, 0.0, 1.0, 0.0, 1.0),
                                GNSEstimate(1.0, 1.0), 32)
    job = JobView(name="c", submit_time=0.0, min_replicas=1, max_replicas=8,
                  goodput=slow_sync, max_batch_size=64, local_bsz_bounds=(8, 64))
    curve = utility_curve([job], 1, 8)
    gains = [b - a for a, b in zip(curve[1:], curve[2:], strict=False)]
    assert all(g < 1.0 for g in gains)  # never as good as linear
    cheap = target_nodes([job], 1, AutoscaleOptions(node_cost=0.0, max_nodes=8))
    dear = target_nodes([job], 1, AutoscaleOptions(node_cost=max(gains) + 1e-9, max_nodes=8))
    assert dear == 1 and cheap >= dear


def test_the_request_names_one_bundle_per_node():
    asked = []
    bundles = request_nodes(3, {"GPU": 4.0, "CPU": 8.0}, request=lambda **kw: asked.append(kw))
    assert asked == [{"bundles": [{"GPU": 4.0, "CPU": 8.0}] * 3}] and len(bundles) == 3


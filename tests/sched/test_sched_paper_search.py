"""The Pollux baseline's genetic search: its repair step, restricted to the candidates that
break a rule (for speed), gives exactly what the whole-population version gave, so a seed's
decisions did not change."""

from __future__ import annotations

import numpy as np
import pytest

from stratagem.adapt import GNSEstimate, GoodputFunction, ThroughputParams
from stratagem.sched.policy import ClusterSpec, JobView, PolluxPaperPolicy, check_allocation
from stratagem.sched.policy.pollux_paper import _Ctx


def reference_repair(policy: PolluxPaperPolicy, pop: np.ndarray, c: _Ctx,
                     rng: np.random.Generator) -> np.ndarray:
    """The repair as first written: every rule applied to every candidate and row."""
    p, n_jobs, nodes = pop.shape
    pop = np.clip(pop, 0, c.gpn)
    pop = np.where(c.pinned[None, :, None], c.cur[None], pop)
    order = np.argsort(rng.random(pop.shape), axis=2)
    shuffled = np.take_along_axis(pop, order, axis=2)
    before = np.cumsum(shuffled, axis=2) - shuffled
    shuffled = np.clip(c.max_r[None, :, None] - before, 0, shuffled)
    np.put_along_axis(pop, order, shuffled, axis=2)
    jorder = np.argsort(rng.random((p, n_jobs)) - c.pinned[None] * 2.0, axis=1)
    idx = jorder[:, :, None]
    shuffled = np.take_along_axis(pop, idx, axis=1)
    before = np.cumsum(shuffled, axis=1) - shuffled
    shuffled = np.clip(c.gpn - before, 0, shuffled)
    pop = np.empty_like(pop)
    np.put_along_axis(pop, np.broadcast_to(idx, pop.shape), shuffled, axis=1)
    if not c.cluster.share_distributed:
        dist = ((pop > 0).sum(2) > 1)[:, :, None] & (pop > 0)
        dist_sorted = np.take_along_axis(dist, jorder[:, :, None], axis=1).astype(np.int64)
        seen = np.cumsum(dist_sorted, axis=1) - dist_sorted
        drop_sorted = (dist_sorted > 0) & (seen > 0)
        drop = np.zeros_like(drop_sorted)
        np.put_along_axis(drop, jorder[:, :, None], drop_sorted, axis=1)
        pop = np.where(drop, 0, pop)
    noise = rng.random(pop.shape)
    for _ in range(nodes):
        total, used = pop.sum(2), (pop > 0).sum(2)
        limit = -(-total // c.gpn) + policy.extra_nodes
        over = (used > limit) & ~c.pinned[None]
        if not over.any():
            break
        rank = np.argsort(np.argsort(-(pop + noise), axis=2), axis=2)
        pop = np.where((rank < limit[:, :, None]) | ~over[:, :, None], pop, 0)
    total = pop.sum(2)
    too_few = (total > 0) & (total < c.min_r[None]) & ~c.pinned[None]
    return np.where(too_few[:, :, None], 0, pop)


class _ReferencePaper(PolluxPaperPolicy):
    def _repair(self, pop, c, rng):
        return reference_repair(self, pop, c, rng)


def _ctx(rng: np.random.Generator, n_jobs: int, cluster: ClusterSpec) -> _Ctx:
    nodes, gpn = cluster.num_nodes, cluster.gpus_per_node
    cur = np.zeros((n_jobs, nodes), np.int64)
    for i in range(n_jobs):  # a few running jobs, some pinned
        if rng.random() < 0.4:
            cur[i, rng.integers(0, nodes)] = rng.integers(1, gpn + 1)
    running = cur.sum(1) > 0
    pinned = running & (rng.random(n_jobs) < 0.3)
    max_r = rng.integers(1, 3 * gpn, n_jobs)
    min_r = np.where(rng.random(n_jobs) < 0.2, 2, 1)
    return _Ctx(np.zeros((n_jobs, nodes + 1, 3 * gpn)), cur, running, pinned,
                np.ones(n_jobs), max_r, min_r, gpn, cluster)


@pytest.mark.parametrize("share", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_the_restricted_repair_equals_the_whole_population_one(seed, share):
    rng = np.random.default_rng(seed)
    cluster = ClusterSpec(int(rng.integers(2, 9)), 4, share_distributed=share)
    n_jobs = int(rng.integers(3, 40))
    ctx = _ctx(rng, n_jobs, cluster)
    pop = rng.integers(-1, 7, (30, n_jobs, cluster.num_nodes))
    policy = PolluxPaperPolicy(extra_nodes=int(rng.integers(0, 2)))
    a, b = np.random.default_rng(seed + 100), np.random.default_rng(seed + 100)
    got = policy._repair(pop.copy(), ctx, a)
    want = reference_repair(policy, pop.copy(), ctx, b)
    np.testing.assert_array_equal(got, want)
    assert a.random() == b.random()  # the same random numbers were drawn


def _goodput(rng: np.random.Generator) -> GoodputFunction:
    alpha, beta, sync, noise = rng.uniform([0.01, 1e-4, 1e-3, 0], [0.2, 1e-2, 0.3, 5000])
    params = ThroughputParams(alpha, beta, sync, sync * 0.01, 2 * sync, sync * 0.02, 1.5)
    return GoodputFunction(params, GNSEstimate(1.0, noise), 32)


def test_a_whole_decision_is_the_same_as_with_the_reference_repair():
    """Twenty jobs (some without a model, some running) on 4 x 4 GPUs, three decisions in a
    row: the same allocations as the search with the reference repair, for two seeds."""
    rng = np.random.default_rng(7)
    cluster = ClusterSpec(4, 4)
    jobs = [JobView(f"j{i}", float(i), age=600.0 + 60 * i, num_restarts=i % 3,
                    max_replicas=int(rng.integers(1, 17)),
                    preemptible=bool(i % 5),
                    goodput=_goodput(rng) if i % 4 else None, max_batch_size=2048,
                    local_bsz_bounds=(8, 256)) for i in range(20)]
    for seed in (0, 3):
        fast = PolluxPaperPolicy(population=24, generations=15, seed=seed)
        ref = _ReferencePaper(population=24, generations=15, seed=seed)
        cur_f, cur_r = {}, {}
        for step in range(3):
            cur_f = fast.allocate(jobs, cluster, cur_f, 60.0 * step)
            cur_r = ref.allocate(jobs, cluster, cur_r, 60.0 * step)
            assert cur_f == cur_r
            assert check_allocation(cur_f, jobs, cluster) == []
        assert sum(map(len, cur_f.values())) > 0

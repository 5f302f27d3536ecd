"""Policies: every constraint under random clusters and jobs, fairness by hand, and the
goodput-aware search against brute force."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stratagem.adapt import GNSEstimate, GoodputFunction, ThroughputParams
from stratagem.errors import StratagemError
from stratagem.sched.policy import (
    POLICIES,
    ClusterSpec,
    JobView,
    PolluxPolicy,
    check_allocation,
    make_policy,
)


def _goodput(alpha: float, beta: float, sync: float, noise: float) -> GoodputFunction:
    params = ThroughputParams(alpha, beta, sync, sync * 0.01, 2 * sync, sync * 0.02, 1.5)
    return GoodputFunction(params, GNSEstimate(1.0, noise), 32)


@st.composite
def scenarios(draw):
    cluster = ClusterSpec(draw(st.integers(1, 5)), draw(st.integers(1, 4)), draw(st.booleans()))
    jobs = []
    for i in range(draw(st.integers(1, 10))):
        lo = draw(st.integers(1, 3))
        hi = draw(st.integers(lo, 12))
        fn = _goodput(draw(st.floats(0.01, 0.2)), draw(st.floats(1e-4, 1e-2)),
                      draw(st.floats(1e-3, 0.3)), draw(st.floats(0.0, 5000.0)))
        jobs.append(JobView(
            name=f"j{i}", submit_time=float(draw(st.integers(0, 100))),
            age=float(draw(st.integers(0, 5000))),
            attained_service=float(draw(st.integers(0, 10000))),
            num_restarts=draw(st.integers(0, 3)), min_replicas=lo, max_replicas=hi,
            requested_replicas=draw(st.integers(1, 8)), goodput=fn, max_batch_size=1024,
            local_bsz_bounds=(8, 128), remaining_time=lambda n, r, k=i: (100 + k) / r ** 0.8))
    return cluster, jobs, draw(st.lists(st.booleans(), min_size=10, max_size=10))


@pytest.mark.parametrize("name", list(POLICIES))
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario=scenarios())
def test_every_allocation_keeps_every_constraint(name, scenario):
    cluster, jobs, pinned = scenario
    policy = make_policy(name)
    first = policy.allocate(jobs, cluster, {}, 0.0)
    assert check_allocation(first, jobs, cluster, {}) == []
    # Some running jobs become non-preemptible; one job leaves; decide again.
    later = [JobView(**{**j.__dict__, "preemptible": not (pin and first.get(j.name))})
             for j, pin in zip(jobs[1:], pinned, strict=False)] or jobs
    current = {k: v for k, v in first.items() if k != jobs[0].name}
    second = policy.allocate(later, cluster, current, 60.0)
    assert check_allocation(second, later, cluster, current) == []
    for j in later:
        if not j.preemptible and current.get(j.name):
            assert second[j.name] == current[j.name]


def test_check_allocation_names_each_violation():
    cluster = ClusterSpec(2, 2)
    jobs = [JobView("a", 0, max_replicas=2), JobView("b", 0), JobView("c", 0, preemptible=False)]
    bad = {"a": (0, 0, 1), "b": (0, 1), "x": (1,)}
    errors = "\n".join(check_allocation(bad, jobs, cluster, {"c": (1,)}))
    for part in ("a: 3 replicas outside [1, 2]", "node 0: 3 replicas on 2 GPUs",
                 "distributed jobs share it", "x: not an active job",
                 "c: non-preemptible job was moved"):
        assert part in errors


def test_two_identical_jobs_get_equal_shares():
    fn = _goodput(0.05, 1e-3, 0.02, 2000.0)
    jobs = [JobView(n, 0, age=600, goodput=fn, max_batch_size=1024, local_bsz_bounds=(8, 128))
            for n in ("a", "b")]
    alloc = PolluxPolicy().allocate(jobs, ClusterSpec(2, 4), {}, 0.0)
    assert len(alloc["a"]) == len(alloc["b"]) > 0
    assert len(set(alloc["a"])) == len(set(alloc["b"])) == 1  # each on its own node


def test_a_job_at_its_max_replicas_gets_no_more():
    fn = _goodput(0.05, 1e-3, 0.005, 1e5)  # scales well: both want everything
    jobs = [JobView("small", 0, age=600, max_replicas=2, goodput=fn, max_batch_size=4096,
                    local_bsz_bounds=(8, 128)),
            JobView("big", 0, age=600, max_replicas=8, goodput=fn, max_batch_size=4096,
                    local_bsz_bounds=(8, 128))]
    alloc = PolluxPolicy().allocate(jobs, ClusterSpec(2, 4), {}, 0.0)
    assert len(alloc["small"]) == 2 and len(alloc["big"]) == 6


def test_more_jobs_than_gpus_serve_the_least_attained_service_first():
    fn = _goodput(0.05, 1e-3, 0.02, 100.0)
    jobs = [JobView(f"j{i}", float(i), age=600, attained_service=1000.0 * (5 - i),
                    goodput=fn, max_batch_size=256, local_bsz_bounds=(8, 128))
            for i in range(6)]
    alloc = PolluxPolicy().allocate(jobs, ClusterSpec(1, 4), {}, 0.0)
    assert sorted(alloc) == ["j2", "j3", "j4", "j5"]


def test_restart_penalty_keeps_a_young_job_where_it_is():
    fn = _goodput(0.05, 1e-3, 0.005, 1e5)
    job = JobView("a", 0, age=60, goodput=fn, max_batch_size=4096, local_bsz_bounds=(8, 128))
    cluster = ClusterSpec(2, 4)
    assert len(PolluxPolicy().allocate([job], cluster, {}, 0.0)["a"]) == 8
    # Penalty factor max(age - restarts * delay, 0) / (age + delay): 60/90 with a 30 s
    # restart (8 GPUs still win), 60/3060 with a 3000 s one (staying on 1 GPU wins).
    moved = PolluxPolicy(restart_delay=30).allocate([job], cluster, {"a": (0,)}, 60.0)
    assert len(moved["a"]) == 8
    kept = PolluxPolicy(restart_delay=3000).allocate([job], cluster, {"a": (0,)}, 60.0)
    assert kept == {"a": (0,)}


@pytest.mark.parametrize("p", [-1.0, 0.0, 1.0])
def test_the_knapsack_finds_the_brute_force_optimum(p):
    """One big node (no placement limits): the chosen replica counts minimise the objective
    exactly, as enumerating every count vector does."""
    rng = np.random.default_rng(int(10 * p) + 17)
    for _ in range(6):
        jobs = [JobView(f"j{i}", float(i), age=1000.0, max_replicas=int(rng.integers(1, 6)),
                        goodput=_goodput(*rng.uniform([0.01, 1e-4, 1e-3, 0], [0.2, 1e-2, 0.3,
                                                                                 5000])),
                        max_batch_size=1024, local_bsz_bounds=(8, 128))
                for i in range(4)]
        gpus = int(rng.integers(2, 9))
        policy = PolluxPolicy(fairness=p)
        cluster = ClusterSpec(1, gpus)
        alloc = policy.allocate(jobs, cluster, {}, 0.0)
        fair = max(1, math.ceil(gpus / len(jobs)))
        tables = [policy.speedups(j, min(j.max_replicas, gpus), min(fair, j.max_replicas),
                                  gpus) for j in jobs]
        terms = [policy.phi(t) for t in tables]
        best = min(sum(f[k] for f, k in zip(terms, c, strict=True))
                   for c in itertools.product(*(range(len(t)) for t in tables))
                   if sum(c) <= gpus)
        got = sum(f[len(alloc.get(j.name, ()))] for f, j in zip(terms, jobs, strict=True))
        assert got == pytest.approx(best, rel=1e-9, abs=1e-9)


def test_unknown_policy_is_a_clear_error():
    with pytest.raises(StratagemError, match="unknown policy 'gandiva'"):
        make_policy("gandiva")


def test_the_paper_search_finds_the_brute_force_optimum_on_a_small_cluster():
    """Two nodes of two GPUs, three jobs: the genetic search's answer has the best fitness
    of every valid allocation matrix (enumerated; its own fitness and repair are the
    reference for validity, check_allocation for the rules)."""
    from stratagem.sched.policy import PolluxPaperPolicy
    from stratagem.sched.policy.pollux_paper import _Ctx

    rng = np.random.default_rng(5)
    jobs = [JobView(f"j{i}", float(i), age=1000.0, max_replicas=4,
                    goodput=_goodput(*rng.uniform([0.01, 1e-4, 1e-3, 0], [0.2, 1e-2, 0.3, 5000])),
                    max_batch_size=1024, local_bsz_bounds=(8, 128)) for i in range(3)]
    cluster = ClusterSpec(2, 2)
    policy = PolluxPaperPolicy(population=100, generations=100, seed=1)  # the paper's size
    alloc = policy.allocate(jobs, cluster, {}, 0.0)
    assert check_allocation(alloc, jobs, cluster, {}) == []
    fair = 2
    tables = np.stack([policy.table(j, 4, fair, cluster) for j in jobs])
    cur = np.zeros((3, 2), dtype=np.int64)
    ctx = _Ctx(tables, cur, np.zeros(3, bool), np.zeros(3, bool), np.ones(3),
               np.full(3, 4), np.ones(3, dtype=np.int64), 2, cluster)
    cands = []
    for cells in itertools.product(range(3), repeat=6):
        m = np.array(cells).reshape(3, 2)
        a = {f"j{i}": tuple(n for n in range(2) for _ in range(m[i, n])) for i in range(3)}
        if not check_allocation({k: v for k, v in a.items() if v}, jobs, cluster, {}):
            cands.append(m)
    fits = policy._fitness(np.stack(cands), ctx)
    got = np.zeros((1, 3, 2), dtype=np.int64)
    for i, j in enumerate(jobs):
        for n in alloc.get(j.name, ()):
            got[0, i, n] += 1
    assert policy._fitness(got, ctx)[0] == pytest.approx(fits.max(), rel=1e-9)


def test_the_paper_search_repair_keeps_every_rule_on_random_matrices():
    from stratagem.sched.policy import PolluxPaperPolicy
    from stratagem.sched.policy.pollux_paper import _Ctx

    rng = np.random.default_rng(0)
    cluster = ClusterSpec(4, 4)
    jobs = [JobView(f"j{i}", 0.0, max_replicas=int(rng.integers(1, 10))) for i in range(6)]
    max_r = np.array([j.max_replicas for j in jobs])
    ctx = _Ctx(np.zeros((6, 5, 17)), np.zeros((6, 4), np.int64), np.zeros(6, bool),
               np.zeros(6, bool), np.ones(6), max_r, np.ones(6, np.int64), 4, cluster)
    pop = rng.integers(0, 6, (50, 6, 4))
    fixed = PolluxPaperPolicy(extra_nodes=0)._repair(pop, ctx, rng)
    assert (fixed <= pop).all()
    for m in fixed:
        a = {f"j{i}": tuple(n for n in range(4) for _ in range(m[i, n])) for i in range(6)}
        assert check_allocation({k: v for k, v in a.items() if v}, jobs, cluster, {}) == []
        used = (m > 0).sum(1)
        assert (used <= -(-m.sum(1) // 4)).all()  # node-count limit with no slack


def test_service_weight_favours_the_job_with_less_attained_service():
    fn = _goodput(0.05, 1e-3, 0.005, 1e5)  # scales well: both want every GPU
    jobs = [JobView(n, 0, age=6000, attained_service=s, goodput=fn, max_batch_size=4096,
                    local_bsz_bounds=(8, 128)) for n, s in (("old", 36000.0), ("new", 0.0))]
    cluster = ClusterSpec(1, 4)
    even = PolluxPolicy().allocate(jobs, cluster, {}, 0.0)
    assert len(even["old"]) == len(even["new"]) == 2  # unweighted: equal speedups
    weighted = PolluxPolicy(service_weight=1.0).allocate(jobs, cluster, {}, 0.0)
    assert len(weighted["new"]) > len(weighted["old"]) > 0


def test_spread_aware_placement_prefers_a_packed_smaller_count_to_a_fragmented_one():
    # Cheap within a node, very expensive across nodes (alpha_n = 5 s per step).
    params = ThroughputParams(0.05, 1e-3, 0.005, 1e-4, 5.0, 1e-2, 1.5)
    fn = GoodputFunction(params, GNSEstimate(1.0, 1e5), 32)
    cluster = ClusterSpec(2, 4)
    pinned = [JobView(n, 0, age=600, preemptible=False, max_replicas=2) for n in ("p0", "p1")]
    job = JobView("a", 0, age=6000, goodput=fn, max_batch_size=4096, local_bsz_bounds=(8, 128))
    current = {"p0": (0, 0), "p1": (1, 1)}  # two GPUs free on each node
    plain = PolluxPolicy().allocate([*pinned, job], cluster, current, 0.0)
    assert len(set(plain["a"])) == 2  # packed-count search: 4 replicas over both nodes
    aware = PolluxPolicy(spread_aware=True).allocate([*pinned, job], cluster, current, 0.0)
    assert len(aware["a"]) == 2 and len(set(aware["a"])) == 1
    assert check_allocation(aware, [*pinned, job], cluster, current) == []


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario=scenarios())
def test_the_policy_options_keep_every_constraint(scenario):
    cluster, jobs, _ = scenario
    for policy in (PolluxPolicy(spread_aware=True, service_weight=0.5, restart_cost="resize"),
                   PolluxPolicy(defragment=True, reserve_growth=2)):
        _keeps_every_constraint(policy, cluster, jobs)


def _keeps_every_constraint(policy, cluster, jobs):
    first = policy.allocate(jobs, cluster, {}, 0.0)
    assert check_allocation(first, jobs, cluster, {}) == []
    second = policy.allocate(jobs, cluster, first, 60.0)
    assert check_allocation(second, jobs, cluster, first) == []


def test_bad_policy_options_are_clear_errors():
    with pytest.raises(StratagemError, match="restart_cost"):
        PolluxPolicy(restart_cost="free")
    with pytest.raises(StratagemError, match="service_weight"):
        PolluxPolicy(service_weight=-1.0)
    with pytest.raises(StratagemError, match="long_weight"):
        PolluxPolicy(long_weight=0.0)


def test_reserve_growth_moves_the_donor_once_while_a_capped_job_ramps_up():
    # Linear speedups, one node of 8 GPUs: the fair split of two jobs is 4 + 4. The new job
    # may double its replicas each decision (cap 1, 2, 4). Without a reserve, the old job
    # gives up GPUs at every step (8 -> 7 -> 6 -> 4: three restarts); with reserve_growth=4
    # it goes to 4 at once and the new job grows into the GPUs kept free for it.
    cluster = ClusterSpec(1, 8)
    big = JobView("big", 0.0, age=36000.0, max_replicas=8)

    def ramp(policy: PolluxPolicy) -> list[dict[str, int]]:
        current: dict[str, tuple[int, ...]] = {"big": (0,) * 8}
        seen = []
        for step, cap in enumerate((1, 2, 4)):
            new = JobView("new", 30000.0, age=6000.0, max_replicas=cap,
                          uncapped_max_replicas=8)
            alloc = policy.allocate([big, new], cluster, current, 36000.0 + 60 * step)
            assert check_allocation(alloc, [big, new], cluster, current) == []
            current = {k: v for k, v in alloc.items() if v}
            seen.append({k: len(v) for k, v in current.items()})
        return seen

    assert [s["big"] for s in ramp(PolluxPolicy(reserve_growth=0))] == [7, 6, 4]
    reserved = ramp(PolluxPolicy(reserve_growth=4))
    assert [s["big"] for s in reserved] == [4, 4, 4]
    assert [s["new"] for s in reserved] == [1, 2, 4]


def test_defragment_moves_a_small_job_so_a_planned_one_fits():
    # Three nodes of 4 GPUs. "a" spans nodes 0 and 1 (one replica each), "b" has one GPU on
    # node 2: 9 GPUs are free, but no node has 4 and only node 2 may host another multi-node
    # job, so the new job "c" (exactly 4 replicas) fits nowhere as things are. Repacked,
    # "c" takes a whole node and "a" moves onto one node (a restart, nearly free at its age).
    cluster = ClusterSpec(3, 4)
    jobs = [JobView("a", 0.0, age=1e6, max_replicas=2),
            JobView("b", 0.0, age=1e6, max_replicas=1),
            JobView("c", 9e5, age=600.0, min_replicas=4, max_replicas=4)]
    current = {"a": (0, 1), "b": (2,)}
    kept = PolluxPolicy(defragment=False).allocate(jobs, cluster, current, 1e6)
    assert "c" not in kept and kept["a"] == (0, 1)
    packed = PolluxPolicy(defragment=True).allocate(jobs, cluster, current, 1e6)
    assert check_allocation(packed, jobs, cluster, current) == []
    assert len(packed["c"]) == 4 and len(set(packed["c"])) == 1
    assert len(packed["a"]) == 2 and len(set(packed["a"])) == 1
    assert packed["b"] == (2,)


def test_long_jobs_are_served_first_come_first_served():
    # One node of 12 GPUs, linear speedups (no models yet), no restarts: the power-mean
    # objective (p = -1) minimises sum_j w_j / r_j. "short" (attained service below the
    # threshold) is capped at 4 and takes them either way. The two long jobs split the other
    # 8: equally without the rule (4 + 4); with it the younger one's weight is 1/16, so the
    # optimum is 1/r + (1/16)/(8 - r), smallest at r = 6 (0.198, against 0.205 at 7 and
    # 0.221 at 5): the older long job gets 6, the younger 2. "short" is submitted first, so
    # the oldest job is not what makes a job the leader: the oldest *long* job is.
    cluster = ClusterSpec(1, 12)
    hours = 3600.0
    jobs = [JobView("short", 0.0, age=9e4, attained_service=1 * hours, max_replicas=4),
            JobView("old", 10.0, age=9e4, attained_service=40 * hours, max_replicas=12),
            JobView("young", 20.0, age=9e4, attained_service=50 * hours, max_replicas=12)]
    shared = PolluxPolicy(long_weight=1.0).allocate(jobs, cluster, {}, 9e4)
    assert {n: len(r) for n, r in shared.items()} == {"short": 4, "old": 4, "young": 4}
    policy = PolluxPolicy(long_weight=1 / 16)
    assert policy.queued_long_jobs(jobs) == {"young"}
    fifo = policy.allocate(jobs, cluster, {}, 9e4)
    assert check_allocation(fifo, jobs, cluster, {}) == []
    assert {n: len(r) for n, r in fifo.items()} == {"short": 4, "old": 6, "young": 2}
    # Below the threshold nobody is queued: the same jobs with little service share equally.
    fresh = [JobView(j.name, j.submit_time, age=j.age, attained_service=60.0,
                     max_replicas=j.max_replicas) for j in jobs]
    assert policy.queued_long_jobs(fresh) == frozenset()
    assert {n: len(r) for n, r in policy.allocate(fresh, cluster, {}, 9e4).items()} == {
        "short": 4, "old": 4, "young": 4}

"""The simulator against schedules and JCTs worked out by hand, and its determinism.

The toy applications (conftest.write_toy_profile): an epoch is 60 s on one GPU and 30 s on
two GPUs of one node, at the submitted batch of 8; ``toy1`` has one epoch, ``toy2`` two.
Decisions every 60 s; jobs submitted between decisions wait for the next one.
"""

from __future__ import annotations

import dataclasses

import pytest

from stratagem.errors import StratagemError
from stratagem.sched.policy import FifoPolicy, OptimusPolicy, PolluxPolicy, TiresiasPolicy
from stratagem.sched.simulator.engine import SimOptions, scale_arrivals, simulate
from stratagem.sched.simulator.workload import JobSpec, load_workload


def _jct(result):
    return {j.name: j.jct for j in result.jobs}


def _run(profiles, specs, policy, **opts):
    base = {"num_nodes": 1, "gpus_per_node": 2, "interval": 60.0, "restart_delay": 0.0}
    return simulate(specs, profiles, policy, SimOptions(**{**base, **opts}))


FIFO_JOBS = [JobSpec("a", 0, "toy2", 2, 8), JobSpec("b", 0, "toy2", 1, 8),
             JobSpec("c", 30, "toy2", 1, 8)]


def test_fifo_by_hand(toy_profiles):
    # a takes both GPUs at 0 and needs 60 s; b cannot fit (strict FIFO) until a ends at 60;
    # c (submitted at 30) is considered at 60; b and c then need 120 s each on one GPU.
    r = _run(toy_profiles, FIFO_JOBS, FifoPolicy())
    assert _jct(r) == pytest.approx({"a": 60, "b": 180, "c": 150})
    assert r.allocations[:3] == [{"a": 2}, {"b": 1, "c": 1}, {"b": 1, "c": 1}]


def test_fifo_by_hand_with_restart_delay(toy_profiles):
    # 30 s of start-up each: a ends at 90, so b and c start at the decision at 120 and end
    # at 120 + 30 + 120 = 270.
    r = _run(toy_profiles, FIFO_JOBS, FifoPolicy(), restart_delay=30.0)
    assert _jct(r) == pytest.approx({"a": 90, "b": 270, "c": 240})
    assert {j.name: j.gpu_seconds for j in r.jobs} == pytest.approx(
        {"a": 180, "b": 150, "c": 150})


def test_tiresias_by_hand(toy_profiles):
    # One GPU; queue threshold 60 GPU-seconds; each job needs 120 s.
    # 0-60 p (queue 0, oldest); 60-120 q (p demoted); r arrives at 90, at 120 it is the only
    # job in queue 0: 120-180 r; then queue 1 in submission order: p 180-240 (done),
    # q 240-300 (done), r 300-360 (done).
    specs = [JobSpec("p", 0, "toy2", 1, 8), JobSpec("q", 0, "toy2", 1, 8),
             JobSpec("r", 90, "toy2", 1, 8)]
    r = _run(toy_profiles, specs, TiresiasPolicy(thresholds=(60.0,)), gpus_per_node=1)
    assert _jct(r) == pytest.approx({"p": 240, "q": 300, "r": 270})
    running = [next(iter(a)) for a in r.allocations]
    assert running == ["p", "q", "r", "p", "q", "r"]
    assert {j.name: j.num_restarts for j in r.jobs} == {"p": 1, "q": 1, "r": 1}


def test_optimus_by_hand(toy_profiles):
    # Two GPUs. Remaining time on one GPU: u 60 s, s and v 120 s; on two GPUs half that.
    # t=0: one GPU each for the two shortest (u, then s by name); nothing left to add.
    # t=60: u done, s half done (60 s left on one GPU, 30 on two), v untouched: one each.
    # t=120: s done; v alone gets both GPUs: 60 s of work left on one GPU -> 30 s on two.
    specs = [JobSpec("s", 0, "toy2", 1, 8), JobSpec("u", 0, "toy1", 1, 8),
             JobSpec("v", 0, "toy2", 1, 8)]
    r = _run(toy_profiles, specs, OptimusPolicy())
    assert _jct(r) == pytest.approx({"u": 60, "s": 120, "v": 150})
    assert r.allocations == [{"s": 1, "u": 1}, {"s": 1, "v": 1}, {"v": 2}]


def test_same_seed_same_result_and_the_seed_matters_with_noise(toy_profiles):
    specs = [JobSpec(f"j{i}", 20.0 * i, "toy2" if i % 2 else "toy1", 1 + i % 2, 8)
             for i in range(8)]
    runs = [_run(toy_profiles, specs, PolluxPolicy(), num_nodes=2, step_noise=0.3, seed=s)
            for s in (1, 1, 2)]
    strip = lambda r: (r.jobs, r.allocations, r.times)  # noqa: E731
    assert strip(runs[0]) == strip(runs[1])
    assert _jct(runs[0]) != _jct(runs[2])


def test_pollux_on_real_profiles_is_deterministic_and_jobs_adapt(pollux_data, pollux_profiles):
    specs = load_workload(pollux_data / "workloads-realistic" / "workload-1.csv")[:24]
    opts = SimOptions(num_nodes=4, gpus_per_node=4)
    a, b = (simulate(specs, pollux_profiles, PolluxPolicy(), opts) for _ in range(2))
    assert a.jobs == b.jobs and a.allocations == b.allocations
    assert all(j.completion_time is not None for j in a.jobs)
    grew = [j for j in a.jobs if j.final_batch_size > pollux_profiles[j.application]
            .base_batch_size]
    assert grew, "no job chose a batch above its base batch"
    assert max(sum(x.values()) for x in a.allocations) <= 16


def test_a_policy_that_breaks_constraints_is_stopped(toy_profiles):
    class Greedy(FifoPolicy):
        def allocate(self, jobs, cluster, current, now):
            return {j.name: (0, 0, 0) for j in jobs}  # three replicas on a 2-GPU node

    with pytest.raises(StratagemError, match="broke constraints"):
        _run(toy_profiles, FIFO_JOBS, Greedy())


def test_missing_profile_and_bad_options(toy_profiles, tmp_path):
    with pytest.raises(StratagemError, match="no profile"):
        _run(toy_profiles, [JobSpec("x", 0, "nope", 1, 8)], FifoPolicy())
    with pytest.raises(StratagemError, match="interval"):
        SimOptions(interval=0)
    bad = tmp_path / "w.csv"
    bad.write_text("name,time,application,num_replicas,batch_size\na,0,toy1,0,8\n")
    with pytest.raises(StratagemError, match="num_replicas from 1 to"):
        load_workload(bad)
    assert dataclasses.replace(SimOptions(), seed=3).seed == 3


def test_load_factor_scales_arrivals(toy_profiles):
    specs = [JobSpec("a", 0, "toy1", 1, 8), JobSpec("b", 120, "toy1", 1, 8)]
    assert [s.submit_time for s in scale_arrivals(specs, 2.0)] == [0, 60]
    r = _run(toy_profiles, specs, FifoPolicy(), load=2.0)
    assert {j.name: j.submit_time for j in r.jobs} == {"a": 0, "b": 60}
    with pytest.raises(StratagemError, match="load"):
        SimOptions(load=0)


def test_a_job_learns_its_model_only_from_what_it_ran(pollux_profiles):
    """No oracle: before running, no model (policies see linear speedup); after running on
    one GPU, exactly fit_throughput of the profile's step times for what it ran."""
    from stratagem.adapt import ProfileRecord, fit_throughput
    from stratagem.sched.simulator.job import SimJob

    app = pollux_profiles["cifar10"]
    job = SimJob(JobSpec("x", 0, "cifar10", 1, 128), app, adaptive=True, restart_delay=0.0,
                 total_gpus=64, oracle=False)
    assert job.view(0.0, True).goodput is None and job.view(0.0, True).max_replicas == 1
    job.allocate((0,), 0.0)
    assert (job.local_bsz, job.accum_steps) == (128, 0)  # the submitted batch: no model yet
    job.advance(0.0, 60.0)
    step, sync = app.step_time((1,), 128, 0)
    ref = fit_throughput([ProfileRecord(1, 1, 128, step, 0, step - sync)])
    assert job.throughput_params() == ref
    assert job.view(60.0, True).max_replicas == 2  # Pollux: twice what it has run on
    oracle = SimJob(JobSpec("y", 0, "cifar10", 1, 128), app, adaptive=True,
                    restart_delay=0.0, total_gpus=64, oracle=True)
    assert oracle.view(0.0).goodput.throughput_params == app.throughput_params

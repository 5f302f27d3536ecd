"""The simulation loop: every ``interval`` seconds the policy decides, then jobs run.

Deterministic: the same workload, profiles, policy and options give the same result; the
seed only draws each job's step-time slowdown when ``step_noise`` > 0 (a job-specific factor
``exp(N(0, step_noise))``, for robustness studies). Jobs submitted between decisions wait for
the next one, as under a real scheduler's periodic loop.

By default no job knows its throughput model in advance: each learns it from the
configurations it runs (:mod:`.job`), and an adaptive job may grow to at most twice the most
replicas it has run on (Pollux's exploration rule). ``oracle=True`` gives every job its
application's model fitted on the whole profile from the start and lifts the cap (unless
``explore_cap`` says otherwise). ``load`` scales the arrival rate: submission times are
divided by it (2.0: the same jobs arrive twice as fast).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from stratagem.errors import StratagemError
from stratagem.sched.policy.base import ClusterSpec, Policy, check_allocation
from stratagem.sched.simulator.job import JobRecord, SimJob
from stratagem.sched.simulator.profile import AppProfile
from stratagem.sched.simulator.workload import JobSpec

Progress = Callable[[float, int, int], None]  # (simulated time, jobs done, jobs in total)


@dataclass(frozen=True)
class SimOptions:
    """Cluster shape, scheduling interval and job-model settings of one simulation."""

    num_nodes: int = 16
    gpus_per_node: int = 4
    interval: float = 60.0
    restart_delay: float = 30.0
    seed: int = 0
    step_noise: float = 0.0
    share_distributed: bool = False
    explore_cap: bool | None = None  # at most twice the replicas run on; None: not oracle
    oracle: bool = False  # jobs know their application's throughput model from the start
    load: float = 1.0  # arrival-rate factor: submission times are divided by it
    max_time: float = 60 * 86400.0  # stop (and report unfinished jobs) after 60 days

    def __post_init__(self) -> None:
        checks = {"num_nodes": self.num_nodes >= 1, "gpus_per_node": self.gpus_per_node >= 1,
                  "interval": self.interval > 0, "restart_delay": self.restart_delay >= 0,
                  "step_noise": self.step_noise >= 0, "max_time": self.max_time > 0,
                  "load": self.load > 0}
        bad = [k for k, ok in checks.items() if not ok]
        if bad:
            raise StratagemError(f"invalid simulation options: {', '.join(bad)}",
                                 fix="positive nodes, GPUs, interval and load; delays >= 0")

    @property
    def capped(self) -> bool:
        """Whether the exploration cap applies (default: when jobs learn their model)."""
        return (not self.oracle) if self.explore_cap is None else self.explore_cap

    @property
    def cluster(self) -> ClusterSpec:
        return ClusterSpec(self.num_nodes, self.gpus_per_node, self.share_distributed)


@dataclass
class SimResult:
    """What happened: per-job records, the allocation at each decision, decision times."""

    policy: str
    workload: str
    options: SimOptions
    jobs: list[JobRecord]
    times: list[float] = field(default_factory=list)
    allocations: list[dict[str, int]] = field(default_factory=list)  # job -> replicas
    decision_seconds: list[float] = field(default_factory=list)
    decision_cpu_seconds: list[float] = field(default_factory=list)  # CPU time: load-proof
    active_jobs: list[int] = field(default_factory=list)
    wall_seconds: float = 0.0
    applications: dict[str, str] = field(default_factory=dict)  # job -> application


def scale_arrivals(specs: Sequence[JobSpec], load: float) -> list[JobSpec]:
    """The same jobs arriving ``load`` times as fast (submission times divided by it)."""
    if load == 1.0:
        return list(specs)
    return [dataclasses.replace(s, submit_time=s.submit_time / load) for s in specs]


def simulate(specs: Sequence[JobSpec], profiles: Mapping[str, AppProfile], policy: Policy,
             options: SimOptions = SimOptions(), workload: str = "workload",
             progress: Progress | None = None) -> SimResult:
    """Replay ``specs`` under ``policy`` (see the module doc)."""
    missing = sorted({s.application for s in specs} - set(profiles))
    if missing:
        raise StratagemError(f"no profile for application(s) {missing}", where=workload,
                             fix="--profiles must hold a directory per application")
    wall = time.perf_counter()
    cluster = options.cluster
    rng = np.random.default_rng(options.seed)
    noise = (np.exp(rng.normal(0.0, options.step_noise, len(specs))) if options.step_noise
             else np.ones(len(specs)))
    order = sorted(scale_arrivals(specs, options.load), key=lambda s: (s.submit_time, s.name))
    jobs = [SimJob(s, profiles[s.application], adaptive=policy.adaptive_batch,
                   restart_delay=options.restart_delay, total_gpus=cluster.total_gpus,
                   slowdown=float(k), oracle=options.oracle)
            for s, k in zip(order, noise, strict=True)]
    result = SimResult(policy.name, workload, options, [],
                       applications={s.name: s.application for s in order})
    step = options.interval
    now, nxt, done = 0.0, 0, 0
    current: dict[str, tuple[int, ...]] = {}
    while done < len(jobs) and now <= options.max_time:
        while nxt < len(jobs) and jobs[nxt].spec.submit_time <= now:
            nxt += 1
        active = [j for j in jobs[:nxt] if not j.done]
        if not active:  # idle cluster: jump to the decision after the next submission
            now = float(np.ceil(jobs[nxt].spec.submit_time / step) * step)
            continue
        views = [j.view(now, options.capped) for j in active]
        t0, c0 = time.perf_counter(), time.process_time()
        alloc = policy.allocate(views, cluster, current, now)
        result.decision_seconds.append(time.perf_counter() - t0)
        result.decision_cpu_seconds.append(time.process_time() - c0)
        errors = check_allocation(alloc, views, cluster, current)
        if errors:
            raise StratagemError(f"policy {policy.name!r} broke constraints at t={now:.0f}s: "
                                 + "; ".join(errors[:5]), where="sched.simulator",
                                 fix="a policy bug: place replicas with sched.policy.placement")
        current = {n: tuple(sorted(r)) for n, r in alloc.items() if r}
        for j in active:
            j.allocate(current.get(j.spec.name, ()), now)
        result.times.append(now)
        result.allocations.append({n: len(r) for n, r in current.items()})
        result.active_jobs.append(len(active))
        for j in active:
            j.advance(now, step)
        now += step
        finished = [j for j in active if j.done]
        done += len(finished)
        for j in finished:
            current.pop(j.spec.name, None)
        if progress is not None:
            progress(now, done, len(jobs))
    result.jobs = [j.record() for j in jobs]
    result.wall_seconds = time.perf_counter() - wall
    return result

"""A goodput-aware policy in the spirit of Pollux (Qiao et al., OSDI 2021).

Each job's *speedup* at ``r`` replicas is its goodput there, with the batch size and
accumulation it would pick (``GoodputFunction.optimize_grid``: the job's own model), divided
by its goodput at its fair share (``ceil(GPUs / jobs)`` replicas). The objective is the power
mean of speedups, ``(mean_j (s_j + eps)^p)^(1/p)`` (``p`` = ``fairness``; -1 by default,
more negative is fairer, 1 is plain throughput). Changing a running job's allocation costs a
restart: its speedup is scaled by ``max(age - restarts * delay, 0) / (age + delay)``; so does
starting a job that was stopped before (``restarts > 0``: a preemption is a checkpoint-restart
too), so that jobs tied for the accelerators do not take turns.

Search. The power mean is monotone in ``sum_j phi(s_j)`` (``phi(s) = (s+eps)^p`` minimised
for ``p < 0``, maximised otherwise; ``log`` for ``p = 0``), a sum of per-job terms in the
job's replica count alone, under one budget (the cluster's GPUs). A multiple-choice knapsack
dynamic program finds the exact optimum of that count problem in ``O(jobs x GPUs x
replicas)`` (about 0.7 M steps for 160 jobs on 64 GPUs) instead of a genetic search. Counts
are then placed consolidated (:mod:`.placement`, which keeps node capacity and at most one
distributed job per node); a job that cannot be placed at its count takes the largest count
that fits, and leftover GPUs go to whichever job gains most from one more. Ties between
unallocated jobs go to the least attained service, then the oldest.

Two options on by default (chosen on workloads 1-4 of the Pollux set, checked on 5-8; see
docs/concepts/scheduling.md): ``reserve_growth`` (k = 2; 0: off) plans a job held back by the
exploration cap at up to k times its cap (from ``JobView.uncapped_max_replicas``) and keeps the
difference free, so the jobs that make room for its ramp-up restart once, not at every step;
``defragment``: when a planned count does not fit where the other jobs are, a largest-first
repacked layout (jobs keep their nodes where those are still free) is priced with a restart
for every job it moves, and replaces the kept layout if the objective is better.

A third default (chosen on workloads 3, 5, 6 and 7 at load 0.5, checked on the rest and at
loads 1-2): ``long_weight`` (1/16; 1: off). The long jobs, those with at least
``long_service`` GPU-seconds (32 GPU-hours: twice Tiresias's threshold, so that a job that
only just passes 16, such as YOLOv3's, is not queued behind a far longer one), are served
first come, first served: every long job but the oldest has its term weighted by
``long_weight``, so the oldest takes the GPUs the short jobs leave and the younger ones keep
a share that the fairness term still will not let fall to zero. Long jobs of similar size
finish one after another instead of all late together; short jobs, below the threshold, are
untouched.

Options measured against the Pollux baseline and left off by default (no robust gain):
``spread_aware`` prices a fragmented placement at its real node count; ``restart_cost`` picks
another restart-cost model; ``service_weight`` weights each job's term by its attained
service.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from stratagem.errors import StratagemError
from stratagem.sched.policy.base import Allocation, ClusterSpec, JobView
from stratagem.sched.policy.placement import NodeState, keep_or_place

_EPS = 1e-3  # added to every speedup so the power mean stays finite at 0 replicas
_RESTART_COSTS = ("pollux", "resize", "half")


@dataclass
class PolluxPolicy:
    """``fairness``: power-mean exponent ``p``; ``restart_delay``: seconds a restart costs;
    ``restart_cost``: "pollux" (cumulative, the paper's), "resize" or "half";
    ``spread_aware``, ``service_weight`` / ``service_scale``, ``reserve_growth`` (0: off),
    ``defragment``, ``long_weight`` (1: off) / ``long_service`` (GPU-seconds): see the
    module docstring."""

    fairness: float = -1.0
    restart_delay: float = 30.0
    restart_cost: str = "pollux"
    spread_aware: bool = False
    service_weight: float = 0.0
    service_scale: float = 3600.0
    reserve_growth: int = 2
    defragment: bool = True
    long_weight: float = 1.0 / 16
    long_service: float = 32 * 3600.0
    name: str = "pollux"
    adaptive_batch: bool = True
    _cache: dict = field(default_factory=dict, repr=False)
    _fresh: dict = field(default_factory=dict, repr=False)
    _queued: frozenset[str] = field(default=frozenset(), repr=False)

    def __post_init__(self) -> None:
        if self.restart_cost not in _RESTART_COSTS:
            raise StratagemError(f"unknown restart_cost {self.restart_cost!r}",
                                 where="PolluxPolicy",
                                 fix=f"use one of {', '.join(_RESTART_COSTS)}")
        if self.reserve_growth < 0 or self.reserve_growth == 1:
            raise StratagemError(f"reserve_growth must be 0 (off) or >= 2, got "
                                 f"{self.reserve_growth}", where="PolluxPolicy",
                                 fix="e.g. reserve_growth=2: plan up to twice the cap")
        if not 0 < self.long_weight <= 1 or self.long_service <= 0:
            raise StratagemError(f"long_weight must be in (0, 1] and long_service > 0, got "
                                 f"{self.long_weight} and {self.long_service}",
                                 where="PolluxPolicy", fix="e.g. long_weight=1/16 (1: off), "
                                 "long_service=115200 (GPU-seconds, the default)")
        if self.service_weight < 0 or self.service_scale <= 0:
            raise StratagemError("service_weight must be >= 0 and service_scale > 0",
                                 where="PolluxPolicy", fix="e.g. service_weight=0.5, "
                                 "service_scale=3600 (GPU-seconds)")

    # -- per-job terms ---------------------------------------------------------------------
    def speedups(self, job: JobView, max_r: int, fair: int, gpn: int) -> np.ndarray:
        """Speedup at 0..max_r replicas (consolidated placements), relative to ``fair``."""
        r = np.arange(0, max_r + 1)
        if job.goodput is None or max_r == 0:
            return r / max(fair, 1)
        fn = job.goodput
        key = (fn.throughput_params, fn.gns, fn.base_batch_size, max_r, fair, gpn,
               job.max_batch_size, job.local_bsz_bounds, job.gradient_accumulation)
        hit = self._fresh.get(key)
        if hit is None:
            hit = self._cache.get(key)
        if hit is not None:
            self._fresh[key] = hit
            return hit
        reps = np.arange(1, max(max_r, fair) + 1)
        grid = fn.optimize_grid(np.ceil(reps / gpn), reps,
                                job.max_batch_size or fn.base_batch_size,
                                job.local_bsz_bounds, job.gradient_accumulation)
        good = np.asarray(grid.goodput, dtype=float)
        base = good[fair - 1] if good[fair - 1] > 0 else float(good.max(initial=0.0))
        out = np.zeros(max_r + 1)
        out[1:] = good[:max_r] / base if base > 0 else reps[:max_r] / fair
        self._fresh[key] = out
        return out

    def phi(self, s: np.ndarray) -> np.ndarray:
        """Per-job term to *minimise* (monotone decreasing in the speedup)."""
        p = self.fairness
        if p == 0:
            return -np.log(s + _EPS)
        return (s + _EPS) ** p if p < 0 else -((s + _EPS) ** p)

    def _weight(self, job: JobView) -> float:
        """Weight of a job's term: ``long_weight`` for a long job queued behind an older one;
        with ``service_weight``, less attained service, more weight."""
        w = self.long_weight if job.name in self._queued else 1.0
        if not self.service_weight:
            return w
        return w * (1.0 + job.attained_service / self.service_scale) ** -self.service_weight

    def queued_long_jobs(self, jobs: Sequence[JobView]) -> frozenset[str]:
        """The long jobs (``attained_service >= long_service``) other than the oldest one:
        first come, first served among the long jobs, as in Tiresias's last queue."""
        if self.long_weight == 1.0:
            return frozenset()
        long = sorted((j for j in jobs if j.attained_service >= self.long_service),
                      key=lambda j: (j.submit_time, j.name))
        return frozenset(j.name for j in long[1:])

    def restart_factor(self, job: JobView) -> float:
        """Speedup kept by a job whose allocation changes now (1: no cost)."""
        d = self.restart_delay
        if d <= 0:
            return 1.0
        if self.restart_cost == "resize":
            # One restart loses ``d`` seconds of a remaining time estimated, as Pollux
            # does, by the job's age: only this change is charged, not past ones.
            return max(job.age - d, 0.0) / max(job.age, d)
        if self.restart_cost == "half":
            return job.age / (job.age + d)
        return max(job.age - job.num_restarts * d, 0.0) / (job.age + d)

    # -- decision --------------------------------------------------------------------------
    def allocate(self, jobs: Sequence[JobView], cluster: ClusterSpec,
                 current: Mapping[str, tuple[int, ...]], now: float) -> Allocation:
        if not jobs:
            return {}
        # Tables are keyed by the model, not the job: jobs with the same model share one;
        # kept: those the last decision used.
        self._cache, self._fresh = self._fresh, {}
        gpus, gpn = cluster.total_gpus, cluster.gpus_per_node
        fair = max(1, math.ceil(gpus / len(jobs)))
        self._queued = self.queued_long_jobs(jobs)
        priority = sorted(jobs, key=lambda j: (j.attained_service, j.submit_time, j.name))
        tie = {j.name: (len(jobs) - i) * 1e-9 for i, j in enumerate(priority)}
        costs, options, moved = [], [], {}
        for job in jobs:
            now_r = len(current.get(job.name, ()))
            max_r = min(job.max_replicas, gpus)
            if self.reserve_growth and job.uncapped_max_replicas and job.preemptible:
                max_r = min(job.uncapped_max_replicas, self.reserve_growth * max_r, gpus)
            if not job.preemptible and now_r:
                opts = np.array([now_r])
                s = self.speedups(job, now_r, min(fair, now_r), gpn)[opts]
            else:
                lo = max(job.min_replicas, 1)
                opts = np.array([0] + list(range(lo, max_r + 1)))
                s = self.speedups(job, max_r, min(fair, max(max_r, 1)), gpn)[opts]
                if now_r or job.num_restarts:  # a change, or restarting a preempted job
                    here = s[opts == now_r]
                    if now_r and here.size:  # the same count on other nodes: a restart too
                        moved[job.name] = float(self.phi(here * self.restart_factor(job))[0]
                                                * self._weight(job))
                    s = np.where(opts == now_r, s, s * self.restart_factor(job))
            f = self.phi(s) * self._weight(job)
            f = f + np.where(opts == 0, tie[job.name] * abs(float(self.phi(np.zeros(1))[0])),
                             0.0)
            costs.append(f)
            options.append(opts)
        counts = self._knapsack(costs, options, gpus)
        names = [j.name for j in jobs]
        chosen = {n: int(c) for n, c in zip(names, counts, strict=True)}
        # A job held back by the exploration cap gets the cap now; the rest of its planned
        # count stays free for its next growth steps, so the jobs that gave it up are not
        # restarted again at every step.
        reserve = 0
        if self.reserve_growth:  # (only then may a choice exceed a job's cap)
            for j in jobs:
                if chosen[j.name] > j.max_replicas:
                    reserve += chosen[j.name] - j.max_replicas
                    chosen[j.name] = j.max_replicas
            keep = [o <= j.max_replicas for j, o in zip(jobs, options, strict=True)]
            costs = [f[k] for f, k in zip(costs, keep, strict=True)]
            options = [o[k] for o, k in zip(options, keep, strict=True)]
        return self._place(jobs, chosen, costs, options, cluster, current, reserve, moved)

    @staticmethod
    def _knapsack(costs: list[np.ndarray], options: list[np.ndarray], gpus: int) -> list[int]:
        """Exact minimum of ``sum_j costs[j][choice_j]`` with ``sum options <= gpus``."""
        best = np.zeros(gpus + 1)  # best[g]: minimum cost of the jobs so far using <= g GPUs
        picks = []
        g = np.arange(gpus + 1)
        for f, opts in zip(costs, options, strict=True):
            rest = g[:, None] - opts[None, :]
            total = np.where(rest >= 0, best[np.maximum(rest, 0)] + f[None, :], np.inf)
            pick = np.argmin(total, axis=1)
            best = total[g, pick]
            picks.append(pick)
        out, left = [], gpus
        for pick, opts in zip(reversed(picks), reversed(options), strict=True):
            r = int(opts[pick[left]])
            out.append(r)
            left -= r
        return out[::-1]

    def _place(self, jobs: Sequence[JobView], counts: dict[str, int], costs: list[np.ndarray],
               options: list[np.ndarray], cluster: ClusterSpec,
               current: Mapping[str, tuple[int, ...]], reserve: int = 0,
               moved: Mapping[str, float] | None = None) -> Allocation:
        cost_of = {j.name: dict(zip(o.tolist(), f.tolist(), strict=True))
                   for j, f, o in zip(jobs, costs, options, strict=True)}
        pinned = [j.name for j in jobs if not j.preemptible and current.get(j.name)]
        order = pinned + sorted((n for n in counts if n not in pinned),
                                key=lambda n: (-counts[n], n))
        out = self._fill(jobs, order, counts, cost_of, pinned, cluster, current, reserve,
                         repack=False)
        if self.defragment and any(len(out.get(n, ())) < c for n, c in counts.items()):
            # Some job did not fit at its planned count (fragmentation, or the rule of one
            # multi-node job per node): a repacked layout, priced with a restart for every
            # job it moves, replaces the kept one when the objective says it is better.
            again = self._fill(jobs, order, counts, cost_of, pinned, cluster, current,
                               reserve, repack=True)
            moved = moved or {}
            if (self._score(again, cost_of, current, moved)
                    < self._score(out, cost_of, current, moved)):
                out = again
        return out

    @staticmethod
    def _score(out: Allocation, cost_of: Mapping[str, Mapping[int, float]],
               current: Mapping[str, tuple[int, ...]], moved: Mapping[str, float]) -> float:
        """The objective's sum for a placed allocation (lower is better): a job at its
        current count on other nodes pays the restart as well."""
        total = 0.0
        for name, cost in cost_of.items():
            reps = tuple(sorted(out.get(name, ())))
            before = tuple(sorted(current.get(name, ())))
            if reps and len(reps) == len(before) and reps != before and name in moved:
                total += moved[name]
            else:
                total += cost.get(len(reps), cost.get(0, 0.0))
        return total

    def _fill(self, jobs: Sequence[JobView], order: list[str], counts: dict[str, int],
              cost_of: dict[str, dict[int, float]], pinned: list[str], cluster: ClusterSpec,
              current: Mapping[str, tuple[int, ...]], reserve: int, *,
              repack: bool) -> Allocation:
        """Place the planned counts: jobs that keep their count stay on their nodes first
        (``repack=False``), or every job in ``order`` (largest first) keeps its nodes only if
        they are still free when its turn comes (``repack=True``); then fallbacks, leftovers."""
        state = NodeState(cluster)
        if repack:
            out: Allocation = {}
            for name in order:
                before = tuple(sorted(current.get(name, ())))
                if not counts.get(name, 0):
                    continue
                if len(before) == counts[name] and state.can_take(before):
                    state.take(before)
                    out[name] = before
                else:
                    reps = state.place_and_take(counts[name])
                    if reps:
                        out[name] = reps
        else:
            out = keep_or_place(order, counts, current, state)
        for name in order:  # not placeable at its count: the best count that fits
            if counts[name] and name not in out:
                for r in sorted((r for r in cost_of[name] if 0 < r < counts[name]),
                                key=lambda r: cost_of[name][r]):
                    reps = state.place_and_take(r)
                    if reps:
                        out[name] = reps
                        break
        by_name = {j.name: j for j in jobs}
        if self.spread_aware:
            for name in order:
                if name in out and name not in pinned:
                    self._unspread(by_name[name], out, state, cost_of[name], cluster)
        stuck: set[str] = set()
        while state.total_free > reserve:  # leftover GPUs: one step up where it helps most
            best, gain = None, 0.0
            for name, cost in cost_of.items():
                now_r = len(out.get(name, ()))
                up = min((r for r in cost if r > now_r), default=None)
                if (name not in pinned and name not in stuck and up is not None
                        and now_r in cost and cost[now_r] - cost[up] > gain):
                    best, gain = name, cost[now_r] - cost[up]
            if best is None:
                break
            old = out.get(best, ())
            if not self._grow(best, out, state, cost_of[best]):
                break
            if self.spread_aware and not self._worth(by_name[best], old, out[best],
                                                     cost_of[best], cluster):
                state.release(out[best])
                state.take(old)
                if old:
                    out[best] = old
                else:
                    del out[best]
                stuck.add(best)
        return out

    def _worth(self, job: JobView, old: tuple[int, ...], new: tuple[int, ...],
               cost: dict[int, float], cluster: ClusterSpec) -> bool:
        """Is ``new`` better than ``old`` once both are priced at their real node counts?"""
        gpn = cluster.gpus_per_node

        w = self._weight(job)

        def real(reps: tuple[int, ...]) -> float:
            r = len(reps)
            s = self._inverse_phi(cost[r] / w) * self._spread_ratio(job, len(set(reps)), r,
                                                                     gpn)
            return w * float(self.phi(np.array([s]))[0])

        return real(new) < (real(old) if old else cost[0])

    def _spread_ratio(self, job: JobView, nodes: int, r: int, gpn: int) -> float:
        """Goodput on ``nodes`` nodes over goodput consolidated, at ``r`` replicas (the job's
        own model prices the extra inter-node traffic; 1 without a model)."""
        least = -(-r // gpn)
        fn = job.goodput
        if fn is None or nodes <= least:
            return 1.0
        key = ("spread", fn.throughput_params, fn.gns, fn.base_batch_size, nodes, r,
               least, job.max_batch_size, job.local_bsz_bounds)
        hit = self._fresh.get(key, self._cache.get(key))
        if hit is None:
            grid = fn.optimize_grid(np.array([least, nodes]), np.array([r, r]),
                                    job.max_batch_size or fn.base_batch_size,
                                    job.local_bsz_bounds, job.gradient_accumulation)
            good = np.asarray(grid.goodput, dtype=float)
            hit = float(good[1] / good[0]) if good[0] > 0 else 1.0
        self._fresh[key] = hit
        return hit

    def _unspread(self, job: JobView, out: Allocation, state: NodeState,
                  cost: dict[int, float], cluster: ClusterSpec) -> None:
        """A job placed on more nodes than its count needs (fragmentation) is priced at its
        real node count; a smaller count that fits on fewer nodes replaces it if better."""
        gpn = cluster.gpus_per_node
        reps = out[job.name]
        r, k = len(reps), len(set(reps))
        if k <= -(-r // gpn):
            return
        # The power-mean term of the spread placement: the speedup scaled by the ratio.
        w = self._weight(job)
        s = self._inverse_phi(cost[r] / w) * self._spread_ratio(job, k, r, gpn)
        best, best_cost = reps, w * float(self.phi(np.array([s]))[0])
        state.release(reps)
        for r2 in sorted((x for x in cost if 0 < x < r), reverse=True):
            if cost[r2] >= best_cost:
                continue
            cand = state.place(r2)
            if cand and len(set(cand)) <= -(-r2 // gpn):
                best, best_cost = cand, cost[r2]
                break
        state.take(best)
        out[job.name] = best

    def _inverse_phi(self, c: float) -> float:
        """The speedup whose :meth:`phi` is ``c``."""
        p = self.fairness
        if p == 0:
            return max(math.exp(-c) - _EPS, 0.0)
        if p < 0:
            return max(c ** (1.0 / p) - _EPS, 0.0)
        return max((-c) ** (1.0 / p) - _EPS, 0.0)

    @staticmethod
    def _grow(name: str, out: Allocation, state: NodeState, cost: dict[int, float]) -> bool:
        """Re-place ``name`` at its next allowed count, if that fits."""
        old = out.get(name, ())
        target = min(r for r in cost if r > len(old))
        state.release(old)
        reps = state.place(target)
        if reps:
            state.take(reps)
            out[name] = reps
            return True
        state.take(old)
        return False

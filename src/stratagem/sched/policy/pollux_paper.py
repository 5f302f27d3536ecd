"""Pollux's own scheduling search, as its paper describes it (Qiao et al., OSDI 2021, sec. 4.2).

The baseline the goodput-aware policy (``pollux``) is measured against, on the same
information. Each decision is a genetic search over allocation matrices ``A`` (jobs x nodes,
``A[j, n]`` = job ``j``'s GPUs on node ``n``):

* **Fitness**: the power mean ``(mean_j SPEEDUP_j(A_j)^p)^(1/p)`` (``p`` = ``fairness``,
  -1 as in the paper). ``SPEEDUP_j`` is the job's best goodput (its own goodput model, batch
  size and accumulation optimised per allocation) on ``A_j``'s (nodes, replicas) divided by
  its goodput at a fair share, ``ceil(GPUs / jobs)`` replicas packed; a job without a model
  yet has linear speedup ``r / fair``.
* **Restart penalty**: a running job whose row of ``A`` changes has its speedup scaled by
  ``max(age - restarts * delay, 0) / (age + delay)``.
* **Interference**: two multi-node jobs may not share a node (repaired away); if the cluster
  allows it, each such job's speedup is scaled by ``1 - interference`` instead.
* **Node-count limit**: a job spans at most ``ceil(replicas / GPUs per node) +
  extra_nodes`` nodes (fewer nodes than that are always allowed).
* **Search**: the population starts from the current allocation and mutations of it; every
  generation, binary tournaments pick parents, children take each job's row from either
  parent (uniform crossover), cells mutate (to 0 or to a random GPU count), a repair step
  restores every constraint (node capacity, per-job replica limits, the node-count limit,
  interference, non-preemptible jobs pinned), and the best ``population`` of parents and
  children survive (elitism).

The paper's search (100 candidates) is slow in Python; ``population`` and ``generations``
bound its time (defaults 40 and 40; the benchmark records what it used). Vectorised numpy
over the whole population; deterministic for a given ``seed``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from stratagem.sched.policy.base import Allocation, ClusterSpec, JobView

_EPS = 1e-3  # added to speedups so the power mean stays finite at 0 replicas


@dataclass
class PolluxPaperPolicy:
    """``fairness``: power-mean ``p``; ``restart_delay``: seconds a restart costs;
    ``population``/``generations``: the genetic search's size; ``mutation``: expected
    mutated cells per job row; ``extra_nodes``: node-count slack; ``interference``: speedup
    lost by a multi-node job sharing a node (only where the cluster allows sharing)."""

    fairness: float = -1.0
    restart_delay: float = 30.0
    population: int = 40
    generations: int = 40
    mutation: float = 0.5
    extra_nodes: int = 1
    interference: float = 0.25
    seed: int = 0
    name: str = "pollux-paper"
    adaptive_batch: bool = True
    _cache: dict = field(default_factory=dict, repr=False)
    _fresh: dict = field(default_factory=dict, repr=False)
    _rng: np.random.Generator | None = field(default=None, repr=False)

    # -- speedup tables --------------------------------------------------------------------
    def table(self, job: JobView, max_r: int, fair: int, cluster: ClusterSpec) -> np.ndarray:
        """Speedup by (nodes, replicas): shape (nodes + 1, max_r + 1); invalid cells 0."""
        nodes, gpn = cluster.num_nodes, cluster.gpus_per_node
        out = np.zeros((nodes + 1, max_r + 1))
        n_idx, r_idx = np.meshgrid(np.arange(1, nodes + 1), np.arange(1, max_r + 1),
                                   indexing="ij")
        ok = (n_idx <= r_idx) & (r_idx <= n_idx * gpn)
        if job.goodput is None:
            out[1:, 1:] = np.where(ok, r_idx / max(fair, 1), 0.0)
            return out
        fn = job.goodput
        key = (fn.throughput_params, fn.gns, fn.base_batch_size, max_r, fair, nodes,
               gpn, job.max_batch_size, job.local_bsz_bounds, job.gradient_accumulation)
        hit = self._fresh.get(key)
        if hit is None:
            hit = self._cache.get(key)
        if hit is not None:
            self._fresh[key] = hit
            return hit
        n_v, r_v = n_idx[ok], r_idx[ok]
        n_all = np.concatenate([n_v, [math.ceil(fair / gpn)]])
        r_all = np.concatenate([r_v, [fair]])
        grid = fn.optimize_grid(n_all, r_all, job.max_batch_size or fn.base_batch_size,
                                job.local_bsz_bounds, job.gradient_accumulation)
        good = np.asarray(grid.goodput, dtype=float)
        base = good[-1] if good[-1] > 0 else float(good.max(initial=0.0))
        out[n_v, r_v] = good[:-1] / base if base > 0 else r_v / max(fair, 1)
        self._fresh[key] = out
        return out

    # -- decision --------------------------------------------------------------------------
    def allocate(self, jobs: Sequence[JobView], cluster: ClusterSpec,
                 current: Mapping[str, tuple[int, ...]], now: float) -> Allocation:
        if not jobs:
            return {}
        if self._rng is None:
            self._rng = np.random.default_rng(self.seed)
        # Tables are keyed by the model, not the job: jobs with the same model share one;
        # kept: those the last decision used.
        self._cache, self._fresh = self._fresh, {}
        nodes, gpn, gpus = cluster.num_nodes, cluster.gpus_per_node, cluster.total_gpus
        fair = max(1, math.ceil(gpus / len(jobs)))
        n_jobs = len(jobs)
        max_r = np.array([max(min(j.max_replicas, gpus), 0) for j in jobs])
        min_r = np.array([max(j.min_replicas, 1) for j in jobs])
        width = int(max_r.max(initial=0))
        tables = np.zeros((n_jobs, nodes + 1, width + 1))
        for i, job in enumerate(jobs):
            t = self.table(job, int(max_r[i]), min(fair, max(int(max_r[i]), 1)), cluster)
            tables[i, :, : t.shape[1]] = t
        cur = np.zeros((n_jobs, nodes), dtype=np.int64)
        for i, job in enumerate(jobs):
            for n in current.get(job.name, ()):
                cur[i, n] += 1
        running = cur.sum(1) > 0
        pinned = np.array([not j.preemptible for j in jobs]) & running
        d = self.restart_delay
        restart = np.array([max(j.age - j.num_restarts * d, 0.0) / (j.age + d) if d > 0
                            else 1.0 for j in jobs])
        ctx = _Ctx(tables, cur, running, pinned, restart, max_r, min_r, gpn, cluster)

        rng = self._rng
        pop = np.repeat(cur[None], max(self.population, 2), axis=0)
        pop[1:] = self._mutate(pop[1:], rng, gpn)
        pop = self._repair(pop, ctx, rng)
        fit = self._fitness(pop, ctx)
        size = pop.shape[0]
        for _ in range(self.generations):
            a = self._tournament(fit, size, rng)
            b = self._tournament(fit, size, rng)
            take_a = rng.random((size, n_jobs, 1)) < 0.5
            children = np.where(take_a, pop[a], pop[b])
            children = self._repair(self._mutate(children, rng, gpn), ctx, rng)
            both = np.concatenate([pop, children])
            both_fit = np.concatenate([fit, self._fitness(children, ctx)])
            keep = np.argsort(-both_fit, kind="stable")[:size]
            pop, fit = both[keep], both_fit[keep]
        best = pop[int(np.argmax(fit))]
        out: Allocation = {}
        for i, job in enumerate(jobs):
            reps = tuple(n for n in range(nodes) for _ in range(int(best[i, n])))
            if reps:
                out[job.name] = reps
        return out

    @staticmethod
    def _tournament(fit: np.ndarray, size: int, rng: np.random.Generator) -> np.ndarray:
        i, j = rng.integers(0, fit.size, size), rng.integers(0, fit.size, size)
        return np.where(fit[i] >= fit[j], i, j)

    def _mutate(self, pop: np.ndarray, rng: np.random.Generator, gpn: int) -> np.ndarray:
        p, n_jobs, nodes = pop.shape
        hit = rng.random(pop.shape) < self.mutation / nodes
        value = np.where(rng.random(pop.shape) < 0.5, 0, rng.integers(1, gpn + 1, pop.shape))
        return np.where(hit, value, pop)

    def _repair(self, pop: np.ndarray, c: _Ctx, rng: np.random.Generator) -> np.ndarray:
        """Every constraint, by dropping replicas (never adding), pinned jobs first.

        Each rule draws its random order for the whole population (so the random stream,
        and the result for a seed, do not depend on which candidates break it) but is
        applied only to the rows or candidates that break it: on the others it would
        change nothing.
        """
        p, n_jobs, nodes = pop.shape
        pop = np.clip(pop, 0, c.gpn)
        if c.pinned.any():
            pop = np.where(c.pinned[None, :, None], c.cur[None], pop)
        # replica cap per job: keep a prefix in a random node order
        keys = rng.random(pop.shape)
        over = pop.sum(2) > c.max_r[None]
        if over.any():
            rows = pop[over]
            order = np.argsort(keys[over], axis=1)
            lines = np.arange(rows.shape[0])[:, None]
            shuffled = rows[lines, order]
            before = np.cumsum(shuffled, axis=1) - shuffled
            rows[lines, order] = np.clip(c.max_r[over.nonzero()[1]][:, None] - before, 0,
                                         shuffled)
            pop[over] = rows
        # node capacity: keep a prefix in a random job order, pinned jobs first
        jorder = np.argsort(rng.random((p, n_jobs)) - c.pinned[None] * 2.0, axis=1)
        full = (pop.sum(1) > c.gpn).any(1)
        if full.any():
            pop[full] = self._prefix_jobs(pop[full], jorder[full],
                                          lambda x, before: np.clip(c.gpn - before, 0, x))
        if not c.cluster.share_distributed:  # one multi-node job per node
            dist = ((pop > 0).sum(2) > 1)[:, :, None] & (pop > 0)
            clash = (dist.sum(1) > 1).any(1)
            if clash.any():
                jo = jorder[clash]
                lines = np.arange(jo.shape[0])[:, None]
                dist_sorted = dist[clash][lines, jo]
                seen = np.cumsum(dist_sorted, axis=1, dtype=np.int64) - dist_sorted
                drop = np.empty_like(dist_sorted)
                drop[lines, jo] = dist_sorted & (seen > 0)
                pop[clash] = np.where(drop, 0, pop[clash])
        # node-count limit: keep the job's fullest nodes, until its count allows the rest
        noise = rng.random(pop.shape)
        for _ in range(nodes):
            total, used = pop.sum(2), (pop > 0).sum(2)
            limit = -(-total // c.gpn) + self.extra_nodes
            over = (used > limit) & ~c.pinned[None]
            if not over.any():
                break
            rows = pop[over]
            rank = np.argsort(np.argsort(-(rows + noise[over]), axis=1), axis=1)
            pop[over] = np.where(rank < limit[over][:, None], rows, 0)
        total = pop.sum(2)
        too_few = (total > 0) & (total < c.min_r[None]) & ~c.pinned[None]
        return np.where(too_few[:, :, None], 0, pop)

    @staticmethod
    def _prefix_jobs(pop: np.ndarray, jorder: np.ndarray, cap) -> np.ndarray:
        lines = np.arange(pop.shape[0])[:, None]
        shuffled = pop[lines, jorder]
        before = np.cumsum(shuffled, axis=1) - shuffled
        out = np.empty_like(pop)
        out[lines, jorder] = cap(shuffled, before)
        return out

    def _fitness(self, pop: np.ndarray, c: _Ctx) -> np.ndarray:
        replicas = pop.sum(2)
        used = (pop > 0).sum(2)
        jobs = np.arange(pop.shape[1])[None, :]
        s = c.tables[jobs, used, np.minimum(replicas, c.tables.shape[2] - 1)]
        changed = (pop != c.cur[None]).any(2) & c.running[None]
        s = np.where(changed, s * c.restart[None], s)
        if c.cluster.share_distributed and self.interference > 0:
            dist = (used > 1)[:, :, None] & (pop > 0)
            shared = ((dist.sum(1) > 1)[:, None, :] & dist).any(2)
            s = np.where(shared, s * (1 - self.interference), s)
        p = self.fairness
        if p == 0:
            return np.exp(np.mean(np.log(s + _EPS), axis=1))
        return np.mean((s + _EPS) ** p, axis=1) ** (1.0 / p)


@dataclass(frozen=True)
class _Ctx:
    tables: np.ndarray
    cur: np.ndarray
    running: np.ndarray
    pinned: np.ndarray
    restart: np.ndarray
    max_r: np.ndarray
    min_r: np.ndarray
    gpn: int
    cluster: ClusterSpec

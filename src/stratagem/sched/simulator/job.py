"""One simulated job: its progress, its batch size, what it costs to move it.

Progress is scale-invariant (iterations at the application's base batch, as the profiles
measure it): a step at batch ``M`` advances it by the AdaScale gain ``r(M)`` of the epoch's
gradient statistics, and takes the profile's (interpolated) step time. A job finishes when
its progress reaches the end of its last epoch. Every new allocation, the first included,
costs ``restart_delay`` seconds of holding GPUs without progress (checkpoint, restart,
restore). Adaptive jobs choose their batch size and accumulation as Stratagem's adaptive
jobs do (:func:`stratagem.adapt.choose_with_hysteresis` on their goodput model) whenever
they start on an allocation and after every epoch; the others keep the submitted batch.

What a job knows about its own speed (its throughput model) is, by default, *learned*: every
configuration (nodes, replicas, local batch, accumulation) it runs is timed into a
:class:`~stratagem.adapt.StepProfiler` (the adaptive training loop's own profiler, whose
``fit`` is :func:`~stratagem.adapt.fit_throughput`), and the model is whatever that fit says
now, with the fit's priors for regimes not yet seen. A job that has not run yet has no model:
it starts at its submitted batch, and policies see ``goodput=None`` (linear speedup). With
``oracle=True`` every job knows the model fitted on the application's whole profile from the
start (the ablation). Gradient statistics are the profile's at the job's current epoch.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from stratagem.adapt import (
    BatchChoice,
    GoodputFunction,
    ProfileRecord,
    StepProfiler,
    ThroughputParams,
    choose_with_hysteresis,
    fit_throughput,
)
from stratagem.sched.policy.base import JobView
from stratagem.sched.simulator.profile import AppProfile
from stratagem.sched.simulator.workload import JobSpec

_FITS: dict[tuple, ThroughputParams] = {}
_MAX_FITS = 200_000


def fit_memoized(app: str, records: list[ProfileRecord]) -> ThroughputParams | None:
    """:func:`fit_throughput` on ``records``, remembered across jobs and simulations.

    A pure function of its input, so two jobs of one application that ran the same
    configurations (at the same speed) get the same model without fitting twice; the
    simulator's cost is dominated by these fits otherwise.
    """
    if not records:
        return None
    key = (app, tuple(sorted((r.num_nodes, r.num_replicas, r.local_bsz, r.accum_steps,
                              r.step_time, r.compute_time or 0.0) for r in records)))
    hit = _FITS.get(key)
    if hit is None:
        if len(_FITS) >= _MAX_FITS:
            _FITS.clear()
        hit = _FITS[key] = fit_throughput(records)
    return hit


def counts_per_node(replicas: tuple[int, ...]) -> tuple[int, ...]:
    """Node indices per replica -> GPUs per node, in node order."""
    c = Counter(replicas)
    return tuple(c[n] for n in sorted(c))


def spread(replicas: int, nodes: int) -> tuple[int, ...]:
    """``replicas`` over ``nodes`` as evenly as possible."""
    base, extra = divmod(replicas, nodes)
    return (base + 1,) * extra + (base,) * (nodes - extra)


@dataclass
class JobRecord:
    """Per-job outcome (a row of the per-job CSV)."""

    name: str
    application: str
    submit_time: float
    start_time: float | None
    completion_time: float | None
    jct: float | None
    num_restarts: int
    gpu_seconds: float
    epochs: int
    final_batch_size: int


class SimJob:
    """State and dynamics of one job (see the module doc)."""

    def __init__(self, spec: JobSpec, app: AppProfile, *, adaptive: bool,
                 restart_delay: float, total_gpus: int, slowdown: float = 1.0,
                 oracle: bool = True) -> None:
        self.spec, self.app, self.adaptive = spec, app, adaptive
        self.oracle = bool(oracle)
        # Timings of the configurations run so far; refits on every new configuration.
        self.profiler = StepProfiler(window=4, warmup=0)
        self._fit_version, self._params = 0, None
        self.restart_delay = float(restart_delay)
        self.slowdown = float(slowdown)
        self.total_gpus = total_gpus
        self.progress = 0.0
        self.epoch = 0  # epochs completed
        self.replicas: tuple[int, ...] = ()
        self.local_bsz = 0
        self.accum_steps = 0
        self.choice: BatchChoice | None = None
        self.restart_left = 0.0
        self.gpu_seconds = 0.0
        self.num_restarts = -1  # the first start is not a restart
        self.start_time: float | None = None
        self.completion_time: float | None = None
        self.max_replicas_seen = 0
        self.last_batch = app.base_batch_size

    # -- what the job knows about itself ---------------------------------------------------
    @property
    def done(self) -> bool:
        return self.completion_time is not None

    @property
    def batch_size(self) -> int:
        return len(self.replicas) * self.local_bsz * (self.accum_steps + 1)

    def throughput_params(self) -> ThroughputParams | None:
        """The throughput model the job has now: the oracle's, or fitted on its own timings
        (None before it has run)."""
        if self.oracle:
            return self.app.throughput_params
        if self._fit_version != self.profiler.num_configs:
            self._fit_version = self.profiler.num_configs
            self._params = fit_memoized(self.app.name, self.profiler.records())
        return self._params

    def goodput_function(self) -> GoodputFunction | None:
        """Its goodput model: its throughput model and the gradient noise it measures now
        (at the batch it last ran with); None while it has no throughput model."""
        params = self.throughput_params()
        if params is None:
            return None
        app = self.app
        return GoodputFunction(params, app.gns(self.last_batch, self.epoch),
                               app.base_batch_size)

    def max_replicas(self) -> int:
        app = self.app
        batch = app.max_batch_size if self.adaptive else self.spec.batch_size
        return max(1, min(self.total_gpus, batch // max(app.min_local_bsz, 1)))

    def view(self, now: float, explore_cap: bool = False) -> JobView:
        app = self.app
        max_r = uncapped = self.max_replicas()
        if explore_cap and self.adaptive:
            max_r = min(max_r, max(1, 2 * self.max_replicas_seen))
        return JobView(
            name=self.spec.name, submit_time=self.spec.submit_time,
            age=now - self.spec.submit_time, attained_service=self.gpu_seconds,
            num_restarts=max(self.num_restarts, 0), min_replicas=1, max_replicas=max_r,
            requested_replicas=min(self.spec.num_replicas, self.total_gpus),
            goodput=self.goodput_function() if self.adaptive else None,
            max_batch_size=app.max_batch_size,
            local_bsz_bounds=(app.min_local_bsz, app.max_local_bsz),
            gradient_accumulation=True, remaining_time=self.remaining_time,
            uncapped_max_replicas=uncapped if max_r < uncapped else None)

    def remaining_time(self, num_nodes: int, num_replicas: int) -> float:
        """Oracle: seconds to finish on a consolidated allocation at the submitted batch
        (exact remaining progress; the current epoch's statistical efficiency)."""
        placement = spread(num_replicas, max(1, min(num_nodes, num_replicas)))
        local, accum = self._fixed_config(num_replicas)
        rate = self._rate(placement, local, accum)
        return (self.app.total_progress - self.progress) / rate

    # -- configuration ---------------------------------------------------------------------
    def _fixed_config(self, replicas: int) -> tuple[int, int]:
        app = self.app
        local = math.ceil(self.spec.batch_size / replicas)
        accum = max(math.ceil(local / app.max_local_bsz) - 1, 0)
        return max(math.ceil(local / (accum + 1)), 1), accum

    def _configure(self) -> None:
        nodes, replicas = len(set(self.replicas)), len(self.replicas)
        fn = self.goodput_function() if self.adaptive else None
        if fn is None:  # fixed batch, or adaptive but nothing measured yet: as submitted
            self.local_bsz, self.accum_steps = self._fixed_config(replicas)
            self.choice = None
        else:
            app = self.app
            self.choice = choose_with_hysteresis(
                fn, self.choice, nodes, replicas, app.max_batch_size,
                (app.min_local_bsz, app.max_local_bsz), gradient_accumulation=True)
            self.local_bsz, self.accum_steps = self.choice.local_bsz, self.choice.accum_steps
        self.last_batch = self.batch_size

    def allocate(self, replicas: tuple[int, ...], now: float) -> None:
        """Move to ``replicas`` (node index per replica; empty: preempted)."""
        replicas = tuple(sorted(replicas))
        if replicas == self.replicas:
            return
        self.replicas = replicas
        if not replicas:
            self.restart_left = 0.0
            return
        self.num_restarts += 1
        if self.start_time is None:
            self.start_time = now
        self.max_replicas_seen = max(self.max_replicas_seen, len(replicas))
        self.restart_left = self.restart_delay
        self._configure()

    # -- dynamics --------------------------------------------------------------------------
    def _rate(self, placement: tuple[int, ...], local: int, accum: int) -> float:
        """Scale-invariant progress per second."""
        app = self.app
        batch = sum(placement) * local * (accum + 1)
        step, _ = app.step_time(placement, local, accum)
        gain = app.gns(batch, self.epoch).gain(batch, app.base_batch_size)
        return float(gain) / (step * self.slowdown)

    def _time_step(self, placement: tuple[int, ...]) -> None:
        """What the job's step profiler measures while it runs its current configuration."""
        if self.oracle:
            return
        step, sync = self.app.step_time(placement, self.local_bsz, self.accum_steps)
        self.profiler.record(len(placement), sum(placement), self.local_bsz, self.accum_steps,
                             step * self.slowdown, sync * self.slowdown)

    def advance(self, now: float, seconds: float) -> None:
        """Run from ``now`` for ``seconds`` on the current allocation."""
        if not self.replicas or self.done:
            return
        width = len(self.replicas)
        delay = min(self.restart_left, seconds)
        self.restart_left -= delay
        self.gpu_seconds += delay * width
        t, left = now + delay, seconds - delay
        placement = counts_per_node(self.replicas)
        while left > 1e-9 and not self.done:
            self._time_step(placement)
            rate = self._rate(placement, self.local_bsz, self.accum_steps)
            need = (self.app.epoch_ends[self.epoch] - self.progress) / rate
            if need > left:
                self.progress += rate * left
                self.gpu_seconds += left * width
                return
            self.progress = float(self.app.epoch_ends[self.epoch])
            self.epoch += 1
            t += need
            left -= need
            self.gpu_seconds += need * width
            if self.epoch >= self.app.epochs:
                self.completion_time = t
            elif self.adaptive:
                self._configure()

    def record(self) -> JobRecord:
        s = self.spec
        jct = None if self.completion_time is None else self.completion_time - s.submit_time
        return JobRecord(s.name, s.application, s.submit_time, self.start_time,
                         self.completion_time, jct, max(self.num_restarts, 0),
                         self.gpu_seconds, self.epoch, self.last_batch)

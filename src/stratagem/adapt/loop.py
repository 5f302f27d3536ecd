"""The adaptive training loop: what ``AutoDist.distribute`` attaches to a model, optimizer
and data loader so that batch size, accumulation and learning rate adapt while training.

:class:`AdaptiveTrainer` is the loader's ``hooks`` (see :class:`stratagem.data.LoaderHooks`)
and wraps ``optimizer.step``/``zero_grad`` (the script keeps calling them as usual):

* every optimizer step runs with the scaling rule's LR factors (the user's LR is restored
  right after it) and credits its gain to a :class:`ProgressTracker`;
* with accumulation the loader hands out micro-batches; non-final ones run under
  ``model.no_sync()`` and ``hold_exit()``, and ``step()``/``zero_grad()`` called for them do
  nothing (AdaptDL semantics), so the script needs no change;
* step times go to a :class:`StepProfiler`, gradient norms to a :class:`GradStats`;
* every few steps (and when a loader iteration starts: epochs, restarts) rank 0 refits the
  throughput model, picks the goodput-optimal configuration with hysteresis and broadcasts
  it; the loader switches from the next global batch on;
* rank 0 records every step (:mod:`stratagem.adapt.step_metrics`: the metrics file and
  the progress display), prints one summary line per epoch for adaptive jobs and publishes
  scheduling hints.

Everything adaptive is job state (``adapt``, JSON), so a checkpoint-restart keeps it.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from stratagem.adapt.autoscale import Autoscaler, BatchConfig
from stratagem.adapt.goodput import BatchChoice, GoodputFunction
from stratagem.adapt.gradient_stats import GradStats
from stratagem.adapt.hints import SCHEMA_VERSION, HintsPublisher
from stratagem.adapt.noise_scale import GradientNoiseScale
from stratagem.adapt.progress import ProgressTracker
from stratagem.adapt.progress_report import EpochReport, to_tensorboard
from stratagem.adapt.scaling_rules import (
    AdamScale,
    AdaScale,
    LinearScale,
    ScalingRule,
    SqrtScale,
    default_rule_for,
    scaled_lr,
)
from stratagem.adapt.step_metrics import StepRecorder, finite
from stratagem.adapt.step_profiler import StepProfiler
from stratagem.data import DistributedDataLoader, GlobalBatch, split_evenly
from stratagem.elastic import (
    MembershipChange,
    ObjectState,
    current_job,
    hold_exit,
    load_state,
    unique_name,
)
from stratagem.errors import StratagemError
from stratagem.observe import ProgressFields

MIN_INTERVAL = 10  # steps between batch-size decisions, at least
MAX_INTERVAL = 1000
DECISION_BUDGET = 0.02  # decisions may take this fraction of the training time
STATS_BUDGET = 0.01  # gradient statistics may take this fraction of the step time
MAX_STATS_EVERY = 32
_CACHEABLE = (AdaScale, AdamScale, LinearScale, SqrtScale)


@dataclass
class StepClock:
    """Timing of the step in progress: a step runs from the end of the previous one (its
    data loading included) to its optimizer step; communication wait is subtracted."""

    started: float | None = None  # when the step being timed began
    wait_at_start: float = 0.0  # the model's cumulative comm wait then
    last_end: float | None = None  # end of the previous step of this loader iteration


@dataclass
class EpochTally:
    """What the epoch so far did, for its report line."""

    started: float | None = None
    steps: int = 0
    samples: int = 0
    before: int = 0  # steps of the epoch done before this process resumed it


@dataclass(frozen=True)
class TrainerConfig:
    """Settings of the adaptive loop (``ad.distribute(model, opt, adaptive=...)``).

    ``decision_interval``: steps between batch-size decisions (None: adaptive, so that
    fitting and deciding take at most 2% of the time, at least every 10 steps);
    ``smoothing``: the noise estimate's EMA factor per base batch of samples;
    ``precond_every``: steps between refreshes of the Adam preconditioner used for the
    gradient statistics.
    """

    decision_interval: int | None = None
    smoothing: float = 0.999
    precond_every: int = 10

    def __post_init__(self) -> None:
        if self.decision_interval is not None and self.decision_interval < 1:
            raise StratagemError(f"decision_interval must be >= 1, got "
                                 f"{self.decision_interval}", where="TrainerConfig",
                                 fix="use None for the adaptive interval, or a step count")
        if not 0.0 < self.smoothing < 1.0:
            raise StratagemError(f"smoothing must be in (0, 1), got {self.smoothing}",
                                 where="TrainerConfig", fix="e.g. 0.999 (the default)")
        if self.precond_every < 1:
            raise StratagemError(f"precond_every must be >= 1, got {self.precond_every}",
                                 where="TrainerConfig", fix="e.g. 10 (the default)")


class AdaptiveTrainer:
    """Adaptive batch size and learning rate for one model and optimizer (module doc).

    ``scaling_rule``: default by optimizer type (:func:`default_rule_for`); ``config``: the
    loop's settings (:class:`TrainerConfig`).
    """

    def __init__(self, model: Any, optimizer: torch.optim.Optimizer, *,
                 scaling_rule: ScalingRule | None = None, rank: int = 0, world_size: int = 1,
                 num_nodes: int = 1, log: Callable[[str], None] | None = None,
                 config: TrainerConfig | None = None,
                 hints: HintsPublisher | None = None,
                 recorder: StepRecorder | None = None) -> None:
        config = config if config is not None else TrainerConfig()
        self.config = config
        self.model = model
        self.optimizer = optimizer
        self.rule = scaling_rule if scaling_rule is not None else default_rule_for(optimizer)
        # The rule scales the LR once autoscaling is on, or always when given explicitly; a
        # batch size the script sets by hand otherwise keeps the script's LR.
        self.explicit_rule = scaling_rule is not None
        self.preconditioned = isinstance(default_rule_for(optimizer), AdamScale)
        self.rank, self.world_size, self.num_nodes = rank, world_size, num_nodes
        self.log = log or (lambda message: None)
        self.decision_interval = config.decision_interval
        self.smoothing = config.smoothing
        self.precond_every = config.precond_every
        self._hints = hints
        self.recorder = recorder if rank == 0 else None  # per-step metrics and progress
        self._comm_seen: dict[str, float] = {}
        self.profiler = StepProfiler()
        self.loader: DistributedDataLoader | None = None
        self.base_batch_size: int | None = None
        self.gns: GradientNoiseScale | None = None
        self.tracker: ProgressTracker | None = None
        self.stats: GradStats | None = None
        self.autoscaler: Autoscaler | None = None
        self.collect_stats = False  # force gradient statistics without autoscaling
        self.stats_flush_every = 16  # steps whose statistics are summed in one all-reduce
        self.stats_every = 1  # steps per statistics sample (set by the decisions)
        self.max_stats_every = MAX_STATS_EVERY
        self.steps = 0
        self.next_decision = 0
        self.last_decision_step = -1
        self.decision_seconds = 0.0
        self._decision_cost = 0.02  # smoothed seconds per decision (fits included)
        self.choice: BatchChoice | None = None
        self.lr_factor = 1.0
        self.gain = 1.0
        self.last_report: EpochReport | None = None
        self._decided = False  # in this process
        self._micro: GlobalBatch | None = None
        self._made_step = True
        self._clock = StepClock()
        self._collecting = False
        self._epoch = EpochTally()
        self._epoch_steps: int | None = None  # optimizer steps in this epoch, when planned
        self._plan_seen: Any = None
        self._pending_state: dict[str, Any] | None = None
        self._factor_key: tuple[float, int] | None = None
        self._factor_value: tuple[np.ndarray, float] = (np.ones(1), 1.0)
        self._wrap_optimizer()
        self._state: ObjectState | None = None
        current_job().add_participant(self)  # follows in-process rescales
        if self.explicit_rule:
            self._register_state()

    def _register_state(self) -> None:
        """Make the adaptive state part of the job state (restored now if checkpointed).
        Only adaptive jobs (autoscaling or an explicit rule) register it, so plain jobs'
        checkpoints do not change."""
        if self._state is None:
            self._state = ObjectState(unique_name("adapt"), self.state_dict,
                                      self.load_state_dict, format="json")
            load_state(self._state)

    # -- optimizer wrapping ---------------------------------------------------------------
    def _wrap_optimizer(self) -> None:
        opt = self.optimizer
        step, zero_grad = opt.step, opt.zero_grad
        trainer = self

        @functools.wraps(step)
        def adaptive_step(_opt: Any, *args: Any, **kwargs: Any) -> Any:
            return trainer._step(step, *args, **kwargs)

        @functools.wraps(zero_grad)
        def adaptive_zero_grad(_opt: Any, *args: Any, **kwargs: Any) -> Any:
            if not trainer._made_step:
                return None  # gradients of earlier micro-batches are still accumulating
            return zero_grad(*args, **kwargs)

        opt.step = types.MethodType(adaptive_step, opt)  # type: ignore[method-assign]
        opt.zero_grad = types.MethodType(adaptive_zero_grad, opt)  # type: ignore[method-assign]

    def _step(self, step: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        info = self._micro
        if info is not None and not info.final:
            self._made_step = False  # an accumulation micro-step: nothing to apply yet
            return None
        self._made_step = True
        if self.tracker is None or self.base_batch_size is None:
            return step(*args, **kwargs)
        size = info.size if info is not None else self.loader.batch_size
        scale = size / self.base_batch_size
        collecting = info is not None and self._collecting
        if collecting:
            self.stats.before_step(self._replica_sizes(size), info.micros)
        if self.autoscaler is None and not self.explicit_rule:
            scale = 1.0  # the script's own LR at any batch size
        factors, gain = self._factors(scale)
        if np.all(factors == 1.0):
            loss = step(*args, **kwargs)
        else:
            with scaled_lr(self.optimizer, factors):
                loss = step(*args, **kwargs)
        if info is None or size == self.loader.batch_size:  # not an epoch's short last batch
            self.lr_factor, self.gain = float(np.mean(factors)), gain
        self.tracker.update(gain, size)
        if info is not None:
            if self.stats is not None:
                self.stats.after_step(collecting)
            self._profile(info)
        self.steps += 1
        self._epoch.steps += 1
        self._epoch.samples += size
        if self.autoscaler is not None and self.steps >= self.next_decision:
            self._decide()
        if self.recorder is not None:
            self._record(size)
        return loss

    @property
    def current_batch(self) -> GlobalBatch | None:
        """The (micro-)batch in hand while the loop body runs (``.final``: its optimizer
        step applies the update), None between batches."""
        return self._micro

    @property
    def adaptive(self) -> bool:
        """Whether batch size and LR adapt (autoscaling on), so adaptive fields mean
        something."""
        return self.autoscaler is not None

    def _comm_delta(self) -> dict[str, float]:
        """This rank's communication since the last step, by synchronizer kind."""
        stats = getattr(self.model, "comm_stats", None)
        if stats is None:
            return {}
        now = {"allreduce_bytes": float(stats.wire_bytes), "ps_push_bytes":
               float(stats.push_bytes), "ps_pull_bytes": float(stats.pull_bytes),
               "comm_wait_s": float(stats.wait_seconds)}
        seen = self._comm_seen
        # Counters restart when the model is rebuilt (rescale): count from zero then.
        delta = {k: v - seen.get(k, 0.0) if v >= seen.get(k, 0.0) else v
                 for k, v in now.items()}
        self._comm_seen = now
        return delta

    def _record(self, size: int) -> None:
        """Rank 0: this step's metrics record and progress line."""
        record: dict[str, Any] = {
            "step": self.steps,
            "epoch": self.loader.epoch if self.loader is not None else 0,
            "batch_size": size, "replicas": self.world_size, "lr_factor": self.lr_factor,
            "adaptive": self.adaptive, **self._comm_delta()}
        if self.gns is not None and self.gns.ready:
            record["noise_scale"] = finite(self.gns.noise_scale)
        if self.adaptive:
            config = self.current_config()
            record.update(local_bsz=config.local_bsz, accum_steps=config.accum_steps,
                          gain=self.gain)
            if self.gns is not None and self.gns.ready:  # statistical efficiency at this size
                record["efficiency"] = finite(float(self.gns.efficiency(size)))
            if self.choice is not None:
                record["predicted_goodput"] = finite(self.choice.goodput)
        self.recorder.step(record, size)
        self.recorder.show(self._progress_fields())

    def _progress_fields(self) -> ProgressFields:
        tally = self._epoch
        elapsed = time.perf_counter() - tally.started if tally.started else 0.0
        adaptive = self.adaptive
        config = self.current_config() if adaptive else None
        return ProgressFields(
            # (``is not None``: an exhausted loader has length 0, hence is falsy)
            epoch=self.loader.epoch if self.loader is not None else 0,
            step=tally.before + tally.steps,
            steps=self._epoch_steps,
            samples_per_s=tally.samples / elapsed if elapsed > 0 else None,
            loss=self.recorder.loss if self.recorder is not None else None,
            batch_size=config.global_bsz if config else None,
            replicas=self.world_size if adaptive else None,
            local_bsz=config.local_bsz if config else None,
            efficiency=(float(self.gns.efficiency(config.global_bsz))
                        if config and self.gns is not None and self.gns.ready else None))

    def log_metrics(self, **values: Any) -> None:
        """The script's own values for the current step (rank 0's are recorded)."""
        if self.recorder is not None:
            self.recorder.log(values)
            if self.loader is not None and self._epoch.started is not None:
                self.recorder.show(self._progress_fields())

    def _factors(self, scale: float) -> tuple[np.ndarray, float]:
        """LR factors and gain at ``scale``; cached while the statistics are unchanged
        (for the built-in rules that do not depend on progress)."""
        key = (scale, self.gns.updates if self.gns is not None else -1)
        if key == self._factor_key and type(self.rule) in _CACHEABLE:
            return self._factor_value
        factors = self.rule.lr_factors(scale, self.gns, self.tracker.progress,
                                       len(self.optimizer.param_groups))
        self._factor_key = key
        self._factor_value = (factors, self.rule.gain(scale, self.gns))
        return self._factor_value

    def _replica_sizes(self, size: int) -> list[int]:
        return [n for _, n in split_evenly(size, self.world_size)]

    def _profile(self, info: GlobalBatch) -> None:
        clock = self._clock
        if clock.started is None or info.size != self.loader.batch_size:
            return  # not timed, or the epoch's last (smaller) batch
        elapsed = time.perf_counter() - clock.started
        wait = self._comm_wait() - clock.wait_at_start
        local = -(-info.size // (self.world_size * info.micros))
        self.profiler.record(self.num_nodes, self.world_size, local, info.micros - 1,
                             elapsed, wait)
        clock.started = None
        clock.last_end = time.perf_counter()
        clock.wait_at_start = self._comm_wait()

    def _comm_wait(self) -> float:
        stats = getattr(self.model, "comm_stats", None)
        return float(stats.wait_seconds) if stats is not None else 0.0

    # -- loader hooks ---------------------------------------------------------------------
    def attach(self, loader: DistributedDataLoader) -> None:
        """Make ``loader`` the training loader (its base batch is the LR's reference)."""
        if self.loader is loader:
            return
        self.loader = loader
        if self.base_batch_size == loader.base_batch_size:
            return
        base = loader.base_batch_size
        self.base_batch_size = base
        self.gns = GradientNoiseScale(base, self.smoothing, len(self.optimizer.param_groups),
                                      preconditioned=self.preconditioned)
        self.tracker = ProgressTracker(base)
        self._renew_stats()
        if self._pending_state is not None:
            self._apply_state(self._pending_state)
            self._pending_state = None

    def _renew_stats(self) -> None:
        """Fresh gradient statistics for the current model, noise estimate and world."""
        if self.stats is not None:
            self.stats.close()
        self.stats = GradStats(self.model, self.optimizer, self.gns, world_size=self.world_size,
                               precond_every=self.precond_every,
                               flush_every=self.stats_flush_every)

    def before_membership_change(self) -> None:
        """In the old group, before an in-process rescale: apply the queued gradient
        statistics (collective)."""
        if self.stats is not None:
            self.stats.flush()

    def on_membership_change(self, change: MembershipChange) -> None:
        """An in-process rescale happened (after AutoDist re-bound the model, which
        registered first): follow it (:meth:`on_rescale`)."""
        self.on_rescale(change.rank, change.world_size)

    def on_rescale(self, rank: int, world_size: int) -> None:
        """Follow an in-process rescale (:mod:`stratagem.elastic.rescale`), after the model
        was re-bound to the new group: take the new rank and world size, restart the
        gradient statistics (they depend on the replica count and observe the new
        synchronizers), and decide the batch configuration again at the next loader start
        (a collective that every member then reaches together). The noise estimate,
        progress and throughput profile are kept."""
        self.rank, self.world_size = int(rank), int(world_size)
        self._decided = False
        if self.stats is not None:
            self._renew_stats()

    def use_preconditioner(self, on: bool) -> None:
        """Whether the gradient statistics are Adam-preconditioned (default: with an
        Adam-like optimizer). AdaptDL preconditions only under an explicit ``AdamScale``
        rule; its drop-in says so here."""
        if self.preconditioned == bool(on):
            return
        self.preconditioned = bool(on)
        if self.gns is not None:
            self.gns = GradientNoiseScale(self.base_batch_size, self.smoothing,
                                          len(self.optimizer.param_groups),
                                          preconditioned=self.preconditioned)
            self._renew_stats()

    def measure_every_step(self) -> None:
        """Gradient statistics from every step, applied after it, with the Adam
        preconditioner refreshed every step, with or without autoscaling (AdaptDL's
        sampling, for its drop-in: ``model.gns`` then follows AdaptDL's step by step).
        Costs one small all-reduce per step; Stratagem's default samples so that the
        statistics take at most ``STATS_BUDGET`` of the step time and sums them in one
        all-reduce every ``stats_flush_every`` steps."""
        self.collect_stats = True
        self.max_stats_every = self.stats_every = 1
        self.stats_flush_every = self.precond_every = 1
        if self.stats is not None:
            self.stats.flush_every = self.stats.precond_every = 1

    @property
    def needs_gradient_statistics(self) -> bool:
        """Whether the loop reads the gradient noise scale (batch size autoscaling, or
        ``collect_stats``): from all-reduced gradients only, so Auto then keeps to
        all-reduce strategies."""
        return self.autoscaler is not None or self.collect_stats

    def enable_autoscale(self, loader: DistributedDataLoader) -> None:
        """Called by ``loader.autoscale_batch_size``: decide for ``loader`` from now on."""
        hidden = getattr(self.model, "server_parameters", [])
        if hidden and self.world_size > 1:
            self.log(f"adaptive batch size: {len(hidden)} parameter(s) on parameter servers "
                     f"({', '.join(hidden[:3])}{', ...' if len(hidden) > 3 else ''}) are "
                     "left out of the gradient noise scale (their gradients stay with their "
                     "owners); an all-reduce strategy measures every parameter")
        self.attach(loader)
        self._register_state()
        self.autoscaler = Autoscaler(loader.base_batch_size, int(loader.max_batch_size),
                                     tuple(loader.local_bsz_bounds),
                                     bool(loader.gradient_accumulation))

    def start(self, loader: DistributedDataLoader) -> None:
        if self.loader is None:
            self.attach(loader)
        if loader is not self.loader:
            return
        self._clock.last_end = None  # (re)planned: the first step's loading is not typical
        if self._epoch.started is None:
            self._epoch = EpochTally(started=time.perf_counter())
        if self.recorder is not None:
            self.recorder.begin_epoch()
        # Decide when a loader iteration starts (epochs, restarts) if this process has not
        # decided yet or a decision is due; otherwise the interval keeps its budget.
        if self.autoscaler is not None and (not self._decided
                                            or self.steps >= self.next_decision):
            self._decide()

    @contextlib.contextmanager
    def scope(self, loader: DistributedDataLoader, info: GlobalBatch) -> Iterator[None]:
        if loader is not self.loader:
            yield
            return
        if info.micro == 0:
            plan = getattr(loader.sampler, "batches", None)
            if plan is not None and plan is not self._plan_seen:  # (re)planned epoch
                self._plan_seen = plan
                if self._epoch.steps == 0 and plan and plan[0].start > 0:
                    # Resumed mid-epoch: the samples before the offset took this many steps
                    # (exact at a fixed batch size; at the current one when it adapted).
                    self._epoch.before = -(-plan[0].start // plan[0].size)
                self._epoch_steps = (self._epoch.before + self._epoch.steps
                                     + sum(1 for b in plan if b.final))
            # A step runs from the end of the previous one (loading its data included).
            clock = self._clock
            clock.started = (clock.last_end if clock.last_end is not None
                             else time.perf_counter())
            if clock.last_end is None:
                clock.wait_at_start = self._comm_wait()
            wanted = self.autoscaler is not None or self.collect_stats or (
                self.explicit_rule and loader.batch_size != self.base_batch_size)
            # Statistics on every stats_every-th step (pairs of steps for the consecutive
            # estimator of a lone replica); the same steps on every rank.
            phase = self.steps % self.stats_every
            pairwise = self.world_size == 1 and info.micros == 1
            self._collecting = wanted and (phase == 0 or (pairwise and phase == 1))
            self.stats.begin_step(self._collecting)
        with contextlib.ExitStack() as stack:
            if not info.final:
                if hasattr(self.model, "no_sync"):
                    stack.enter_context(self.model.no_sync())
                stack.enter_context(hold_exit())
            self._micro = info
            try:
                yield
            finally:
                self._micro = None
        if not info.final:
            if info.micro == 0:
                self.stats.first_micro()
            self._rescale_accumulated(len(info.indices), info.next_local)

    @torch.no_grad()
    def _rescale_accumulated(self, this: int, following: int) -> None:
        """Keep the accumulated gradient exact when micro-batches differ in size.

        Invariant: before micro-batch ``k`` the ``.grad`` holds ``sum_{j<k} n_j g_j / n_k``
        (``g_j`` each micro-batch's mean gradient, ``n_j`` its local samples), so after the
        last one the runtime's ``grad_weight = n_last * replicas / global`` gives the mean
        over the whole global batch."""
        if following <= 0 or following == this:
            return
        held = getattr(self.model, "accumulated_gradients", None)  # (stage 3: unsharded)
        grads = (held() if held is not None
                 else [p.grad for p in self.model.parameters() if p.grad is not None])
        if grads:
            torch._foreach_mul_(grads, this / following)

    def end(self, loader: DistributedDataLoader) -> None:
        if loader is not self.loader:
            return
        if self.stats is not None:
            self.stats.flush()
        report = self.report()
        if self.recorder is not None and report is not None:
            self.recorder.show(self._progress_fields(), end_of_epoch=True)
            self.recorder.flush()
        self._epoch.started = None
        if report is None:
            return
        self.last_report = report
        if self.rank == 0:
            if self.adaptive:
                self.log(report.line())
            self.publish()

    # -- decisions ------------------------------------------------------------------------
    def current_config(self) -> BatchConfig:
        loader = self.loader
        return BatchConfig.of(loader.batch_size, self.world_size, loader.accum_steps)

    def _stats_every(self) -> int:
        """Steps per gradient-statistics sample, so that they cost at most STATS_BUDGET of
        the step time (1 where they are cheap, e.g. asynchronous on a GPU)."""
        step = self.profiler.median_step_time()
        cost = self.stats.seconds_per_step if self.stats is not None else 0.0
        if not step or cost <= 0:
            return self.stats_every
        return int(min(max(math.ceil(cost / (STATS_BUDGET * step)), 1), self.max_stats_every))

    def _interval(self) -> int:
        if self.decision_interval is not None:
            return max(int(self.decision_interval), 1)
        step = self.profiler.median_step_time()
        cost = max(self._decision_cost, 1e-4)
        if not step or self.choice is None:  # nothing fitted yet: look again soon
            return MIN_INTERVAL
        return int(min(max(math.ceil(cost / (DECISION_BUDGET * step)), MIN_INTERVAL),
                       MAX_INTERVAL))

    def _decide(self) -> None:
        """Collective: rank 0 chooses the configuration, every rank applies it."""
        t0 = time.perf_counter()
        if self.stats is not None:
            self.stats.flush()
        current = self.current_config()
        payload = torch.zeros(4, dtype=torch.int64)
        if self.rank == 0:
            params = self.profiler.fit()
            config, self.choice = self.autoscaler.decide(
                params, self.gns, self.num_nodes, self.world_size, current)
            payload[:] = torch.tensor([config.global_bsz, config.accum_steps, self._interval(),
                                       self._stats_every()])
        if self.world_size > 1 and dist.is_available() and dist.is_initialized():
            dist.broadcast(payload, src=0, group=current_job().control_group())
        global_bsz, accum, interval, self.stats_every = (int(v) for v in payload.tolist())
        loader = self.loader
        if (global_bsz, accum) != (loader.batch_size, loader.accum_steps):
            if self.rank == 0:
                new = BatchConfig.of(global_bsz, self.world_size, accum)
                self.log(f"batch size {current.global_bsz} -> {global_bsz} "
                         f"({self.world_size} x {new.local_bsz}"
                         + (f" x {accum + 1} accum" if accum else "") + ")"
                         + self._predicted(self.choice))
            loader.batch_size = global_bsz
            loader.accum_steps = accum
        self.next_decision = self.steps + interval
        self.last_decision_step = self.steps
        self._decided = True
        if self.rank == 0 and self.choice is not None:
            self.publish()
        self.decision_seconds = time.perf_counter() - t0
        self._decision_cost = 0.7 * self._decision_cost + 0.3 * self.decision_seconds

    @staticmethod
    def _predicted(choice: BatchChoice | None) -> str:
        if choice is None:
            return ""
        return (f", predicted goodput {choice.goodput:.4g}/s, efficiency "
                f"{choice.efficiency:.2f}")

    # -- reporting ------------------------------------------------------------------------
    def goodput_function(self, refit: bool = False) -> GoodputFunction | None:
        """Goodput under the last fitted throughput model (``refit``: fit now)."""
        params = self.profiler.fit() if refit else self.profiler.latest()
        if params is None or self.gns is None or not self.gns.ready:
            return None
        return GoodputFunction(params, self.gns, self.base_batch_size)

    def report(self) -> EpochReport | None:
        """The current configuration and how the epoch so far went (None before a step)."""
        tally = self._epoch
        if self.loader is None or self.tracker is None or not tally.steps:
            return None
        config = self.current_config()
        elapsed = time.perf_counter() - tally.started if tally.started else 0.0
        fn = self.goodput_function() if self.rank == 0 else None
        now = fn.describe(self.num_nodes, self.world_size, config.local_bsz,
                          config.accum_steps) if fn is not None else None
        return EpochReport(
            epoch=self.loader.epoch, steps=tally.steps, global_bsz=config.global_bsz,
            num_replicas=self.world_size, local_bsz=config.local_bsz,
            accum_steps=config.accum_steps, lr_factor=self.lr_factor, gain=self.gain,
            throughput=tally.samples / elapsed if elapsed > 0 else None,
            goodput=now.goodput if now else None, efficiency=now.efficiency if now else None,
            noise_scale=self.gns.noise_scale if self.gns is not None else None,
            progress=self.tracker.progress, adaptive=self.adaptive)

    def to_tensorboard(self, loader: DistributedDataLoader, writer: Any, global_step: int,
                       tag_prefix: str = "") -> None:
        if self.rank != 0:
            return
        report = self.last_report or self.report()
        if report is not None:
            to_tensorboard(writer, report, global_step, tag_prefix)

    @property
    def hints(self) -> HintsPublisher:
        if self._hints is None:
            self._hints = HintsPublisher(enabled=self.rank == 0)
        return self._hints

    def hints_document(self) -> dict[str, Any]:
        """The scheduling hints (schema: docs/reference/hints.md); the throughput model is
        the one of the last decision (fitting is kept off the per-epoch path)."""
        params = self.profiler.latest()
        gns = self.gns
        scaler = self.autoscaler
        config = self.current_config() if self.loader is not None else None
        fn = self.goodput_function()
        now = (fn.describe(self.num_nodes, self.world_size, config.local_bsz,
                           config.accum_steps) if fn is not None and config else None)
        return {
            "version": SCHEMA_VERSION,
            "time": time.time(),
            "allocation": {"num_nodes": self.num_nodes, "num_replicas": self.world_size},
            "batch": {
                "base_batch_size": self.base_batch_size,
                "max_batch_size": scaler.max_batch_size if scaler else self.base_batch_size,
                "local_bsz_bounds": list(scaler.local_bsz_bounds) if scaler else [None, None],
                "gradient_accumulation": bool(scaler and scaler.gradient_accumulation),
                "autoscale": scaler is not None,
                "current": config.to_dict() if config else None,
            },
            "throughput_params": params.to_dict() if params is not None else None,
            "gradient": None if gns is None or not gns.ready else {
                "sqr_norm": gns.sqr_norm, "var": gns.var, "noise_scale": gns.noise_scale,
                "preconditioned": gns.preconditioned, "updates": gns.updates,
                "biased": gns.biased},
            "goodput": now.to_dict() if now else None,
            "scaling_rule": type(self.rule).__name__,
            "lr_factor": self.lr_factor,
            "gain": self.gain,
            "progress": self.tracker.state_dict() if self.tracker else None,
            "epoch": self.loader.epoch if self.loader is not None else None,
            "profile": self.profiler.summary(),
        }

    def publish(self) -> None:
        """Publish the hints now (rank 0; file and/or HTTP, see :mod:`.hints`)."""
        if self.rank == 0:
            self.hints.publish(self.hints_document())

    # -- state ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "version": 1, "steps": self.steps, "next_decision": self.next_decision,
            "last_decision_step": self.last_decision_step,
            "base_batch_size": self.base_batch_size,
            "gns": self.gns.state_dict() if self.gns is not None else None,
            "tracker": self.tracker.state_dict() if self.tracker is not None else None,
            "profile": self.profiler.state_dict(),
            "config": self.current_config().to_dict() if self.loader is not None else None,
            "num_replicas": self.world_size, "num_nodes": self.num_nodes,
            "scaling_rule": type(self.rule).__name__,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = int(state["steps"])
        self.next_decision = int(state["next_decision"])
        self.last_decision_step = int(state["last_decision_step"])
        self.profiler.load_state_dict(state["profile"])
        if self.base_batch_size is None:
            self._pending_state = dict(state)
        else:
            self._apply_state(state)

    def _apply_state(self, state: dict[str, Any]) -> None:
        if state.get("base_batch_size") != self.base_batch_size:
            return  # statistics relative to another base batch: start afresh
        if state.get("gns") is not None:
            self.gns.load_state_dict(state["gns"])
        if state.get("tracker") is not None:
            self.tracker.load_state_dict(state["tracker"])

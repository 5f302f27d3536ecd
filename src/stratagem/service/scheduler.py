"""The scheduler service loop: read jobs and hints, ask a policy, apply the allocation on Ray.

Every ``interval`` seconds :meth:`Scheduler.step`:

1. stops jobs whose deletion was requested;
2. polls running jobs: all replicas exited 0 -> succeeded; a replica exited otherwise -> the
   job crashed: its other replicas are stopped, and it is retried after a back-off that
   doubles with every crash (``backoff``, ``2 * backoff``, ...) until ``max_failures``
   crashes, then marked failed; a lost actor or node (preemption) restarts it without
   counting as a crash;
3. asks the policy for an allocation of the pending and running jobs (their goodput models
   from the hints they publish), and applies the changes. A job whose replica count changes
   is resized *in-process* where that applies (:attr:`JobSpec.in_process_rescale` and an
   allocation formed for it, on one machine): a shrink lets the leavers leave at the next
   step boundary while the rest keep training, a grow starts replicas that join at one.
   Otherwise (or when the new replicas do not fit on the job's machine) it is stopped with
   SIGTERM (it checkpoints at its next exit point) and started again at the new size,
   resuming from the checkpoint. Shrinks and stops go first, so that their resources are
   free for the grows and starts. An unchanged job is left alone.

Starts run in the background (threads, at most ``MAX_STARTS`` at once): placing a job's
bundles, starting its actors' worker processes and its replicas can take a minute on a
loaded cluster, and the loop must not stall meanwhile. A job being started is ``starting``:
the policy counts its replicas as taken and leaves them alone, and the other jobs are
polled, resized and started as usual. The step that decides a start waits for it at most
``interval`` seconds; a start that takes longer is picked up by a later step. A start that
fails (or times out, after ``start_timeout`` per phase) has been cleaned up by the backend;
the job backs off (``backoff``, doubling with each failed start in a row, at most ``32 *
backoff``) with an event that says why, and is started again after it. A failed start does
not count as a crash. A ``starting`` job that a new scheduler finds (the old one died
mid-start) has whatever its start had created stopped, and is started again.

All state lives in the :class:`~.store.Store` (SQLite), so a new scheduler on the same
directory carries on: running jobs keep running (their Ray actors are detached and named).
Every per-job action is guarded: one job's failure never stops another or the loop.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for_futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stratagem import env as sg_env
from stratagem.errors import StratagemError
from stratagem.sched.policy import ClusterSpec, JobView, make_policy
from stratagem.service import store as st
from stratagem.service.autoscale import AutoscaleOptions, request_nodes, target_nodes
from stratagem.service.hints_reader import JobHints, read_hints
from stratagem.service.jobfile import JobSpec
from stratagem.service.ray_backend import LOST, Launched, planned_names

log = logging.getLogger("stratagem.service")


@dataclass(frozen=True)
class SchedulerOptions:
    """``policy``: a name of ``stratagem.sched.policy`` (``fairness`` and ``restart_delay``
    go to pollux); ``interval``: seconds between decisions; ``max_failures``: crashes before
    a job is failed; ``backoff``: seconds before the first retry (doubling); ``grace``:
    seconds a stopped replica has to checkpoint; ``start_timeout``: seconds each phase of a
    start may take (placement, actors, processes; the start runs in the background, so a long
    one delays no other job); ``gpu_resource``: the Ray resource that
    counts as an accelerator (a custom one for fake GPUs); ``min_runtime``: seconds a job
    keeps the replicas it was just given (started, restarted or resized) before the policy
    may change them again (deletions and drains still apply), so that jobs that tie for
    the accelerators do not take turns every interval."""

    policy: str = "pollux"
    interval: float = 5.0
    fairness: float = -1.0
    restart_delay: float = 30.0
    max_failures: int = 3
    backoff: float = 10.0
    grace: float = 30.0
    start_timeout: float = 60.0
    gpu_resource: str = "GPU"
    autoscale: AutoscaleOptions | None = None
    min_runtime: float = 60.0


def job_dirs(directory: Path, spec: JobSpec) -> tuple[Path, Path]:
    """(checkpoint dir, log dir) of a job in the cluster directory."""
    base = directory / "jobs" / spec.name
    return (Path(spec.checkpoint_dir) if spec.checkpoint_dir else base / "ckpt"), base / "logs"


MAX_STARTS = 8  # starts in flight at once (each mostly waits on Ray)


@dataclass(frozen=True)
class _Starting:
    """A start in flight: its launch (in a thread), the replicas the policy gave the job, the
    decision time and the replica count before (0: a first start)."""

    future: Future[Launched]
    replicas: tuple[int, ...]
    decided: float
    old: int


def job_env(spec: JobSpec, ckpt: Path) -> dict[str, str]:
    """The environment of a job's replicas (besides torch.distributed's)."""
    env = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **dict(spec.env),
           sg_env.CHECKPOINT_DIR: str(ckpt), sg_env.JOB_ID: spec.name}
    if spec.strategy != "auto":
        env[sg_env.STRATEGY] = spec.strategy
    return env


class Scheduler:
    """Shares a Ray cluster among the jobs in ``directory``'s store (see the module doc)."""

    def __init__(self, directory: str | Path, options: SchedulerOptions = SchedulerOptions(),
                 backend: Any = None) -> None:
        from stratagem.service.ray_backend import RayBackend

        self.directory = Path(directory)
        self.options = options
        self.store = st.Store(self.directory)
        extra = ({"fairness": options.fairness, "restart_delay": options.restart_delay}
                 if options.policy == "pollux" else {})
        self.policy = make_policy(options.policy, **extra)
        self.backend = backend or RayBackend(options.gpu_resource, options.start_timeout,
                                             options.grace)
        self._last = time.time()
        self.decisions: list[tuple[float, dict[str, int]]] = []
        # (decision time, job, old count, new count, "start" | "in-process" | "restart")
        self.resizes: list[tuple[float, str, int, int, str]] = []
        self.draining: set[str] = set()
        self._lock = threading.RLock()  # step() and drain() come from different threads
        self.autoscale_target: int | None = None
        self.hint_problems: dict[str, str] = {}  # job -> why its hints.json is unusable
        self._starts: dict[str, _Starting] = {}  # job -> its start in flight
        self._start_failures: dict[str, int] = {}  # job -> failed starts in a row
        self._pool = ThreadPoolExecutor(MAX_STARTS, thread_name_prefix="stratagem-start")

    # -- the loop --------------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        """Step every ``interval`` seconds until ``stop`` is set; errors are logged. Before
        it returns, the starts in flight finish and are recorded (each is bounded by the
        backend's timeouts), so that a scheduler taking over finds no start half-done."""
        while not stop.is_set():
            try:
                self.step()
            except Exception:  # the loop survives anything one step raises
                log.exception("scheduler step failed")
            stop.wait(self.options.interval)
        self.finish_starts()

    def step(self, now: float | None = None) -> dict[str, int]:
        """One round (module doc); the replica count given to each active job. The starts it
        decides run in the background; it waits for them at most ``interval`` seconds."""
        now = time.time() if now is None else now
        with self._lock:
            counts = self._step(now)
            new = [s.future for s in self._starts.values() if s.decided == now]
        if new:  # outside the lock: drain() and the control plane are not held up
            wait_for_futures(new, timeout=self.options.interval)
            with self._lock:
                self._collect_starts(now)
        return counts

    def finish_starts(self, timeout: float | None = None) -> None:
        """Wait for the starts in flight (at most ``timeout`` s) and record their outcome."""
        with self._lock:
            pending = [s.future for s in self._starts.values()]
        wait_for_futures(pending, timeout=timeout)
        with self._lock:
            self._collect_starts(time.time())

    def starting(self) -> list[str]:
        """The jobs whose start is in flight."""
        with self._lock:
            return list(self._starts)

    def _step(self, now: float) -> dict[str, int]:
        self._collect_starts(now)
        allocs = self.store.allocations()
        jobs = self.store.jobs(include_final=False)
        dt, self._last = max(now - self._last, 0.0), now
        for job in jobs:
            try:
                self._check(job, allocs.get(job.name), now, dt)
            except Exception as exc:  # never let one job stop the others
                log.exception("job %s", job.name)
                self.store.update(job.name, f"scheduler error: {exc}")
        for job in self.store.jobs(include_final=False):
            if job.state == st.BACKOFF and job.retry_at <= now:
                self.store.update(job.name, "retrying", state=st.PENDING)
        return self._allocate(now)

    # -- 1 and 2: deletions and exits ------------------------------------------------------
    def _launched(self, alloc: st.AllocationRow) -> Launched:
        return Launched(alloc.group_name or "", alloc.actors)

    def _check(self, job: st.JobRow, alloc: st.AllocationRow | None, now: float,
               dt: float) -> None:
        if job.name in self._starts:  # its start decides (a deletion waits for it)
            return
        if job.state == st.STARTING:  # a start that an earlier scheduler left unfinished
            self._abandon_start(job)
            return
        if job.state == st.STOPPING:
            if alloc is not None:
                self.backend.stop(self._launched(alloc))
                self.store.set_allocation(job.name, (), None, ())
            self.store.update(job.name, "deleted", state=st.DELETED, finished=now)
            return
        if job.state != st.RUNNING:
            return
        if alloc is None:  # running without workers (an interrupted start): start again
            self.store.update(job.name, "no workers found; rescheduling", state=st.PENDING)
            return
        self.store.update(job.name, service=job.service + dt * len(alloc.replicas))
        codes = self.backend.poll(self._launched(alloc))
        if all(c == 0 for c in codes):
            self.backend.stop(self._launched(alloc), grace=0.0)
            self.store.set_allocation(job.name, (), None, ())
            self.store.update(job.name, "succeeded", state=st.SUCCEEDED, finished=now)
            return
        bad = [c for c in codes if c not in (None, 0)]
        if not bad:
            return
        self.backend.stop(self._launched(alloc))
        self.store.set_allocation(job.name, (), None, ())
        if all(c == LOST for c in bad):
            self.store.update(job.name, "workers lost (node gone); restarting from the "
                              "checkpoint", state=st.PENDING, restarts=job.restarts + 1)
            return
        failures = job.failures + 1
        codes_text = ", ".join(str(c) for c in codes)
        if failures >= self.options.max_failures:
            self.store.update(job.name, f"crashed (exit {codes_text}); failed after "
                              f"{failures} crashes", state=st.FAILED, failures=failures,
                              finished=now, message=f"exit {codes_text}")
            return
        wait = self.options.backoff * 2 ** (failures - 1)
        self.store.update(job.name, f"crashed (exit {codes_text}); retry in {wait:.0f} s",
                          state=st.BACKOFF, failures=failures, retry_at=now + wait,
                          message=f"exit {codes_text}")

    # -- 3: the policy ---------------------------------------------------------------------
    def cluster(self) -> ClusterSpec | None:
        nodes = self.backend.nodes(frozenset(self.draining))
        if not nodes:
            return None
        return ClusterSpec(num_nodes=len(nodes), gpus_per_node=int(min(a for _, a in nodes)))

    def drain(self, node_id: str) -> list[str]:
        """A preemption notice for ``node_id``: stop the jobs on it (each checkpoints on
        SIGTERM) and place nothing there again; the jobs resume elsewhere. Their names."""
        with self._lock:
            return self._drain(node_id)

    def undrain(self, node_id: str) -> None:
        """Use ``node_id`` again (the notice was withdrawn, or the node was replaced)."""
        with self._lock:
            self.draining.discard(node_id)

    def _drain(self, node_id: str) -> list[str]:
        self.draining.add(node_id)
        moved = []
        for name, alloc in self.store.allocations().items():
            try:
                if node_id in self.backend.actor_nodes(self._launched(alloc)):
                    self._stop_for_change(self.store.job(name), 0, "node drained")
                    moved.append(name)
            except Exception:  # the others still get drained
                log.exception("draining %s", name)
        return moved

    def _autoscale(self, views: list[JobView], cluster: ClusterSpec) -> None:
        opts = self.options.autoscale
        if opts is None:
            return
        n = target_nodes(views, cluster.gpus_per_node, opts)
        if n != self.autoscale_target:
            request_nodes(n, {self.options.gpu_resource: float(cluster.gpus_per_node)})
            self.autoscale_target = n

    def hints(self, job: st.JobRow) -> JobHints | None:
        """An adaptive job's hints (None otherwise). An unusable hints file gives empty
        hints: the job is scheduled without a goodput model, and an event (once per
        distinct problem) says why, so one job's bad file never stops the others."""
        if not job.spec.adaptive:
            return None
        hints = read_hints(job_dirs(self.directory, job.spec)[0])
        if hints.problem != self.hint_problems.get(job.name):
            if hints.problem:
                log.warning("job %s: %s", job.name, hints.problem)
                self.store.update(job.name, f"{hints.problem}; scheduling without hints")
                self.hint_problems[job.name] = hints.problem
            else:
                self.store.update(job.name, "hints.json is usable again")
                self.hint_problems.pop(job.name, None)
        return hints

    def view(self, job: st.JobRow, now: float,
             alloc: st.AllocationRow | None = None) -> JobView:
        """What the policy sees of ``job``; one whose allocation (``alloc``) is younger than
        ``min_runtime``, or whose start is in flight, is shown as not preemptible: it keeps
        its replicas this round."""
        spec = job.spec
        held = ((alloc is not None and now - alloc.time < self.options.min_runtime)
                or job.name in self._starts)
        try:
            hints = self.hints(job)
        except Exception:  # e.g. the store busy: this round without hints
            log.exception("hints of %s", job.name)
            hints = None
        return JobView(
            name=spec.name, submit_time=job.submitted, age=max(now - job.submitted, 0.0),
            attained_service=job.service, num_restarts=job.restarts,
            min_replicas=spec.min_replicas, max_replicas=spec.max_replicas,
            preemptible=spec.preemptible and not held, requested_replicas=spec.max_replicas,
            goodput=hints.goodput if hints else None,
            max_batch_size=hints.max_batch_size if hints else None,
            local_bsz_bounds=hints.local_bsz_bounds if hints else (None, None),
            gradient_accumulation=hints.gradient_accumulation if hints else True)

    def _allocate(self, now: float) -> dict[str, int]:
        cluster = self.cluster()
        active = [j for j in self.store.jobs(include_final=False)
                  if j.state in (st.PENDING, st.RUNNING) or j.name in self._starts]
        if not active:
            return {}
        allocs = self.store.allocations()
        views = [self.view(j, now, allocs.get(j.name)) for j in active]
        if cluster is None:  # no accelerators yet: only the autoscaler can help
            if self.options.autoscale is not None:
                self._autoscale(views, ClusterSpec(0, self.options.autoscale.node_gpus))
            return {}
        # a job being started holds the replicas it is being started on
        current = {**{n: a.replicas for n, a in allocs.items()},
                   **{n: s.replicas for n, s in self._starts.items()}}
        self._autoscale(views, cluster)
        target = self.policy.allocate(views, cluster, current, now)
        counts = {j.name: len(current[j.name] if j.name in self._starts
                              else target.get(j.name, ())) for j in active}
        changed = [j for j in active if j.name not in self._starts
                   and counts[j.name] != len(current.get(j.name, ()))]
        if changed:  # (time, new count of each job it changed)
            self.decisions.append((now, {j.name: counts[j.name] for j in changed}))
        grows = []
        for job in changed:  # shrinks and stops first: their resources are then free
            old, new = len(current.get(job.name, ())), counts[job.name]
            if old and new and new < old and self._resize(job, tuple(target[job.name]), now):
                continue
            if old and new > old and job.spec.in_process_rescale:
                grows.append(job)
                continue
            if old:
                self._stop_for_change(job, new)
            if new:
                grows.append(job)
        for job in grows:
            alloc = self.store.allocations().get(job.name)
            if alloc is not None and self._resize(job, tuple(target[job.name]), now):
                continue
            if alloc is not None:  # in-process did not apply: checkpoint-restart
                self._stop_for_change(job, counts[job.name])
            self._start(self.store.job(job.name), tuple(target[job.name]), now,
                        len(current.get(job.name, ())))
        return counts

    def _resize(self, job: st.JobRow, replicas: tuple[int, ...], now: float) -> bool:
        """Resize ``job``'s allocation in-process; False when that does not apply."""
        alloc = self.store.allocations()[job.name]
        if not job.spec.in_process_rescale:
            return False
        ckpt, logs = job_dirs(self.directory, job.spec)
        try:
            done = self.backend.resize(job.spec, self._launched(alloc), len(replicas),
                                       job_env(job.spec, ckpt), logs,
                                       exclude=frozenset(self.draining))
        except Exception:  # e.g. a replica gone meanwhile: checkpoint-restart instead
            log.exception("in-process resize of %s", job.name)
            return False
        if done is None:
            return False
        self.store.set_allocation(job.name, replicas, done.group_name, done.actors, now)
        self.store.update(job.name, f"rescaling: {len(alloc.replicas)} -> {len(replicas)} "
                          "replicas (in-process)")
        self.resizes.append((now, job.name, len(alloc.replicas), len(replicas), "in-process"))
        return True

    def _stop_for_change(self, job: st.JobRow, new: int, why: str = "rescaling") -> None:
        alloc = self.store.allocations()[job.name]
        try:
            self.backend.stop(self._launched(alloc))
        finally:
            self.store.set_allocation(job.name, (), None, ())
            self.store.update(job.name, f"{why}: {len(alloc.replicas)} -> {new} replicas "
                              "(checkpoint-restart)", state=st.PENDING,
                              restarts=job.restarts + 1)

    def _start(self, job: st.JobRow, replicas: tuple[int, ...], now: float,
               old: int = 0) -> None:
        """Start ``job`` on ``replicas`` in the background (module doc)."""
        spec = job.spec
        ckpt, logs = job_dirs(self.directory, spec)
        generation = len(self.store.allocation_history(spec.name))
        self.store.update(spec.name, f"starting {len(replicas)} replicas", state=st.STARTING)
        future = self._pool.submit(self.backend.launch, spec, len(replicas), generation,
                                   job_env(spec, ckpt), logs,
                                   exclude=frozenset(self.draining),
                                   in_process=spec.in_process_rescale)
        self._starts[spec.name] = _Starting(future, replicas, now, old)

    def _collect_starts(self, now: float) -> None:
        """Record every start that ended: running, or backing off after a failed start."""
        for name, start in list(self._starts.items()):
            if not start.future.done():
                continue
            del self._starts[name]
            try:
                self._started(name, start, now)
            except Exception as exc:  # e.g. the store busy: the job is checked again later
                log.exception("recording the start of %s", name)
                self.store.update(name, f"scheduler error: {exc}")

    def _started(self, name: str, start: _Starting, now: float) -> None:
        job = self.store.job(name)
        exc = start.future.exception()
        if exc is not None:
            why = exc.problem if isinstance(exc, StratagemError) else f"{exc!r}"
            log.warning("job %s: start failed: %s", name, why)
            if job.state != st.STARTING:  # deleted meanwhile: the next check finishes that
                self.store.update(name, f"start failed: {why}")
                return
            failed = self._start_failures.get(name, 0) + 1
            self._start_failures[name] = failed
            wait = self.options.backoff * min(2 ** (failed - 1), 32)
            self.store.update(name, f"start failed: {why}; retry in {wait:.0f} s",
                              state=st.BACKOFF, retry_at=now + wait)
            return
        launched = start.future.result()
        self._start_failures.pop(name, None)
        count = len(start.replicas)
        self.resizes.append((start.decided, name, start.old, count,
                             "restart" if start.old else "start"))
        # given when the step that decided it found it started, else when a later one did
        self.store.set_allocation(name, start.replicas, launched.group_name, launched.actors,
                                  start.decided if now == start.decided else now)
        if job.state != st.STARTING:  # deleted meanwhile: the next check stops it
            return
        self.store.update(name, f"started with {count} replicas", state=st.RUNNING,
                          started=job.started or start.decided)
        if self.draining and self.backend.actor_nodes(launched) & self.draining:
            self._stop_for_change(self.store.job(name), 0, "node drained")

    def _abandon_start(self, job: st.JobRow) -> None:
        """Stop what an interrupted start of ``job`` created; the job is started again."""
        generation = len(self.store.allocation_history(job.name))
        try:
            self.backend.stop(planned_names(job.name, generation, job.spec.max_replicas),
                              grace=0.0)
        finally:
            self.store.update(job.name, "start interrupted (the scheduler restarted); "
                              "starting again", state=st.PENDING)


def status_table(rows: list[st.JobRow], allocations: Mapping[str, st.AllocationRow],
                 directory: Path) -> str:
    """``stratagem ls``: job, state, replicas, batch, goodput, progress; <= 80 columns.
    Hints are read for unfinished jobs only; an unusable hints file adds a warning line."""
    warnings = []
    lines = [f"{'JOB':<20} {'STATE':<10} {'REPLICAS':>8} {'BATCH':>7} {'GOODPUT':>9} "
             f"{'PROGRESS':>9} {'RESTARTS':>8}"]
    for job in rows:
        alloc = allocations.get(job.name)
        hints = (JobHints() if job.state in st.FINAL
                 else read_hints(job_dirs(directory, job.spec)[0]))
        if hints.problem:
            warnings.append(f"warning: {job.name}: {hints.problem}")
        reps = f"{len(alloc.replicas) if alloc else 0}/{job.spec.max_replicas}"
        bsz = "-" if hints.global_bsz is None else str(hints.global_bsz)
        good = "-" if hints.goodput_now is None else f"{hints.goodput_now:.4g}"
        prog = "-" if hints.progress is None else f"{hints.progress:.4g}"
        name = job.name if len(job.name) <= 20 else job.name[:19] + "~"
        lines.append(f"{name:<20} {job.state:<10} {reps:>8} {bsz:>7} {good:>9} {prog:>9} "
                     f"{job.restarts:>8}")
    lines += [w if len(w) <= 80 else w[:77] + "..." for w in warnings]
    return "\n".join(lines)

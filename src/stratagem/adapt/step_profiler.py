"""Step-time profile of a running job, the input of the throughput model.

The training loop records, per optimizer step, the configuration (nodes, replicas, micro-batch
per replica, accumulation steps), the step's wall time and the part of it spent waiting for
gradient synchronisation. :class:`StepProfiler` keeps a bounded window of recent timings per
configuration and reduces each to one :class:`~stratagem.adapt.throughput.ProfileRecord`
(medians: robust to a GC pause or a slow data batch) for :func:`fit_throughput`. Fitting is
cached until new timings arrive, so calling :meth:`StepProfiler.fit` at every decision costs
nothing when nothing changed.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping
from typing import Any

import numpy as np

from stratagem.adapt.throughput import ProfileRecord, ThroughputParams, fit_throughput

ConfigKey = tuple[int, int, int, int]  # (num_nodes, num_replicas, local_bsz, accum_steps)


class StepProfiler:
    """Recent step timings per configuration and the throughput model fitted to them.

    ``window``: timings kept per configuration; ``warmup``: steps ignored after switching to a
    configuration (allocator growth, lazy initialisation, re-planned prefetching);
    ``refit_after``: new timings of known configurations that make :meth:`fit` refit.
    """

    def __init__(self, window: int = 32, warmup: int = 1, refit_after: int = 64) -> None:
        self.window = int(window)
        self.warmup = int(warmup)
        self.refit_after = int(refit_after)
        self._steps: dict[ConfigKey, deque[float]] = {}
        self._compute: dict[ConfigKey, deque[float]] = {}
        self._counts: dict[ConfigKey, int] = {}
        self._current: ConfigKey | None = None
        self._skip = 0
        self._version = 0
        self._fitted: tuple[int, ThroughputParams | None] = (-1, None)
        self._fitted_configs = 0
        self.fit_seconds = 0.0  # duration of the last actual fit

    def record(self, num_nodes: int, num_replicas: int, local_bsz: int, accum_steps: int,
               step_time: float, sync_time: float | None = None) -> bool:
        """Add one step; returns whether it was kept (not warm-up, finite and positive).

        ``sync_time``: seconds of the step spent blocked on gradient synchronisation; the rest,
        per micro-batch, is recorded as compute time.
        """
        key = (int(num_nodes), int(num_replicas), int(local_bsz), int(accum_steps))
        if key != self._current:
            self._current, self._skip = key, self.warmup
        if self._skip > 0:
            self._skip -= 1
            return False
        if not (np.isfinite(step_time) and step_time > 0):
            return False
        self._steps.setdefault(key, deque(maxlen=self.window)).append(float(step_time))
        if sync_time is not None and np.isfinite(sync_time):
            compute = (step_time - max(sync_time, 0.0)) / (accum_steps + 1)
            if compute > 0:
                self._compute.setdefault(key, deque(maxlen=self.window)).append(compute)
        self._counts[key] = self._counts.get(key, 0) + 1
        self._version += 1
        return True

    def records(self) -> list[ProfileRecord]:
        """One record per configuration seen: median step (and compute) time."""
        out = []
        for key, steps in self._steps.items():
            compute = self._compute.get(key)
            out.append(ProfileRecord(
                num_nodes=key[0], num_replicas=key[1], local_bsz=key[2],
                step_time=float(np.median(steps)), accum_steps=key[3],
                compute_time=float(np.median(compute)) if compute else None))
        return out

    def median_step_time(self, key: ConfigKey | None = None) -> float | None:
        """Median step time of ``key`` (default: the configuration running now)."""
        steps = self._steps.get(key or self._current or (0, 0, 0, 0))
        return float(np.median(steps)) if steps else None

    def fit(self, force: bool = False) -> ThroughputParams | None:
        """The throughput model for the timings so far (None before the first one).

        Refits only when a configuration was added or ``refit_after`` timings arrived since
        the last fit (or ``force``); otherwise returns the cached model.
        """
        version, params = self._fitted
        fresh = len(self._steps) == self._fitted_configs and (
            self._version - version < self.refit_after)
        if version == self._version or (params is not None and fresh and not force):
            return params
        records = self.records()
        if records:
            t0 = time.perf_counter()
            params = fit_throughput(records)
            self.fit_seconds = time.perf_counter() - t0
        self._fitted = (self._version, params)
        self._fitted_configs = len(self._steps)
        return params

    def latest(self) -> ThroughputParams | None:
        """The last fitted model, without refitting (None before the first fit)."""
        return self._fitted[1]

    @property
    def num_configs(self) -> int:
        return len(self._steps)

    def summary(self) -> list[dict[str, Any]]:
        """JSON-ready rows: configuration, median times and how many steps were timed."""
        rows = []
        for r in self.records():
            key = (r.num_nodes, r.num_replicas, r.local_bsz, r.accum_steps)
            rows.append({"num_nodes": r.num_nodes, "num_replicas": r.num_replicas,
                         "local_bsz": r.local_bsz, "accum_steps": r.accum_steps,
                         "step_time": r.step_time, "compute_time": r.compute_time,
                         "count": self._counts.get(key, 0)})
        return rows

    # -- state (JSON) --------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"window": self.window, "warmup": self.warmup,
                "configs": [{"key": list(k), "steps": list(v),
                             "compute": list(self._compute.get(k, ())),
                             "count": self._counts.get(k, 0)} for k, v in self._steps.items()]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.window, self.warmup = int(state["window"]), int(state["warmup"])
        self._steps, self._compute, self._counts = {}, {}, {}
        for row in state["configs"]:
            key = tuple(int(v) for v in row["key"])
            self._steps[key] = deque(map(float, row["steps"]), maxlen=self.window)
            if row.get("compute"):
                self._compute[key] = deque(map(float, row["compute"]), maxlen=self.window)
            self._counts[key] = int(row.get("count", len(row["steps"])))
        self._current = None
        self._version += 1

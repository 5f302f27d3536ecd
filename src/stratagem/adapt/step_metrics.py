"""Per-step metrics of the training loop: one record per optimizer step for the metrics
file, the live progress display, and values the script reports itself
(``ad.log_metrics(loss=...)``).

A record is held until the next step completes, so a value the script reports right after
``optimizer.step()`` lands on that step, and one reported before it (no step record open, or
the open one already has that key) on the next.
"""

from __future__ import annotations

import math
import time
from typing import Any

from stratagem.errors import StratagemError
from stratagem.observe import MetricsFile, ProgressDisplay, ProgressFields
from stratagem.observe.side_output import SideOutput

RESERVED = frozenset({"step", "time", "elapsed_s", "epoch"})


class StepRecorder:
    """Rank 0's per-step bookkeeping; ``metrics``/``progress`` may each be None (off)."""

    def __init__(self, metrics: MetricsFile | None = None,
                 progress: ProgressDisplay | None = None, tensorboard: Any = None) -> None:
        self.metrics = metrics
        self.progress = progress
        self.tensorboard = tensorboard  # a SummaryWriter-like object (``add_scalar``)
        self.tensorboard_output = SideOutput(
            f"TensorBoard scalars to {getattr(tensorboard, 'log_dir', None) or 'its directory'}")
        self.started = time.time()
        self._held: dict[str, Any] | None = None
        self._pending: dict[str, float] = {}
        self._last_end: float | None = None
        self._last_fields: ProgressFields | None = None
        self.loss: float | None = None

    def begin_epoch(self) -> None:
        """A loader iteration starts: the next step's time counts from now."""
        self._last_end = time.perf_counter()

    def log(self, values: dict[str, Any]) -> None:
        """The script's own values for the step in progress (see module doc)."""
        clean: dict[str, float] = {}
        for key, value in values.items():
            if key in RESERVED:
                raise StratagemError(f"log_metrics: {key!r} is set by Stratagem",
                                     where="log_metrics", fix="use another name")
            try:
                clean[key] = float(value.item() if hasattr(value, "item") else value)
            except (TypeError, ValueError):
                raise StratagemError(f"log_metrics: {key}={value!r} is not a number",
                                     where="log_metrics",
                                     fix="pass plain numbers (or one-element tensors)"
                                     ) from None
        if "loss" in clean:
            self.loss = clean["loss"]
        held = self._held
        if held is not None and not any(k in held for k in clean):
            held.update(clean)
        else:
            self._pending.update(clean)

    def step(self, record: dict[str, Any], samples: int) -> None:
        """An optimizer step of ``samples`` samples finished; ``record`` holds the loop's
        fields (step, epoch, batch size, ...); timing is added here."""
        now = time.perf_counter()
        elapsed = now - self._last_end if self._last_end is not None else None
        self._last_end = now
        record = dict(record, time=time.time(), elapsed_s=time.time() - self.started)
        if elapsed is not None and elapsed > 0:
            record["step_time_s"] = elapsed
            record["samples_per_s"] = samples / elapsed
            wait = record.get("comm_wait_s")
            if wait is not None:
                record["compute_s"] = max(elapsed - wait, 0.0)
        self.flush()
        record.update(self._pending)
        self._pending = {}
        self._held = record

    def show(self, fields: ProgressFields, end_of_epoch: bool = False) -> None:
        if self.progress is None:
            return
        if end_of_epoch:
            self.progress.end_epoch(fields)
        else:
            self.progress.update(fields)

    def flush(self) -> None:
        """Write the held record (end of an epoch, of the run)."""
        held = self._held
        if held is not None and self.metrics is not None:
            self.metrics.write(held)
        if held is not None and self.tensorboard is not None:
            self.tensorboard_output.attempt(lambda: self._scalars(held))
        self._held = None

    def _scalars(self, held: dict[str, Any]) -> None:
        for key, value in held.items():
            if key not in RESERVED and isinstance(value, (int, float)) \
                    and not isinstance(value, bool) and math.isfinite(value):
                self.tensorboard.add_scalar(f"stratagem/{key}", value, held["step"])

    def close(self) -> None:
        self.flush()
        if self.metrics is not None:
            self.metrics.close()
        if self.tensorboard is not None:
            self.tensorboard_output.attempt(self.tensorboard.flush)


def finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None

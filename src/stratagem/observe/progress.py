"""Rank 0's progress display: a live, rewritten line on a terminal; plain periodic lines
(no control characters) in logs and CI."""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass
from typing import IO

LIVE_EVERY_S = 0.2  # redraws of the live line, at most this often
PLAIN_EVERY_S = 30.0  # plain lines within an epoch, at most this often


@dataclass(frozen=True)
class ProgressFields:
    """What one progress line says. ``epoch`` is the loader's (0-based) epoch number, as
    ``remaining_epochs_until`` and ``loader.epoch`` give it; the line counts epochs from 1,
    as people (and the examples' own ``epoch 1/5`` lines) do. ``step``/``steps`` are the
    epoch's position and length, counting the steps done before a resume. Adaptive fields
    (replicas, local batch, efficiency) are None for jobs that are not adaptive and are then
    omitted."""

    epoch: int
    step: int  # optimizer steps done in this epoch (before a resume too)
    steps: int | None  # optimizer steps in the whole epoch, when known
    samples_per_s: float | None
    loss: float | None = None
    batch_size: int | None = None
    replicas: int | None = None
    local_bsz: int | None = None
    efficiency: float | None = None

    def line(self) -> str:
        total = f"/{self.steps}" if self.steps else ""
        parts = [f"epoch {self.epoch + 1} step {self.step}{total}"]
        if _finite(self.samples_per_s):
            parts.append(f"{self.samples_per_s:.4g} samples/s")
        if _finite(self.loss):
            parts.append(f"loss {self.loss:.4g}")
        if self.batch_size is not None and self.replicas is not None:
            parts.append(f"batch {self.batch_size} ({self.replicas} x {self.local_bsz})")
        if _finite(self.efficiency):
            parts.append(f"efficiency {self.efficiency:.2f}")
        return " | ".join(parts)


def _finite(value: float | None) -> bool:
    return value is not None and math.isfinite(value)


class ProgressDisplay:
    """Shows :class:`ProgressFields` on ``stream``.

    ``mode``: ``live`` rewrites one line (carriage return) at most every ``LIVE_EVERY_S``;
    ``plain`` prints a full line at most every ``plain_every`` seconds and at each epoch's
    end; ``auto`` picks ``live`` when ``stream`` is a terminal; ``off`` shows nothing."""

    def __init__(self, mode: str = "auto", stream: IO[str] | None = None,
                 plain_every: float = PLAIN_EVERY_S) -> None:
        self.stream = stream if stream is not None else sys.stdout
        if mode == "auto":
            isatty = getattr(self.stream, "isatty", None)
            mode = "live" if isatty is not None and isatty() else "plain"
        self.mode = mode
        self.plain_every = plain_every
        self._last = -math.inf
        self._width = 0  # of the live line on screen (0: none)

    def update(self, fields: ProgressFields) -> None:
        """A step finished: redraw or print when due."""
        now = time.monotonic()
        if self.mode == "live" and now - self._last >= LIVE_EVERY_S:
            self._draw(fields.line())
        elif self.mode == "plain" and now - self._last >= self.plain_every:
            self._print(fields.line())
        else:
            return
        self._last = now

    def end_epoch(self, fields: ProgressFields) -> None:
        """The epoch ended: its final line stays on screen (live) or is printed (plain)."""
        if self.mode == "live":
            self._draw(fields.line())
            self.stream.write("\n")
            self.stream.flush()
            self._width = 0
        elif self.mode == "plain":
            self._print(fields.line())
        self._last = -math.inf

    def clear(self) -> None:
        """Erase a live line so that other output starts on a clean line."""
        if self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self.stream.flush()
            self._width = 0

    def message(self, text: str) -> None:
        """Print ``text`` on its own line without garbling a live line."""
        self.clear()
        self._print(text)

    def _draw(self, line: str) -> None:
        pad = max(self._width - len(line), 0)
        self.stream.write("\r" + line + " " * pad)
        self.stream.flush()
        self._width = len(line)

    def _print(self, line: str) -> None:
        self.stream.write(line + "\n")
        self.stream.flush()

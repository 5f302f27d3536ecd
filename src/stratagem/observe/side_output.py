"""Best-effort outputs beside training: the metrics file, TensorBoard scalars, the hints file.

None of them is the job's state, so none may end the job: a full or read-only disk (an
``OSError`` such as ``ENOSPC``/``EROFS``) turns the output off with one warning naming it
and the cause, and training goes on. Checkpoints are not side outputs: their failures are
errors (:mod:`stratagem.checkpoint`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from stratagem.observe.logs import logger

T = TypeVar("T")


class SideOutput:
    """One best-effort output, ``what`` (e.g. ``"the metrics file /run/metrics.jsonl"``).

    :meth:`attempt` runs a write; its ``OSError`` is logged once (a warning) and, with
    ``stop=True``, turns the output off (a half-written line must not be followed by more).
    """

    def __init__(self, what: str) -> None:
        self.what = what
        self.off = False
        self.warned = False

    def attempt(self, write: Callable[[], T], *, stop: bool = True) -> T | None:
        if self.off:
            return None
        try:
            return write()
        except OSError as exc:
            if stop:
                self.off = True
            if not self.warned:
                self.warned = True
                cause = exc.strerror or str(exc) or type(exc).__name__
                tail = "no more writes" if stop else "later writes are tried, silently"
                logger().warning(f"cannot write {self.what}: {cause} ({tail}); training "
                                 "goes on")
            return None

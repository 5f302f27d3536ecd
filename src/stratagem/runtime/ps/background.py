"""One background job at a time on a daemon thread, joined where its result is needed.

The bulk-synchronous engine runs a forward's closing pull rounds here (see
``PSEngine.after_forward``): a worker that has all its rows keeps serving the others while
its own backward computes, instead of waiting for every peer before backward starts.
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class Background:
    """Runs submitted callables on one daemon thread; :meth:`join` waits for the current
    one and re-raises its exception in the caller.

    Daemon: a job stuck on a dead peer must not keep the interpreter from exiting (its
    own collective times out and the error surfaces at the next :meth:`join`)."""

    def __init__(self, name: str, track: Callable[[threading.Thread, Callable[[], None]],
                                                  None] | None = None) -> None:
        """``track(thread, stop)``: told of the thread when it starts (``Cluster.track``:
        stopped, woken and joined at exit)."""
        self.name = name
        self._track = track
        self._job: Callable[[], None] | None = None
        self._error: BaseException | None = None
        self._ready = threading.Condition()
        self._done = threading.Event()
        self._done.set()
        self._thread: threading.Thread | None = None
        self._stopping = False

    @property
    def busy(self) -> bool:
        return not self._done.is_set()

    def submit(self, job: Callable[[], None]) -> None:
        """Start ``job``; the previous one must have been joined."""
        if self.busy:
            raise RuntimeError(f"{self.name}: a job is still running")
        self._error = None
        self._done.clear()
        with self._ready:
            self._job = job
            self._ready.notify()
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
            self._thread.start()
            if self._track is not None:
                self._track(self._thread, self.stop)

    def join(self) -> None:
        """Wait for the current job (if any); raise what it raised."""
        self._done.wait()
        error, self._error = self._error, None
        if error is not None:
            raise error

    def stop(self) -> None:
        """End the thread once its current job is done (joined or not): an idle one would
        otherwise wait for the next job until the interpreter exits."""
        with self._ready:
            self._stopping = True
            self._ready.notify()

    def _loop(self) -> None:
        while True:
            with self._ready:
                while self._job is None and not self._stopping:
                    self._ready.wait()
                if self._job is None:
                    self._thread = None
                    return
                job, self._job = self._job, None
            try:
                job()
            except BaseException as exc:  # noqa: BLE001 - handed to join()
                self._error = exc
            finally:
                job = None  # (a bound method: it would keep its engine alive while idle)
                self._done.set()

"""Owner-side pacing of large dense pushes: one sender at a time into an owner.

Every worker pushes a dense bucket to its owner at about the same moment (the end of
backward). Sent together, three 3 MB pushes into one 1 Gbit/s link overflow the switch's
queue: on the virtual cluster (5 ms of queue) each such push cost 2,900-3,800 TCP
retransmissions, and in training some losses were recovered only by retransmission
timeouts (a small message, or a push's tail, has no later packet to reveal its loss):
half of wide & deep's parameter-server steps at 4 nodes took 1.0-1.35 s instead of 0.3 s.
Sent one after the other, the same pushes took the same 80 ms with no retransmission.

gloo sends a payload only once its receiver has announced the receive, so the owner paces
the senders by posting their receives one at a time, each when the previous one has
completed (receiver-driven, as grant-based datacenter transports do). A push smaller than
:func:`stratagem.env.ps_pace_bytes` is not paced: its queue fits in any switch's buffer and
the hop each paced receive adds (0.1-0.4 ms on a busy 10 Gbit/s node) would cost more.
Nor is an owner that pushes a large bucket to another owner itself (:func:`paced_buckets`).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch.distributed as dist

from stratagem.runtime.ps.plan import PSBucket


class PacedRecv:
    """One receive of a paced sequence; :meth:`wait` as a ``dist.Work``'s."""

    def __init__(self, post: Callable[[], dist.Work]) -> None:
        self.post = post
        self.work: dist.Work | None = None
        self.error: BaseException | None = None
        self.done = threading.Event()

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Block until the receive completed; raise what posting or waiting raised.
        (``timeout`` is the group's: the pacer's own wait on the receive enforces it.)"""
        self.done.wait()
        if self.error is not None:
            raise self.error
        return True

    def is_completed(self) -> bool:
        return self.done.is_set()


class ReceivePacer:
    """Posts queued receives one at a time on a daemon thread, each once the previous
    one completed. A receive queued while nothing is pending is posted at once, by the
    caller: an owner's first receive is then announced before the owner sends anything
    itself (see ``dense.py`` on announcements queued behind payloads).

    After a failure (a dead peer, a closed group), every queued receive and every later
    one fails with the same error instead of waiting."""

    def __init__(self, name: str, track: Callable[[threading.Thread, Callable[[], None]],
                                                  None] | None = None) -> None:
        self.name = name
        self._track = track
        self._queue: deque[PacedRecv] = deque()
        self._active: PacedRecv | None = None
        self._error: BaseException | None = None
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False

    def recv(self, post: Callable[[], dist.Work]) -> PacedRecv:
        """Queue the receive that ``post()`` starts; returns its handle."""
        item = PacedRecv(post)
        with self._cond:
            if self._error is not None:
                self._fail(item, self._error)
                return item
            if self._active is None and not self._queue:
                try:
                    item.work = post()
                except BaseException as exc:  # noqa: BLE001 - handed to wait()
                    self._fail(item, exc)
                    return item
            self._queue.append(item)
            self._start()
            self._cond.notify()
        return item

    @property
    def idle(self) -> bool:
        with self._cond:
            return self._active is None and not self._queue

    def stop(self) -> None:
        """End the thread once the queue is drained (``Cluster.quiesce`` interrupts the
        groups first, so a pending receive fails rather than keeps it)."""
        with self._cond:
            self._stopping = True
            self._cond.notify()

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
            self._thread.start()
            if self._track is not None:
                self._track(self._thread, self.stop)

    @staticmethod
    def _fail(item: PacedRecv, exc: BaseException) -> None:
        item.error = exc
        item.done.set()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                if not self._queue:
                    self._thread = None
                    return
                item = self._active = self._queue.popleft()
            try:
                if item.work is None:
                    item.work = item.post()
                item.work.wait()
            except BaseException as exc:  # noqa: BLE001 - handed to every waiter
                with self._cond:
                    self._error = exc
                    self._fail(item, exc)
                    while self._queue:
                        self._fail(self._queue.popleft(), exc)
                    self._active = None
                continue
            finally:
                item.post = _posted  # (drops the closure: its tensor and group)
            with self._cond:
                self._active = None
            item.done.set()


def _posted() -> dist.Work:
    raise RuntimeError("a paced receive was posted twice")


def pace_order(senders: list[int], owner: int, workers: int) -> list[int]:
    """The senders (worker ranks) in the order an owner receives them: from the worker
    after the owner on, so worker owners pacing at the same time take different senders
    in each turn (a shift schedule, as in a ring all-to-all)."""
    return sorted(senders, key=lambda s: (s - owner) % workers)


def paced_buckets(buckets: Sequence[PSBucket], workers: int, threshold: int) -> set[int]:
    """Ids of the dense buckets whose owner receives the push one sender at a time: at
    least ``threshold`` bytes, from two senders or more (the workers, less the owner if
    it is one), into an owner that pushes no bucket of ``threshold`` bytes to another
    owner itself. Such an owner's chained announcements would queue behind its own
    payloads on the same connections (see ``dense.py``): with every rank owning a
    quarter of the LSTM LM's 102 MB output layer (PartitionedPS, 4 nodes, 1 Gbit/s)
    paced steps took 1.89 s against 1.51 unpaced."""
    if threshold <= 0:
        return set()
    large_owners = {b.owner for b in buckets if b.nbytes >= threshold}
    out = set()
    for b in buckets:
        is_worker = b.owner < workers
        senders = workers - 1 if is_worker else workers
        pushes_large = is_worker and bool(large_owners - {b.owner})
        if b.nbytes >= threshold and senders >= 2 and not pushes_large:
            out.add(b.id)
    return out

"""Gloo's socket threads yield the CPU to a worker that waits on them.

Each gloo process group has one I/O thread (``gloo_tcp_loop``) that moves bytes between its
sockets and the buffers of pending operations. Where a worker may run on one CPU only, that
thread and the worker's main thread share the core, and gloo's event handler retries at once
when a connection's lock is taken (``try_to_lock`` in ``tcp/pair.cc``): the main thread,
woken by the data it waits for, can then wait a whole scheduler slice while the I/O thread
spins. Measured on the virtual cluster, one core per worker: a two-way exchange of 6.4 KB
took 2.4 ms, one way 0.08 ms.

:class:`Yielding` puts a group's I/O threads in ``SCHED_IDLE`` while the main thread waits
on that group, and back in ``SCHED_OTHER`` when the wait ends: the woken main thread takes
the core at once, and while it computes, the transfers it overlaps keep their fair share.
(Idle for good is simpler but starves them: an all-reduce overlapped with backward at
1 Gbit/s lost its overlap, 49 -> 57 ms a step.)

Leaving ``SCHED_IDLE`` needs CAP_SYS_NICE or an RLIMIT_NICE of 20 (``ulimit -e 20``); a
process without either leaves its waits as they are. ``STRATAGEM_GLOO_YIELD`` chooses:
``off`` (default), ``auto`` (when the process may run on one CPU only) or ``on``. Off by
default because the planner's link probe, which yields the same way, then reads some small
operations cheaper than training pays for them (docs/concepts/allreduce-runtime.md).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from typing import TypeVar

from stratagem import env

T = TypeVar("T")
LOOP_NAME = "gloo_tcp_loop"
_log = logging.getLogger(__name__)
_claimed: set[int] = set()  # I/O threads of groups that keep their own (see new_loops)
_enabled: bool | None = None
_depth = 0  # waits of the main thread in progress (nested: Group.run -> Group.wait)


NAMING_S = 1.0
"""How long :func:`new_loops` waits for the threads a group started to take their names (a
new thread starts with its creator's and renames itself once it runs: on a busy core, 197
of 200 groups' I/O threads were not yet named when their constructor returned)."""


def _names() -> dict[int, str]:
    """This process's threads by id, with their names (``comm``)."""
    out = {}
    with contextlib.suppress(OSError):
        for tid in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError), open(f"/proc/self/task/{tid}/comm") as fp:
                out[int(tid)] = fp.read().strip()
    return out


def loop_threads() -> frozenset[int]:
    """Thread ids of this process's gloo I/O threads."""
    return frozenset(t for t, name in _names().items() if name == LOOP_NAME)


def new_loops(create: Callable[[], T]) -> tuple[T, frozenset[int]]:
    """``create()`` (which makes a process group) and the I/O threads it started, claimed
    for that group: :func:`unclaimed_loops` no longer lists them. Waits (up to
    ``NAMING_S``) until the threads it started no longer carry their creator's name."""
    names = _names()
    before, inherited = set(names), names.get(threading.get_native_id())
    made = create()
    deadline = time.monotonic() + NAMING_S
    while True:
        started = {t: n for t, n in _names().items() if t not in before}
        if inherited not in started.values() or time.monotonic() > deadline:
            break
        time.sleep(0.001)
    mine = frozenset(t for t, n in started.items() if n == LOOP_NAME)
    _claimed.update(mine)
    return made, mine


def unclaimed_loops() -> frozenset[int]:
    """The I/O threads no :func:`new_loops` claimed: the default group's (whoever created
    it) and those of groups made outside Stratagem's runtime."""
    return loop_threads() - _claimed


def enabled() -> bool:
    """Whether waits yield (``STRATAGEM_GLOO_YIELD``; decided once per process)."""
    global _enabled
    if _enabled is None:
        mode = env.gloo_yield()
        wanted = mode == "on" or (mode == "auto" and one_cpu())
        _enabled = wanted and _can_leave_idle()
        if wanted and not _enabled:
            (_log.warning if mode == "on" else _log.debug)(
                "gloo I/O threads do not yield: this process may not move a thread out of "
                "SCHED_IDLE (it needs CAP_SYS_NICE or `ulimit -e 20`)")
    return _enabled


def one_cpu() -> bool:
    """Whether this process may run on one CPU only (its affinity mask)."""
    try:
        return len(os.sched_getaffinity(0)) == 1
    except (AttributeError, OSError):
        return False


def _can_leave_idle() -> bool:
    """Try the round trip on a thread of our own: SCHED_IDLE is open to anyone, leaving it
    is not (a gloo thread stuck in it would starve overlapped transfers)."""
    if not hasattr(os, "SCHED_IDLE"):
        return False
    release = threading.Event()
    probe = threading.Thread(target=release.wait, name="stratagem-sched-probe", daemon=True)
    probe.start()
    try:
        tid = probe.native_id
        if tid is None:
            return False
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
        return True
    except OSError:
        return False
    finally:
        release.set()
        probe.join()


class Yielding:
    """Context manager for the main thread's waits on one group: its I/O threads ``tids``
    are in SCHED_IDLE inside (a no-op on other threads, when disabled, and inside another
    wait of the main thread)."""

    def __init__(self, tids: Iterable[int]) -> None:
        self.tids = set(tids)

    def __enter__(self) -> Yielding:
        global _depth
        if _counts():
            _depth += 1
            if _depth == 1:
                self._set(os.SCHED_IDLE)
        return self

    def __exit__(self, *exc: object) -> None:
        global _depth
        if _counts():
            _depth -= 1
            if _depth == 0:
                self._set(os.SCHED_OTHER)

    def _set(self, policy: int) -> None:
        for tid in tuple(self.tids):
            try:
                os.sched_setscheduler(tid, policy, os.sched_param(0))
            except OSError as exc:  # ProcessLookupError: the group was destroyed
                _log.debug("gloo I/O thread %s: %s", tid, exc)
                self.tids.discard(tid)


def _counts() -> bool:
    return enabled() and threading.current_thread() is threading.main_thread()

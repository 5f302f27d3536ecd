"""Peer heartbeats for the default process group: a peer that stops answering ends the job
in seconds instead of at the collective timeout.

A SIGKILLed peer closes its sockets and gloo fails at once; a *frozen* peer, or one behind a
link or node that went down, closes nothing, and the survivors would wait in their
all-reduce for the whole process-group timeout (default 300 s). So each rank of a job
launched by torch elastic (``stratagem run``/``torchrun``) runs a daemon thread that bumps its
counter in the job's store every :data:`BEAT_S` and watches the others' counters (on its own
clock: no clock sync needed). When a peer's counter has not moved for
``STRATAGEM_PEER_TIMEOUT_S`` (default 10 s; 0 disables), or the store itself is unreachable,
the thread writes a torch elastic error file naming the lost rank and leaves the process
(``os._exit``): its blocked collective cannot be interrupted from Python. The launcher then
stops the job and, with ``--max-restarts``, starts it again from the newest checkpoint.

A rank that finishes normally marks itself done when its group is destroyed, so its
silence afterwards is not a loss. But a collective that includes it can never complete: when
this rank's main thread waits in one (a ``torch.distributed`` call, e.g. under
``refresh_parameters()``) after a peer finished its script, the collective was called on
one rank only; the thread says so, naming the call and the finished peer, and ends the process
(exit code 1: a bug in the script, which a restart would repeat) instead of waiting for the
process-group timeout or blaming the peer as lost. Members of an in-process elastic job
(:mod:`stratagem.elastic.rescale`) beat the same way in the rescale store, one key space
per generation.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from stratagem import env

BEAT_S = 1.0
EXIT_CODE = 75  # a rank that left its collective because a peer was lost
ONE_RANK_EXIT_CODE = 1  # a collective called on one rank only: the script's bug
_TORCH_DIR = str(Path(dist.__file__).resolve().parents[1])  # .../torch
_OWN_DIR = str(Path(__file__).resolve().parents[1])  # .../stratagem
JOIN_S = 5.0  # the longest :meth:`PeerWatchdog.stop` waits for the thread


class PeerWatchdog:
    """Heartbeats of ``rank`` among ``world`` ranks through ``store`` (see module doc)."""

    def __init__(self, store: Any, rank: int, world: int, timeout_s: float,
                 exit_process: bool = True, beat_s: float = BEAT_S,
                 names: tuple[str, ...] = ()) -> None:
        self.store, self.rank, self.world = store, rank, world
        self.names = names  # per rank, for the message (in-process members' ids)
        self.timeout_s, self.beat_s = timeout_s, beat_s
        self.exit_process = exit_process
        self.lost: str | None = None  # why the watchdog fired (tests read it)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stratagem-peer-watchdog",
                                        daemon=True)

    def start(self) -> PeerWatchdog:
        self._thread.start()
        return self

    def stop(self, done: bool = True) -> None:
        """Stop beating and wait (at most :data:`JOIN_S`) for the thread to leave the
        store: a store call that returns while the interpreter finalizes aborts the
        process. ``done``: tell the others this rank finished (not lost)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(JOIN_S)
        if done:
            with contextlib.suppress(Exception):
                self.store.set(f"done/{self.rank}", "1")

    def _run(self) -> None:
        peers = [r for r in range(self.world) if r != self.rank]
        seen: dict[int, tuple[int, float]] = {}  # peer -> (last counter, when it moved)
        while not self._stop.is_set():
            now = time.monotonic()
            try:
                self.store.add(f"beat/{self.rank}", 1)
                for peer in peers:
                    count = self.store.add(f"beat/{peer}", 0)
                    if peer not in seen or seen[peer][0] != count:
                        seen[peer] = (count, now)
                    elif now - seen[peer][1] > self.timeout_s:
                        if not self.store.check([f"done/{peer}"]):
                            self._fire(f"{self._who(peer)} stopped answering: no heartbeat "
                                       f"for {now - seen[peer][1]:.0f} s (frozen, or its node "
                                       "or link is down)", peer)
                            return
                        call = main_thread_collective(peer)
                        if call is not None:
                            self._fire(f"this rank waits in {call}, but {self._who(peer)} "
                                       "finished its script normally and will never join: the "
                                       "collective was called on one rank only (call it on "
                                       "every rank, or on none)", peer,
                                       code=ONE_RANK_EXIT_CODE, kind="CollectiveOnOneRank")
                            return
            except Exception as exc:  # noqa: BLE001 - the store (its host) is unreachable
                if self._stop.is_set():
                    return
                self._fire(f"the job's store is unreachable ({type(exc).__name__}: "
                           f"{str(exc)[:120]}): its host, node or link is down", None)
                return
            self._stop.wait(self.beat_s)

    def finished(self) -> list[str]:
        """The peers that marked themselves done (finished their script normally)."""
        try:
            return [self._who(p) for p in range(self.world)
                    if p != self.rank and self.store.check([f"done/{p}"])]
        except Exception:  # noqa: BLE001 - the store is gone: nothing to say
            return []

    def _who(self, peer: int) -> str:
        return f"rank {peer} ({self.names[peer]})" if peer < len(self.names) else f"rank {peer}"

    def _fire(self, why: str, peer: int | None, *, code: int = EXIT_CODE,
              kind: str = "PeerLost") -> None:
        self.lost = why
        message = f"{kind}: {why}; rank {self.rank} left its collective"
        print(f"stratagem: {message}", file=sys.stderr, flush=True)
        if not self.exit_process:
            return
        path = os.environ.get("TORCHELASTIC_ERROR_FILE")
        if path:  # the launcher's failure summary names the lost rank (see launch.worker)
            with contextlib.suppress(OSError), open(path, "w") as fp:
                json.dump({"message": {"message": message, "extraInfo": {
                    "py_callstack": "", "timestamp": str(int(time.time())),
                    "stratagem": {"time": time.time(), "rank": str(self.rank),
                                  "lost_rank": peer, "node": env.node_address()}}}}, fp)
        os._exit(code)


def main_thread_collective(peer: int) -> str | None:
    """``"all_reduce (called from train.py:12)"`` when the main thread waits in a
    ``torch.distributed`` collective whose group includes ``peer``, else None."""
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    call = None
    callers: list[str] = []
    while frame is not None:
        name = frame.f_code.co_filename
        if call is None and name.endswith("distributed_c10d.py"):
            group = frame.f_locals.get("group")
            try:
                if group is not None and peer not in dist.get_process_group_ranks(group):
                    return None  # a subgroup without the finished peer: it can complete
            except Exception:  # noqa: BLE001 - not a group we can read: assume the world
                pass
            call = frame.f_code.co_name
        elif call is not None and not name.startswith(_TORCH_DIR):
            callers.append(f"{frame.f_code.co_name} at {Path(name).name}:{frame.f_lineno}")
            if not name.startswith(_OWN_DIR):
                break  # the script's own line ends the trail
        frame = frame.f_back
    if call is None:
        return None
    return f"{call}" + (f" (called from {', from '.join(callers)})" if callers else "")


def start_for_world(rank: int, world: int) -> PeerWatchdog | None:
    """A watchdog for ``rank`` of the ``world`` processes torch elastic started, when it
    launched them with its agent's store (at MASTER_ADDR:MASTER_PORT; it outlives the
    workers), the world has peers and ``STRATAGEM_PEER_TIMEOUT_S`` is not 0; else None."""
    seconds = env.peer_timeout()
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if not seconds or not (addr and port and run_id and port.isdigit()):
        return None
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None  # the store lives in rank 0, which may exit first: not a safe beacon
    if world < 2:
        return None
    try:
        client = dist.TCPStore(addr, int(port), is_master=False,
                               timeout=timedelta(seconds=max(seconds, 1.0)),
                               wait_for_workers=False)
    except Exception:  # noqa: BLE001 - no store to beat in: the collective timeout applies
        return None
    attempt = f"{env.restart_count()}.{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    store = dist.PrefixStore(f"stratagem/peers/{run_id}/{attempt}/", client)
    return PeerWatchdog(store, rank, world, seconds).start()

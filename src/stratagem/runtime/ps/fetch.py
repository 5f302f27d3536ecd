"""Single-rank reads of current embedding rows: owners answer fetches on their own group.

Under bulk-synchronous training a worker's copy of an on-demand sparse table is current
only in the rows it pulled for its batch, and only until the next update. Reading the
model (``state_dict()``, an evaluation forward) must not need the other workers: they may
have left the training loop or be exiting. So every owner of on-demand sparse pieces runs
a :class:`FetchService`: one daemon thread per worker, blocked in a receive from that
worker on the owner's *fetch group* (the workers plus the owner, used by nothing else), that
answers

``FETCH``  ``[FETCH, src, version, piece position, n]`` then ``n`` int64 row ids (``n < 0``:
           the whole piece): the rows, once the owner's values have reached ``version``
           (the number of value changes -- updates, restores -- the asking worker has seen;
           every rank counts them the same way, so the answer is what one process would
           hold after as many steps);
``STATE``  ``[STATE, src, version, piece id, 0]``: that owned piece's optimizer state once
           the owner's values have reached ``version``, as plain tensors (``statewire.py``:
           a length header, an int64 manifest, one byte blob; nothing pickled), so one
           rank can write a complete checkpoint;
``CLOSE``  the worker is done with this owner.

A thread ends at ``CLOSE`` or when its worker's connection closes (the process ended: gloo
fails a receive from a peer that is gone at once, unlike a receive from any source). At
exit an owner *lingers* (:meth:`FetchService.linger`) until every worker's thread has ended,
so a worker still saving or evaluating is served. Reads never block training: a worker
sends requests only from its own main thread, and an owner's shards change only in its
update, which (bulk-synchronous) cannot start before every worker pushed the step after
the one it asked for.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch

from stratagem.errors import DistributedError
from stratagem.runtime.ps import statewire
from stratagem.runtime.ps.cluster import Group, data_timeout, join_all
from stratagem.runtime.ps.plan import PSPiece

IDLE = timedelta(days=365)  # an owner waits this long for a worker's next request
FETCH, CLOSE, STATE = 1, 2, 3
HLEN = 5  # kind, src, version, piece position (STATE: id), number of ids (-1: the whole piece)
REQ, IDS, REP = 41, 42, 1 << 21  # REP + piece position: the reply's tag
S_HDR, S_MAN, S_BLOB = 43, 44, 45  # a STATE reply: lengths, manifest, blob


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(-1).cpu().view(torch.uint8)


def _peer_gone(exc: BaseException) -> bool:
    """Whether ``exc`` is a receive failing because the peer's process ended, or this
    owner's group being shut down at exit (gloo's wording, or a DistributedError's)."""
    text = str(exc).lower()
    return any(k in text for k in ("closed", "connection reset", "shutdown", "shut down",
                                   "aborted", "timed out", "timeout"))


class FetchService:
    """The owner's side: answers each worker's fetches from a thread of its own."""

    def __init__(self, group: Group, pieces: Sequence[PSPiece], positions: dict[int, int],
                 shards: dict[int, torch.Tensor], workers: int,
                 state_of: Callable[[int], dict[str, Any]]) -> None:
        """``pieces``: the owned on-demand sparse pieces (row fetches, by ``positions``);
        ``shards``: every owned piece's shard; ``state_of(piece id)``: its optimizer state
        (detached CPU copies)."""
        self.group = group
        self.rank = group.cluster.rank
        self.pieces = {positions[p.id]: p for p in pieces}  # position -> owned piece
        self.shards = shards
        self.state_of = state_of
        self.version = 0
        self._cond = threading.Condition()
        self._threads = [threading.Thread(target=self._serve, args=(w,), daemon=True,
                                          name=f"stratagem-ps-fetch-{self.rank}-{w}")
                         for w in range(workers) if w != self.rank]
        for t in self._threads:
            t.start()
            group.cluster.track(t)

    def advance(self) -> None:
        """The owner's values changed (an update or a restore finished)."""
        with self._cond:
            self.version += 1
            self._cond.notify_all()

    def _serve(self, src: int) -> None:
        hdr = torch.empty(HLEN, dtype=torch.int64)
        try:
            while True:
                # A worker may train far longer than the data timeout between reads: the
                # wait for its next request must not time out (gloo closes the pair then,
                # and the worker's next read would find the owner gone).
                self.group.recv(hdr, src, REQ).wait(IDLE)
                kind, _, version, pos, n = (int(v) for v in hdr)
                if kind not in (FETCH, STATE):
                    return
                ids = None
                if n >= 0:
                    ids = torch.empty(n, dtype=torch.int64)
                    if n:
                        self.group.recv(ids, src, IDS).wait()
                with self._cond:  # (the timeout only bounds a hung owner)
                    reached = self._cond.wait_for(lambda v=version: self.version >= v,
                                                  data_timeout().total_seconds())
                if not reached:  # never serve rows older than asked: end, and say why
                    print(f"stratagem: parameter-server owner {self.rank}: worker {src} "
                          f"asked for values at version {version}, still at "
                          f"{self.version} after {data_timeout()}; not answering it "
                          "(its fetch fails)", file=sys.stderr, flush=True)
                    return
                if kind == STATE:
                    self._send_state(src, pos)
                    continue
                p = self.pieces[pos]
                shard = self.shards[p.id]
                rows = (shard if ids is None
                        else shard.index_select(0, (ids - p.row_start).to(shard.device)))
                self.group.send(_bytes(rows), src, REP + pos).wait()
        except Exception as exc:  # noqa: BLE001 - the thread ends; the worker's fetch fails
            if not _peer_gone(exc):  # a closed connection is the worker ending: normal
                print(f"stratagem: parameter-server owner {self.rank} stopped serving "
                      f"worker {src}: {type(exc).__name__}: {str(exc)[:200]}",
                      file=sys.stderr, flush=True)
            return

    def _send_state(self, src: int, pid: int) -> None:
        send_state(self.group, src, self.state_of(pid), None)

    def linger(self, alive: Callable[[], bool] = lambda: True) -> None:
        """Wait until every worker closed (or its process ended), at most the data
        timeout (``alive`` False stops waiting early), then :meth:`stop`."""
        deadline = time.monotonic() + data_timeout().total_seconds()
        for t in self._threads:
            while t.is_alive() and time.monotonic() < deadline and alive():
                t.join(0.2)
        self.stop()

    def stop(self) -> None:
        """Shut the group down, waking the threads still waiting for a worker's request,
        and let them end (at most :data:`~stratagem.runtime.ps.cluster.QUIESCE_S`): a
        receive that returns while the interpreter finalizes aborts the process (see
        ``cluster.py``, *Exit*)."""
        self.group.shutdown()
        join_all(self._threads)


class FetchClient:
    """The worker's side: whole pieces or given rows from their owners' services."""

    def __init__(self, groups: dict[int, Group], pieces: Sequence[PSPiece], rank: int,
                 row_bytes: Sequence[int], dtypes: Sequence[torch.dtype]) -> None:
        self.groups = groups  # owner -> its fetch group
        self.pieces = list(pieces)
        self.rank = rank
        self.row_bytes = list(row_bytes)
        self.dtypes = list(dtypes)
        self.closed = False

    def fetch(self, requests: dict[int, torch.Tensor | None], version: int
              ) -> dict[int, torch.Tensor]:
        """``requests``: piece position -> global row ids (None: every row). Returns the
        rows per position (all receives are posted before any request is sent)."""
        replies = {}
        for pos, ids in requests.items():
            p = self.pieces[pos]
            n = p.rows if ids is None else len(ids)
            buf = torch.empty(n * self.row_bytes[pos], dtype=torch.uint8)
            g = self.groups[p.owner]
            replies[pos] = (buf, n, g.recv(buf, p.owner, REP + pos))
        for pos, ids in requests.items():
            p = self.pieces[pos]
            g = self.groups[p.owner]
            hdr = torch.tensor([FETCH, self.rank, version, pos, -1 if ids is None else len(ids)],
                               dtype=torch.int64)
            g.run(lambda g=g, h=hdr, o=p.owner: g.send(h, o, REQ),
                  f"asking {g.cluster.describe(p.owner)} for rows")
            if ids is not None and len(ids):
                ids = ids.to(torch.int64).contiguous()
                g.run(lambda g=g, i=ids, o=p.owner: g.send(i, o, IDS),
                      f"asking {g.cluster.describe(p.owner)} for rows")
        out = {}
        for pos, (buf, n, work) in replies.items():
            p = self.pieces[pos]
            self.groups[p.owner].wait(work, f"fetching rows of {p.param} from "
                                            f"{self.groups[p.owner].cluster.describe(p.owner)}")
            out[pos] = buf.view(self.dtypes[pos]).view(n, *p.shape[1:])
        return out

    def state(self, piece: PSPiece, version: int) -> dict[str, Any]:
        """The optimizer state of ``piece`` from its owner, once the owner's values have
        reached ``version`` (checked against the piece before anything is allocated)."""
        g = self.groups[piece.owner]
        what = (f"fetching the optimizer state of {piece.param} from "
                f"{g.cluster.describe(piece.owner)}")
        sizes = torch.empty(2, dtype=torch.int64)
        work = g.recv(sizes, piece.owner, S_HDR)
        hdr = torch.tensor([STATE, self.rank, version, piece.id, 0], dtype=torch.int64)
        g.run(lambda: g.send(hdr, piece.owner, REQ), what)
        g.wait(work, what)
        return recv_state(g, piece.owner, piece, what, sizes)

    def close(self) -> None:
        """Tell every owner this worker is done (errors: that owner is gone already)."""
        if self.closed:
            return
        self.closed = True
        hdr = torch.tensor([CLOSE, self.rank, 0, 0, 0], dtype=torch.int64)
        for o, g in self.groups.items():
            if o != self.rank:
                with contextlib.suppress(Exception):  # at exit, an owner may have ended
                    g.send(hdr, o, REQ).wait()


def send_state(group: Group, dst: int, state: dict[str, Any], what: str | None) -> None:
    """Send one piece's optimizer state to ``dst`` as plain tensors (statewire.py): the two
    lengths, the manifest, the blob. ``what`` names the operation in a failure's
    DistributedError; None: raw errors (a fetch service's thread, which ends on any)."""
    manifest, blob = statewire.encode(state)
    sizes = torch.tensor([manifest.numel(), blob.numel()], dtype=torch.int64)
    for t, tag in ((sizes, S_HDR), (manifest, S_MAN), (blob, S_BLOB)):
        if not t.numel():
            continue
        if what is None:
            group.send(t, dst, tag).wait()
        else:
            group.run(lambda t=t, tag=tag: group.send(t, dst, tag), what)


def recv_state(group: Group, src: int, piece: PSPiece, what: str,
               sizes: torch.Tensor | None = None) -> dict[str, Any]:
    """Receive what :func:`send_state` sent for ``piece`` (``sizes``: its lengths, already
    received), checking the manifest against the piece before allocating the blob."""
    if sizes is None:
        sizes = torch.empty(2, dtype=torch.int64)
        group.run(lambda: group.recv(sizes, src, S_HDR), what)
    n_man, n_blob = (int(v) for v in sizes)
    fix = "all ranks must run the same Stratagem version"
    if not 0 < n_man <= statewire.MAX_MANIFEST:
        raise DistributedError(f"malformed optimizer-state reply: a manifest of {n_man} "
                               "values", where=what, fix=fix)
    manifest = torch.empty(n_man, dtype=torch.int64)
    group.run(lambda: group.recv(manifest, src, S_MAN), what)
    entries = statewire.layout(manifest, tuple(piece.shape), what)
    if n_blob != statewire.blob_size(entries):
        raise DistributedError(f"malformed optimizer-state reply: {n_blob} bytes where the "
                               f"manifest says {statewire.blob_size(entries)}", where=what,
                               fix=fix)
    blob = torch.empty(n_blob, dtype=torch.uint8)
    if n_blob:
        group.run(lambda: group.recv(blob, src, S_BLOB), what)
    return statewire.decode(entries, blob)

"""Sparse PS pieces: embedding rows travel as (row index, row) pairs, never whole tables.

All exchanges are all-to-alls over the group of every PS rank (workers and servers), in
two steps: a small fixed-size all-to-all of counts, then one variable-split all-to-all of
bytes (int64 row indices followed by the rows, per piece, per peer).

*Push* (end of backward): each worker sends, to the owner of each row range, the rows of
its coalesced, pre-scaled gradient; the owner concatenates what it receives and coalesces
(duplicates summed) -- that is the averaged sparse gradient of its shard.

*Pull* (each embedding call in a training forward, ``local_replication: false``): a
*round* is counts (+ a done flag and a request total) -> requested ids -> rows. A worker
runs one round per call of an embedding module, asking the owners for the rows of the
call's unique ids it does not own; after its forward it runs closing rounds until every
worker is done, so workers may call embeddings in any order and number. Servers only serve.

*Refresh after update* (``local_replication: true``): the owner sends the rows its update
changed to every worker, so each worker's copy stays complete and no pull is needed.
"""

from __future__ import annotations

from math import prod

import torch

from stratagem.runtime.ps.cluster import Group
from stratagem.runtime.ps.plan import PSPiece
from stratagem.runtime.stats import CommStats

I64 = 8


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def write_rows(param: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor) -> None:
    """Overwrite rows ``ids`` of a worker's copy (``.data``: no autograd version bump, so
    a lookup earlier in the same forward stays valid -- the values did not change)."""
    param.data.index_copy_(0, ids.to(param.device), rows.to(param.device))


def _as(chunk: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Reinterpret a byte slice (copied if misaligned) as ``dtype`` of ``shape``."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    if chunk.storage_offset() % itemsize:
        chunk = chunk.clone()
    return chunk.view(dtype).view(shape)


class SparseExchange:
    """Row traffic of the sparse pieces for one rank (worker or server)."""

    def __init__(self, pieces: list[PSPiece], group: Group, rank: int, workers: int,
                 params: dict[str, torch.nn.Parameter], shards: dict[int, torch.Tensor],
                 stats: CommStats) -> None:
        self.pieces = pieces
        self.pos = {p.id: i for i, p in enumerate(pieces)}
        self.group = group
        self.rank = rank
        self.workers = workers
        self.size = group.size
        self.stats = stats
        self.shards = shards
        self.dtypes = [getattr(torch, p.dtype) for p in pieces]
        self.row_shapes = [tuple(p.shape[1:]) for p in pieces]
        self.row_bytes = [prod(p.shape[1:]) * torch.empty((), dtype=d).element_size()
                          for p, d in zip(pieces, self.dtypes, strict=True)]
        self.params = [params.get(p.param) for p in pieces]  # servers have them too
        self.stash: dict[int, tuple[torch.Tensor, torch.Tensor] | None] = {}
        self.pending: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.has_grad: dict[int, bool] = {}
        self.refresh_pending: tuple | None = None
        self.push_pending: tuple | None = None

    @property
    def P(self) -> int:
        return len(self.pieces)

    # -- worker: gradients ----------------------------------------------------------
    def stash_grad(self, pieces: list[PSPiece], idx: torch.Tensor | None,
                   vals: torch.Tensor | None) -> None:
        """Record this worker's (global row ids, rows) for ``pieces`` (None: no gradient)."""
        for p in pieces:
            i = self.pos[p.id]
            if idx is None:
                self.stash[i] = None
                continue
            lo, hi = p.row_start, p.row_start + p.rows
            mask = (idx >= lo) & (idx < hi)
            self.stash[i] = (idx[mask], vals[mask])

    def push(self) -> None:
        """Collective: send the stashed rows to their owners; owners accumulate them."""
        self.push_start()
        self.push_finish()

    def push_start(self) -> None:
        """Exchange counts and start the rows' all-to-all (:meth:`push_finish` waits)."""
        P, size = self.P, self.size
        counts = torch.zeros(size, P, dtype=torch.int64)
        if self.rank < self.workers:
            for i, p in enumerate(self.pieces):
                entry = self.stash.get(i)
                counts[p.owner, i] = -1 if entry is None else len(entry[0])
        recv = self._a2a_counts(counts)
        sends: list[list[torch.Tensor]] = [[] for _ in range(size)]
        for i, p in enumerate(self.pieces):
            entry = self.stash.get(i)
            if entry is not None and len(entry[0]):
                sends[p.owner] += [_bytes(entry[0]), _bytes(entry[1].to(self.dtypes[i]))]
        pos = counts.clamp_min(0)
        in_bytes = [int((pos[q] * (I64 + torch.tensor(self.row_bytes))).sum()) for q in range(size)]
        rpos = recv.clamp_min(0)
        out_bytes = [int((rpos[q] * (I64 + torch.tensor(self.row_bytes))).sum())
                     for q in range(size)]
        flat, work, data = self._a2a_bytes_async(sends, in_bytes, out_bytes)
        for q in range(size):
            if q != self.rank:
                self.stats.push_bytes += in_bytes[q] + P * I64
                self.stats.rows_pushed += int(pos[q].sum())
        self.stash.clear()
        self.push_pending = (flat, work, data, recv)

    def push_finish(self) -> None:
        """Wait for the rows; owners keep their shards' contributions."""
        if self.push_pending is None:
            return
        _flat, work, data, recv = self.push_pending
        self.push_pending = None
        self.group.wait(work, "pushing embedding gradients")
        size = self.size
        off = 0
        for q in range(size):
            for i, p in enumerate(self.pieces):
                n = int(recv[q, i])
                if p.owner != self.rank or q >= self.workers:
                    continue
                if n >= 0:
                    self.has_grad[i] = True
                if n <= 0:
                    continue
                idx = _as(data[off:off + n * I64], torch.int64, (n,))
                off += n * I64
                nb = n * self.row_bytes[i]
                vals = _as(data[off:off + nb], self.dtypes[i], (n, *self.row_shapes[i]))
                off += nb
                self.pending.setdefault(i, []).append((idx - p.row_start, vals))

    # -- owner: update --------------------------------------------------------------
    def attach_grads(self) -> list[int]:
        """Give each owned sparse shard its summed sparse gradient; returns their ids."""
        out = []
        for i, p in enumerate(self.pieces):
            if p.owner != self.rank:
                continue
            shard = self.shards[p.id]
            if not self.has_grad.get(i):
                shard.grad = None
                continue
            parts = self.pending.get(i, [])
            if parts:
                idx = torch.cat([a for a, _ in parts])
                vals = torch.cat([b for _, b in parts])
            else:
                idx = torch.empty(0, dtype=torch.int64)
                vals = torch.empty((0, *self.row_shapes[i]), dtype=self.dtypes[i])
            grad = torch.sparse_coo_tensor(idx.unsqueeze(0), vals, tuple(shard.shape),
                                           is_coalesced=False, check_invariants=False)
            shard.grad = grad.coalesce().to(shard.device)
            out.append(p.id)
        return out

    def clear(self) -> None:
        for p in self.pieces:
            if p.owner == self.rank:
                self.shards[p.id].grad = None
        self.pending.clear()
        self.has_grad.clear()

    # -- pull rounds ----------------------------------------------------------------
    def pull_round(self, requests: dict[int, torch.Tensor] | None) -> bool:
        """One collective round. ``requests``: piece position -> global row ids this
        worker needs (None: nothing, this rank is done). Returns True when no worker
        asked for anything (every worker is done)."""
        P, size, W = self.P, self.size, self.workers
        counts = torch.zeros(size, 2 + P, dtype=torch.int64)
        wanted: dict[int, torch.Tensor] = {}
        if requests is not None:
            counts[:, 0] = 1
            for i, ids in requests.items():
                p = self.pieces[i]
                if p.owner == self.rank or not len(ids):
                    continue
                wanted[i] = ids
                counts[p.owner, 2 + i] = len(ids)
            counts[:, 1] = sum(len(v) for v in wanted.values())
        recv = self._a2a_counts(counts)
        for q in range(size):
            if q != self.rank:
                self.stats.pull_bytes += (2 + P) * I64
        if int(recv[:W, 0].sum()) == 0:
            return True
        if int(recv[:W, 1].sum()) == 0:
            return False
        # requested ids
        sends = [[] for _ in range(size)]
        for i, ids in wanted.items():
            sends[self.pieces[i].owner].append(_bytes(ids))
        in_bytes = [int(counts[q, 2:].sum()) * I64 for q in range(size)]
        out_bytes = [int(recv[q, 2:].sum()) * I64 for q in range(size)]
        ids_in = self._a2a_bytes(sends, in_bytes, out_bytes, "requesting embedding rows")
        # serve
        replies = [[] for _ in range(size)]
        reply_bytes = [0] * size
        off = 0
        for q in range(size):
            for i, p in enumerate(self.pieces):
                n = int(recv[q, 2 + i])
                if n <= 0:
                    continue
                ids = _as(ids_in[off:off + n * I64], torch.int64, (n,))
                off += n * I64
                shard = self.shards[p.id]
                rows = shard.index_select(0, (ids - p.row_start).to(shard.device)).cpu()
                replies[q].append(_bytes(rows))
                reply_bytes[q] += n * self.row_bytes[i]
        expect = [sum(int(counts[q, 2 + i]) * self.row_bytes[i] for i in range(P))
                  for q in range(size)]
        rows_in = self._a2a_bytes(replies, reply_bytes, expect, "pulling embedding rows")
        off = 0
        for q in range(size):
            for i in range(P):
                n = int(counts[q, 2 + i])
                if n <= 0:
                    continue
                nb = n * self.row_bytes[i]
                rows = _as(rows_in[off:off + nb], self.dtypes[i], (n, *self.row_shapes[i]))
                off += nb
                write_rows(self.params[i], wanted[i], rows)
                self.stats.rows_pulled += n
            if q != self.rank:
                self.stats.pull_bytes += in_bytes[q] + expect[q]
        return False

    # -- refresh after update (local replication) -----------------------------------
    def send_updates(self, updated: dict[int, torch.Tensor]) -> None:
        """Collective: owners send the rows they changed (piece position -> local row ids)
        to every worker; workers apply them in :meth:`finish_updates`."""
        P, size, W = self.P, self.size, self.workers
        counts = torch.zeros(size, P, dtype=torch.int64)
        payload: list[torch.Tensor] = []
        for i, rows in sorted(updated.items()):
            p = self.pieces[i]
            shard = self.shards[p.id]
            vals = shard.index_select(0, rows.to(shard.device)).cpu()
            payload += [_bytes(rows.cpu() + p.row_start), _bytes(vals)]
            for q in range(W):
                if q != self.rank:
                    counts[q, i] = len(rows)
        recv = self._a2a_counts(counts)
        sends = [payload if (q < W and q != self.rank) else [] for q in range(size)]
        row = torch.tensor(self.row_bytes) + I64
        in_bytes = [int((counts[q] * row).sum()) for q in range(size)]
        out_bytes = [int((recv[q] * row).sum()) for q in range(size)]
        flat, work, out = self._a2a_bytes_async(sends, in_bytes, out_bytes)
        self.refresh_pending = (flat, work, out, recv)

    def finish_updates(self) -> None:
        if self.refresh_pending is None:
            return
        _flat, work, out, recv = self.refresh_pending
        self.refresh_pending = None
        self.group.wait(work, "receiving updated embedding rows")
        off = 0
        for q in range(self.size):
            for i in range(self.P):
                n = int(recv[q, i])
                if n <= 0:
                    continue
                idx = _as(out[off:off + n * I64], torch.int64, (n,))
                off += n * I64
                nb = n * self.row_bytes[i]
                rows = _as(out[off:off + nb], self.dtypes[i], (n, *self.row_shapes[i]))
                off += nb
                write_rows(self.params[i], idx, rows)
                self.stats.rows_pulled += n
                self.stats.pull_bytes += n * (I64 + self.row_bytes[i])

    # -- all-to-all helpers ---------------------------------------------------------
    def _a2a_counts(self, counts: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(counts)
        self.group.run(lambda: self.group.all_to_all(out, counts), "exchanging row counts")
        self.stats.collectives += 1
        return out

    def _a2a_bytes_async(self, sends: list[list[torch.Tensor]], in_bytes: list[int],
                         out_bytes: list[int]) -> tuple[torch.Tensor, object, torch.Tensor]:
        parts = [t for per in sends for t in per]
        flat = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
        assert flat.numel() == sum(in_bytes), (flat.numel(), in_bytes)
        out = torch.empty(sum(out_bytes), dtype=torch.uint8)
        work = self.group.all_to_all(out, flat, list(out_bytes), list(in_bytes))
        self.stats.collectives += 1
        return flat, work, out

    def _a2a_bytes(self, sends: list[list[torch.Tensor]], in_bytes: list[int],
                   out_bytes: list[int], what: str) -> torch.Tensor:
        _flat, work, out = self._a2a_bytes_async(sends, in_bytes, out_bytes)
        self.group.wait(work, what)
        return out

"""Sparse PS pieces: embedding rows travel as (row index, row) pairs, never whole tables.

All exchanges are all-to-alls over the group of every PS rank (workers and servers).

*Pull* (each embedding call in a training forward, ``local_replication: false``): a
*round* is two all-to-alls. The first is fixed-size: per peer a header (taking part, ids
asked in total, overflow, wanted capacity, ids per piece) followed by up to ``cap``
requested ids, ``cap`` being agreed by everyone from the previous step's headers for the
same round index (an id list longer than ``cap`` sends the rest in one more exchange). The
second carries the rows. A worker runs one round per call of an embedding module, asking
the owners for the call's unique ids it neither owns nor already asked for since its last
push; after its forward it runs closing rounds until every worker is done, so workers may
call embeddings in any order and number. Servers only serve.

*Push* (end of backward): the ids a worker asked an owner for since its last push are the
rows its gradient has there, and both sides know them. So the push is one all-to-all with
known sizes: per peer a small header, then for each announced id its gradient row and a
presence byte (rows without gradient, e.g. a padding index, are dropped by the owner). Rows
owned by the pushing rank never leave it. Rows beyond the announcements (a second backward
before the update, ``local_replication`` pieces) are flagged in the headers, which every
rank receives, and sent as (row index, row) pairs in one more exchange.

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
PULL_HEADER = 4  # taking part, ids asked in total, overflow, wanted capacity


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
        # pull rounds: id slots per peer for each round index of a forward (agreed)
        self.caps: list[int] = []
        self.round = 0
        # ids asked since the last push: worker side per piece, owner side per (worker, piece)
        self.announced: dict[int, list[torch.Tensor]] = {}
        self.expected: dict[tuple[int, int], list[torch.Tensor]] = {}
        self.extras: dict[int, list[torch.Tensor]] = {}

    @property
    def P(self) -> int:
        return len(self.pieces)

    # -- worker: gradients ----------------------------------------------------------
    def stash_grad(self, pieces: list[PSPiece], idx: torch.Tensor | None,
                   vals: torch.Tensor | None) -> None:
        """Record this worker's (global row ids, sorted; rows) for ``pieces`` (None: no
        gradient). Each piece's rows are a slice: one search finds every piece's bounds."""
        if idx is None or vals is None:
            for p in pieces:
                self.stash[self.pos[p.id]] = None
            return
        bounds = torch.tensor([b for p in pieces for b in (p.row_start, p.row_start + p.rows)],
                              dtype=idx.dtype)
        cuts = torch.searchsorted(idx, bounds).tolist()
        for k, p in enumerate(pieces):
            a, b = cuts[2 * k], cuts[2 * k + 1]
            self.stash[self.pos[p.id]] = (idx[a:b], vals[a:b])

    def push(self) -> None:
        """Collective: send the stashed rows to their owners; owners accumulate them."""
        self.push_start()
        self.push_finish()

    def _announced_ids(self, i: int) -> torch.Tensor:
        parts = self.announced.get(i)
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)

    def _expected_count(self, q: int, i: int) -> int:
        return sum(len(t) for t in self.expected.get((q, i), ()))

    def push_start(self) -> None:
        """Start the rows' all-to-all (:meth:`push_finish` waits)."""
        P, size, W = self.P, self.size, self.workers
        H = 1 + P  # any rows beyond the announcements; per piece: their number (-1: no grad)
        head = torch.zeros(size, H, dtype=torch.int64)
        rows: list[list[torch.Tensor]] = [[] for _ in range(size)]
        masks: list[list[torch.Tensor]] = [[] for _ in range(size)]
        self.extras = {}
        sent_rows = 0
        if self.rank < W:
            for i, p in enumerate(self.pieces):
                o, entry, ann = p.owner, self.stash.get(i), self._announced_ids(i)
                dtype, shape = self.dtypes[i], self.row_shapes[i]
                if o == self.rank:  # own rows: straight into the shard's gradient
                    if entry is not None:
                        self.has_grad[i] = True
                        self.pending.setdefault(i, []).append(
                            (entry[0] - p.row_start, entry[1].to(dtype)))
                    continue
                if entry is None:
                    head[o, 1 + i] = -1
                    idx = torch.empty(0, dtype=torch.int64)
                    vals = torch.empty((0, *shape), dtype=dtype)
                else:
                    idx, vals = entry[0], entry[1].to(dtype)
                if not len(ann):  # none announced (a replicated piece): every row extra
                    if len(idx):
                        head[o, 1 + i] = len(idx)
                        self.extras.setdefault(o, []).extend([_bytes(idx), _bytes(vals)])
                        sent_rows += len(idx)
                    continue
                out = torch.zeros((len(ann), *shape), dtype=dtype)
                found = torch.zeros(len(ann), dtype=torch.bool)
                covered = torch.zeros(len(idx), dtype=torch.bool)
                if len(idx):  # (idx is sorted: a coalesced gradient's)
                    pos = torch.searchsorted(idx, ann).clamp_max(len(idx) - 1)
                    found = idx[pos] == ann
                    out[found] = vals[pos[found]]
                    covered[pos[found]] = True
                rows[o].append(_bytes(out))
                masks[o].append(found.to(torch.uint8))
                sent_rows += int(found.sum())
                if entry is not None and not bool(covered.all()):
                    extra = ~covered
                    head[o, 1 + i] = int(extra.sum())
                    self.extras.setdefault(o, []).extend(
                        [_bytes(idx[extra]), _bytes(vals[extra])])
                    sent_rows += int(extra.sum())
            head[:, 0] = int(bool(self.extras))
        sends = []
        for q in range(size):
            m = torch.cat(masks[q]) if masks[q] else torch.empty(0, dtype=torch.uint8)
            pad = torch.zeros(-m.numel() % I64, dtype=torch.uint8)  # keep the next aligned
            sends.append([_bytes(head[q]), *rows[q], m, pad])
        in_bytes = [sum(t.numel() for t in per) for per in sends]
        out_bytes = [H * I64 + self._expected_bytes(q) for q in range(size)]
        flat, work, data = self._a2a_bytes_async(sends, in_bytes, out_bytes)
        for q in range(size):
            if q != self.rank:
                self.stats.push_bytes += in_bytes[q]
        self.stats.rows_pushed += sent_rows
        self.push_pending = (flat, work, data, dict(self.expected))
        self.stash.clear()
        self.announced.clear()
        self.expected.clear()

    def _expected_bytes(self, q: int) -> int:
        """Bytes of the announced rows worker ``q`` pushes to this owner (rows + masks)."""
        if q >= self.workers or q == self.rank:
            return 0
        n = [self._expected_count(q, i) if p.owner == self.rank else 0
             for i, p in enumerate(self.pieces)]
        masks = sum(n)
        return (sum(k * b for k, b in zip(n, self.row_bytes, strict=True))
                + masks + (-masks % I64))

    def push_finish(self) -> None:
        """Wait for the rows; owners keep their shards' contributions."""
        if self.push_pending is None:
            return
        _flat, work, data, expected = self.push_pending
        self.push_pending = None
        self.group.wait(work, "pushing embedding gradients")
        P, size, W = self.P, self.size, self.workers
        H = 1 + P
        owned = [i for i, p in enumerate(self.pieces) if p.owner == self.rank]
        heads, off = [], 0
        for q in range(size):
            h = _as(data[off:off + H * I64], torch.int64, (H,))
            off += H * I64
            heads.append(h)
            if q >= W or q == self.rank:
                continue
            ids = {i: (torch.cat(expected[(q, i)]) if (q, i) in expected
                       else torch.empty(0, dtype=torch.int64)) for i in owned}
            got = {}
            for i in owned:
                nb = len(ids[i]) * self.row_bytes[i]
                got[i] = _as(data[off:off + nb], self.dtypes[i], (len(ids[i]), *self.row_shapes[i]))
                off += nb
            nmask = 0
            for i in owned:
                n = len(ids[i])
                present = data[off + nmask:off + nmask + n].bool()
                nmask += n
                if int(h[1 + i]) >= 0:
                    self.has_grad[i] = True
                if n and bool(present.any()):
                    self.pending.setdefault(i, []).append(
                        (ids[i][present] - self.pieces[i].row_start, got[i][present]))
            off += nmask + (-nmask % I64)
        if any(int(h[0]) for h in heads):
            self._push_extras(heads, owned)

    def _push_extras(self, heads: list[torch.Tensor], owned: list[int]) -> None:
        """Collective: rows beyond the announcements, as (row index, row) pairs."""
        size, W = self.size, self.workers
        sends = [self.extras.get(q, []) for q in range(size)]
        in_bytes = [sum(t.numel() for t in per) for per in sends]
        out_bytes = [sum(max(0, int(heads[q][1 + i])) * (I64 + self.row_bytes[i])
                         for i in owned) if q < W and q != self.rank else 0
                     for q in range(size)]
        data = self._a2a_bytes(sends, in_bytes, out_bytes, "pushing embedding gradients")
        for q in range(size):
            if q != self.rank:
                self.stats.push_bytes += in_bytes[q]
        self.extras = {}
        off = 0
        for q in range(size):
            if q >= W or q == self.rank:
                continue
            for i in owned:
                n = max(0, int(heads[q][1 + i]))
                if not n:
                    continue
                idx = _as(data[off:off + n * I64], torch.int64, (n,))
                off += n * I64
                nb = n * self.row_bytes[i]
                vals = _as(data[off:off + nb], self.dtypes[i], (n, *self.row_shapes[i]))
                off += nb
                self.pending.setdefault(i, []).append((idx - self.pieces[i].row_start, vals))

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
    def begin_pulls(self) -> None:
        """A forward's pull phase starts (every rank, at the same point)."""
        self.round = 0

    def pull_round(self, requests: dict[int, torch.Tensor] | None) -> bool:
        """One collective round. ``requests``: piece position -> global row ids this
        worker needs (None: nothing, this rank is done). Returns True when no worker
        asked for anything (every worker is done)."""
        P, size, W = self.P, self.size, self.workers
        r = self.round
        self.round += 1
        cap = self.caps[r] if r < len(self.caps) else 0
        H = PULL_HEADER + P
        send = torch.zeros(size, H + cap, dtype=torch.int64)
        wanted: dict[int, torch.Tensor] = {}
        to_owner: dict[int, list[torch.Tensor]] = {}
        if requests is not None:
            send[:, 0] = 1
            for i in sorted(requests):  # piece order: the owner splits the ids the same way
                ids, p = requests[i], self.pieces[i]
                if p.owner == self.rank or not len(ids):
                    continue
                wanted[i] = ids
                send[p.owner, PULL_HEADER + i] = len(ids)
                to_owner.setdefault(p.owner, []).append(ids)
            send[:, 1] = sum(len(v) for v in wanted.values())
        asked = {o: torch.cat(v) for o, v in to_owner.items()}
        longest = max((len(v) for v in asked.values()), default=0)
        for o, ids in asked.items():
            send[o, H:H + min(len(ids), cap)] = ids[:cap]
        send[:, 2] = int(longest > cap)
        send[:, 3] = longest + longest // 4 + 8 if longest else 0
        recv = self._a2a_counts(send)
        for q in range(size):
            if q != self.rank:
                self.stats.pull_bytes += (H + cap) * I64
        # everyone saw everyone's wish: the same capacity for this round next time
        agreed = max(int(recv[:, 3].max()), cap * 3 // 4)
        if r < len(self.caps):
            self.caps[r] = agreed
        else:
            self.caps.append(agreed)
        if int(recv[:W, 0].sum()) == 0:
            return True
        if int(recv[:W, 1].sum()) == 0:
            return False
        # the counts as Python ints, once: indexing a tensor per (worker, piece) cost
        # 0.6 ms of CPU a round at 4 workers and 36 pieces
        asked_of = recv[:, PULL_HEADER:H].tolist()  # [q][i]: rows q asks of piece i
        asks = send[:, PULL_HEADER:H].tolist()  # [q][i]: rows this worker asks of q
        n_from = [sum(row) for row in asked_of]
        rest = None
        if bool(recv[:, 2].any()):  # somebody asked for more than ``cap``: the rest now
            sends = [[_bytes(asked[q][cap:])] if q in asked and len(asked[q]) > cap else []
                     for q in range(size)]
            in_bytes = [max(0, len(asked[q]) - cap) * I64 if q in asked else 0
                        for q in range(size)]
            out_bytes = [max(0, n_from[q] - cap) * I64 for q in range(size)]
            rest = self._a2a_bytes(sends, in_bytes, out_bytes, "requesting embedding rows")
            for q in range(size):
                if q != self.rank:
                    self.stats.pull_bytes += in_bytes[q]
        # serve
        replies: list[list[torch.Tensor]] = [[] for _ in range(size)]
        reply_bytes = [0] * size
        off_rest = 0
        for q in range(size):
            nq = n_from[q]
            if nq <= 0:
                continue
            ids_q = recv[q, H:H + min(nq, cap)]
            if nq > cap:
                k = nq - cap
                ids_q = torch.cat([ids_q, _as(rest[off_rest:off_rest + k * I64],
                                              torch.int64, (k,))])
                off_rest += k * I64
            o = 0
            for i, n in enumerate(asked_of[q]):
                if n <= 0:
                    continue
                p = self.pieces[i]
                ids = ids_q[o:o + n].clone()
                o += n
                self.expected.setdefault((q, i), []).append(ids)
                shard = self.shards[p.id]
                rows = shard.index_select(0, (ids - p.row_start).to(shard.device)).cpu()
                replies[q].append(_bytes(rows))
                reply_bytes[q] += n * self.row_bytes[i]
        expect = [sum(n * b for n, b in zip(asks[q], self.row_bytes, strict=True))
                  for q in range(size)]
        rows_in = self._a2a_bytes(replies, reply_bytes, expect, "pulling embedding rows")
        off = 0
        for q in range(size):
            for i, n in enumerate(asks[q]):
                if n <= 0:
                    continue
                nb = n * self.row_bytes[i]
                rows = _as(rows_in[off:off + nb], self.dtypes[i], (n, *self.row_shapes[i]))
                off += nb
                write_rows(self.params[i], wanted[i], rows)
                self.announced.setdefault(i, []).append(wanted[i])
                self.stats.rows_pulled += n
            if q != self.rank:
                self.stats.pull_bytes += expect[q]
        return False

    def not_yet_asked(self, i: int, ids: torch.Tensor) -> torch.Tensor:
        """``ids`` of piece position ``i`` this worker has not asked for since its last
        push (their values are current: no update happens between a pull and a push)."""
        parts = self.announced.get(i)
        if not parts:
            return ids
        return ids[~torch.isin(ids, torch.cat(parts))]

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
        for counts in recv.tolist():
            for i, n in enumerate(counts):
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

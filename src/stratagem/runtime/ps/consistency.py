"""Bounded staleness and asynchronous training: owners serve pushes and pulls as they come.

With ``sync: true, staleness: s > 0`` (stale-synchronous parallel) and ``sync: false``
(asynchronous) there is no global step: every owner runs a *service* (a background thread
on a worker that owns pieces; the main loop of a dedicated server) that receives messages
point to point over gloo and answers them:

``PUSH``  a worker's gradients for the owner's pieces (dense values, sparse rows) and its
          optimizers' current hyperparameters; the owner applies them at once as one
          optimizer step and advances that worker's *clock* (its number of pushes);
``PULL``  values a worker needs: all dense pieces, and/or the rows of given ids; answered
          once the owner's *version* -- the smallest clock over all workers, i.e. every
          worker's first ``version`` steps are applied -- is at least the worker's step
          ``t`` minus ``s`` (async: at once), tagged with that version;
``STOP``  the worker is done; the service ends when every worker has stopped.

So a worker at step ``t`` computes on values containing every worker's updates of steps
``< t - s``: no worker is more than ``s`` steps ahead of the slowest. Each push is applied
on its own (gradients pre-scaled by ``1/W``), which for SGD equals applying their average.
Dense values are prefetched right after the push when ``local_replication`` is set (a
worker-side cached copy refreshed after each update), else fetched when the next forward
starts; embedding rows are fetched when the embedding is called.

Wire format: a fixed int64 header ``[kind, src, step, nbytes, reqid, min_version, flags,
nhparams]`` (tag HDR, from any source) then the body bytes (tag BODY, from that source);
replies use their own groups and tags.
"""

from __future__ import annotations

import atexit
import contextlib
import sys
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from stratagem.errors import DistributedError
from stratagem.runtime.plan import Plan
from stratagem.runtime.ps.base import EngineBase
from stratagem.runtime.ps.cluster import IDLE_TIMEOUT, Cluster, Group, data_timeout
from stratagem.runtime.ps.dense import piece_view
from stratagem.runtime.ps.optim import ShardOptimizer, hparam_layout, pack_hparams, unpack_hparams
from stratagem.runtime.ps.plan import PSPiece
from stratagem.runtime.ps.sparse import write_rows
from stratagem.runtime.ps.state import from_bytes, to_bytes
from stratagem.runtime.stats import CommStats

HDR, BODY, RHDR, RBODY = 11, 12, 13, 14
PUSH, PULL, STOP, REPLY, RESTORE = 1, 2, 3, 4, 5
F_DENSE, F_SPARSE, F_FULL, F_STATE = 1, 2, 4, 8
HLEN = 8
I64 = 8


def _itemsize(piece: PSPiece) -> int:
    return torch.empty((), dtype=getattr(torch, piece.dtype)).element_size()


def _row_bytes(piece: PSPiece) -> int:
    return (piece.numel // max(piece.rows, 1)) * _itemsize(piece)


def _b(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(-1).cpu().view(torch.uint8)


class _Reader:
    """Sequential reads of typed chunks from a byte buffer."""

    def __init__(self, data: torch.Tensor) -> None:
        self.data = data
        self.off = 0

    def take(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        n = 1
        for d in shape:
            n *= d
        nbytes = n * torch.empty((), dtype=dtype).element_size()
        chunk = self.data[self.off:self.off + nbytes].clone()
        self.off += nbytes
        return chunk.view(dtype).view(shape)


class _Groups:
    """A private copy of an optimizer's hyperparameters (what the last push carried)."""

    def __init__(self, opt: torch.optim.Optimizer) -> None:
        self.param_groups = [{k: (v.clone() if isinstance(v, torch.Tensor) else v)
                              for k, v in g.items() if k != "params"}
                             for g in opt.param_groups]


class Owner:
    """The authoritative values of the pieces one rank owns, their optimizer and clocks."""

    def __init__(self, engine: AsyncEngine) -> None:
        rank = engine.rank
        self.engine = engine
        self.pieces = [p for p in engine.ps.pieces if p.owner == rank]
        self.dense = [p for p in self.pieces if not p.sparse]
        self.sparse = [p for p in self.pieces if p.sparse]
        self.shards = {p.id: piece_view(engine.params[p.param], p).detach().clone()
                       for p in self.pieces}
        entries = [(self.shards[p.id], *engine._loc[p.param], p.sparse,
                    f"node_config[{p.param}]") for p in self.pieces]
        self.optimizer = ShardOptimizer(engine.optimizers, entries) if entries else None
        self.hp = [_Groups(o) for o in engine.optimizers]
        if self.optimizer is not None:
            self.optimizer.user = self.hp  # mirror what the pushes carry
        self.hlayout = engine.hlayout
        self.clock = [0] * engine.W
        self.cond = threading.Condition()

    @property
    def version(self) -> int:
        return min(self.clock)

    @torch.no_grad()
    def apply_push(self, src: int, body: torch.Tensor) -> None:
        """Apply one worker's push as one optimizer step (caller holds ``cond``)."""
        r = _Reader(body)
        nh = sum(n for *_, n in self.hlayout)
        hp = r.take(torch.float64, (nh,)).tolist()
        present = r.take(torch.int64, (len(self.dense),)).tolist()
        for p, has in zip(self.dense, present, strict=True):
            vals = r.take(getattr(torch, p.dtype), p.shape)
            self.shards[p.id].grad = vals if has else None
        counts = r.take(torch.int64, (len(self.sparse),)).tolist()
        for p, n in zip(self.sparse, counts, strict=True):
            shard = self.shards[p.id]
            if n < 0:
                shard.grad = None
                continue
            idx = r.take(torch.int64, (n,))
            rows = r.take(getattr(torch, p.dtype), (n, *p.shape[1:]))
            shard.grad = torch.sparse_coo_tensor((idx - p.row_start).unsqueeze(0), rows,
                                                 tuple(shard.shape),
                                                 check_invariants=False).coalesce()
        if self.optimizer is not None:
            unpack_hparams(self.hp, self.hlayout, hp)
            self.optimizer.step()
        for shard in self.shards.values():
            shard.grad = None
        self.clock[src] += 1
        self.cond.notify_all()

    def read(self, flags: int, body: torch.Tensor | None) -> list[torch.Tensor]:
        """The values a PULL asks for, as byte chunks (caller holds ``cond``)."""
        out: list[torch.Tensor] = []
        if flags & F_STATE:
            return [to_bytes(self.engine._owned_payload(self.shards, self.optimizer))]
        if flags & F_FULL:
            return [_b(self.shards[p.id]) for p in (*self.dense, *self.sparse)]
        if flags & F_DENSE:
            out += [_b(self.shards[p.id]) for p in self.dense]
        if flags & F_SPARSE and body is not None:
            r = _Reader(body)
            counts = r.take(torch.int64, (len(self.sparse),)).tolist()
            for p, n in zip(self.sparse, counts, strict=True):
                if n > 0:
                    ids = r.take(torch.int64, (n,))
                    out.append(_b(self.shards[p.id].index_select(0, ids - p.row_start)))
        return out


class AsyncEngine(EngineBase):
    """Bounded-staleness / asynchronous PS on this rank (see the module docstring)."""

    def __init__(self, plan: Plan, module: nn.Module,
                 optimizers: Sequence[torch.optim.Optimizer], cluster: Cluster,
                 stats: CommStats) -> None:
        super().__init__(plan, module, optimizers, cluster, stats)
        ps = self.ps
        self.bound = ps.staleness if ps.sync else None  # None: no bound (asynchronous)
        ns = self.namespace = cluster.next_namespace()
        self.g_all = cluster.make_group(f"{ns}/all", range(ps.size))
        self.g_workers = cluster.make_group(f"{ns}/workers", range(self.W))
        self.services = sorted({*ps.owners, *range(self.W, ps.size)})
        self.g_to: dict[int, Group] = {}
        self.g_from: dict[int, Group] = {}
        for o in self.services:
            members = [*range(self.W), o]
            g = cluster.make_group(f"{ns}/to{o}", members, IDLE_TIMEOUT)
            if g is not None:
                self.g_to[o] = g
            g = cluster.make_group(f"{ns}/from{o}", members)
            if g is not None:
                self.g_from[o] = g
        self._broadcast_initial_state(self.g_all)
        self.hlayout = hparam_layout(self.optimizers)
        self.nh = sum(n for *_, n in self.hlayout)
        self.owner = Owner(self) if self.rank in self.services else None
        self.pieces_of_owner = {o: [p for p in ps.pieces if p.owner == o] for o in self.services}
        self.t = 0  # pushes done by this worker
        self.history: list[dict[str, Any]] = []  # per step: start, version seen, push time
        self._reqid = 0
        self._sends: list[tuple[Any, Group, tuple]] = []
        self._prefetch: dict[int, int] = {}  # owner -> reqid of an outstanding dense pull
        self._local: dict[int, tuple[int, torch.Tensor]] = {}  # requests to this rank
        self._dense_grads: dict[int, torch.Tensor | None] = {}
        self._sparse_grads: dict[int, tuple | None] = {}
        self._queued = False
        self._send_lock = threading.Lock()
        self._wait_lock = threading.Lock()
        self._waiting: list[tuple[int, int, int, int, torch.Tensor | None]] = []
        self._service: threading.Thread | None = None
        self._service_error: BaseException | None = None
        self._closed = False
        if not self.is_server:
            self._install_hooks()
            if self.owner is not None:
                self._service = threading.Thread(target=self._service_main,
                                                 name="stratagem-ps-service", daemon=True)
                self._service.start()
            atexit.register(_close_at_exit, weakref.ref(self))

    # -- client: forward -----------------------------------------------------------------
    @property
    def min_version(self) -> int:
        return -1 if self.bound is None else self.t - self.bound

    def before_forward(self) -> None:
        self._check_service()
        if self._queued:
            self._queued = False
            self._dense_grads.clear()
            self._sparse_grads.clear()
        if not torch.is_grad_enabled():
            return
        self.history.append({"step": self.t, "start": time.time(), "version": None})
        owners = [o for o in self.services if any(not p.sparse for p in
                                                   self.pieces_of_owner[o])]
        for o in owners:
            if o not in self._prefetch:
                self._prefetch[o] = self._request(o, F_DENSE)
        for o in owners:
            self._receive_dense(o, self._prefetch.pop(o))
        self.history[-1]["go"] = time.time()  # step t's values are in: compute

    def after_forward(self) -> None:
        pass

    def _on_embedding(self, name: str, module: nn.Module, ids: torch.Tensor) -> None:
        if not torch.is_grad_enabled():
            return
        flat = ids.reshape(-1)
        self.record_touched(name, module, flat)
        uniq = torch.unique(flat).cpu()
        by_owner: dict[int, dict[int, torch.Tensor]] = {}
        for p in self.by_param[name]:
            sel = uniq[(uniq >= p.row_start) & (uniq < p.row_start + p.rows)]
            if len(sel):
                by_owner.setdefault(p.owner, {})[p.id] = sel
        pending = []
        for o, wanted in by_owner.items():
            sparse = [p for p in self.pieces_of_owner[o] if p.sparse]
            counts = torch.tensor([len(wanted.get(p.id, ())) for p in sparse], dtype=torch.int64)
            body = [_b(counts)] + [_b(wanted[p.id]) for p in sparse if p.id in wanted]
            pending.append((o, wanted, sparse, self._request(o, F_SPARSE, body)))
        for o, wanted, sparse, reqid in pending:
            version, data = self._receive(o, reqid)
            r = _Reader(data)
            for p in sparse:
                if p.id in wanted:
                    ids_p = wanted[p.id]
                    rows = r.take(getattr(torch, p.dtype), (len(ids_p), *p.shape[1:]))
                    write_rows(self.params[p.param], ids_p, rows)
                    self.stats.rows_pulled += len(ids_p)
            self._saw(version)

    # -- client: backward ----------------------------------------------------------------
    def _on_grad(self, param: torch.Tensor) -> None:
        if not self.require_sync:
            return
        with self._lock:
            if not self._queued:
                self._queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
            name = self._name_of[id(param)]
            pieces = self.by_param.get(name)
            if pieces is None:
                return
            self._capture(name, pieces, param.grad, self.grad_weight / self.W)
            param.grad = None

    def _capture(self, name: str, pieces: list[PSPiece], grad: torch.Tensor | None,
                 factor: float) -> None:
        if pieces[0].sparse:
            idx, vals = self._sparse_rows(name, pieces[0], grad, factor)
            for p in pieces:
                if idx is None:
                    self._sparse_grads[p.id] = None
                    continue
                mask = (idx >= p.row_start) & (idx < p.row_start + p.rows)
                self._sparse_grads[p.id] = (idx[mask], vals[mask])
            return
        for p in pieces:
            if grad is None:
                self._dense_grads[p.id] = None
                continue
            g = grad.to_dense() if grad.is_sparse else grad
            if not p.whole:
                g = g.narrow(p.axis, p.start, p.length)
            self._dense_grads[p.id] = (g * factor).cpu()

    def _finish_backward(self) -> None:
        with self._lock:
            try:
                self._push()
            finally:
                self._queued = False
                self._dense_grads.clear()
                self._sparse_grads.clear()
                self._touched.clear()

    def _push(self) -> None:
        self._check_service()
        if self.history:
            self.history[-1]["done"] = time.time()  # step t's gradient is complete
        self._wait_sends()
        hp = torch.tensor(pack_hparams(self.optimizers, self.hlayout), dtype=torch.float64)
        for o in self.services:
            pieces = self.pieces_of_owner[o]
            dense = [p for p in pieces if not p.sparse]
            sparse = [p for p in pieces if p.sparse]
            grads = [self._dense_grads.get(p.id) for p in dense]
            present = torch.tensor([g is not None for g in grads], dtype=torch.int64)
            body = [_b(hp), _b(present)]
            body += [_b(g) if g is not None else torch.zeros(p.numel * _itemsize(p),
                                                             dtype=torch.uint8)
                     for p, g in zip(dense, grads, strict=True)]
            rows = [self._sparse_grads.get(p.id) for p in sparse]
            counts = torch.tensor([-1 if e is None else len(e[0]) for e in rows],
                                  dtype=torch.int64)
            body.append(_b(counts))
            for p, e in zip(sparse, rows, strict=True):
                if e is not None and len(e[0]):
                    body += [_b(e[0]), _b(e[1].to(getattr(torch, p.dtype)))]
                    if o != self.rank:
                        self.stats.rows_pushed += len(e[0])
            flat = torch.cat(body)
            if o == self.rank:
                with self.owner.cond:
                    self.owner.apply_push(self.rank, flat)
                self._answer_ready()  # requests waiting for this worker's step
                continue
            self.stats.push_bytes += flat.numel()
            self._send(o, PUSH, flat)
        self.t += 1
        if not self.plan.groups:
            self.stats.steps += 1
        # A worker-side cached copy refreshed after each update: prefetch dense values.
        for o in self.services:
            if any(not p.sparse and p.local_replication for p in self.pieces_of_owner[o]):
                self._prefetch[o] = self._request(o, F_DENSE)

    def on_step(self) -> None:
        """Nothing to do: owners applied the update when the push arrived."""

    # -- client: messages ----------------------------------------------------------------
    def _send(self, o: int, kind: int, body: torch.Tensor, reqid: int = 0,
              min_version: int = -1, flags: int = 0) -> None:
        hdr = torch.tensor([kind, self.rank, self.t, body.numel(), reqid, min_version, flags,
                            self.nh], dtype=torch.int64)
        g = self.g_to[o]
        works = [g.send(hdr, o, HDR)]
        if body.numel():
            works.append(g.send(body, o, BODY))
        self._sends += [(w, g, (hdr, body)) for w in works]

    def _wait_sends(self) -> None:
        for w, g, _ in self._sends:
            g.wait(w, f"sending to {g.cluster.describe(g.members[-1])}")
        self._sends.clear()

    def _request(self, o: int, flags: int, body: list[torch.Tensor] | None = None) -> int:
        """Send a PULL to owner ``o`` (handled locally when this rank owns it)."""
        self._reqid += 1
        flat = torch.cat(body) if body else torch.empty(0, dtype=torch.uint8)
        if o == self.rank:
            self._local[self._reqid] = (flags, flat)
            return self._reqid
        self.stats.pull_bytes += flat.numel() + HLEN * I64
        self._send(o, PULL, flat, self._reqid, self.min_version, flags)
        return self._reqid

    def _receive(self, o: int, reqid: int) -> tuple[int, torch.Tensor]:
        """The reply to request ``reqid``: (owner's version, value bytes)."""
        if o == self.rank:
            return self._local_read(*self._local.pop(reqid))
        g = self.g_from[o]
        hdr = torch.empty(HLEN, dtype=torch.int64)
        g.run(lambda: g.recv(hdr, o, RHDR), f"pulling from {g.cluster.describe(o)}")
        kind, _src, version, nbytes, rid = (int(v) for v in hdr[:5])
        if kind != REPLY or rid != reqid:
            raise DistributedError(f"out-of-order reply {rid} (expected {reqid}) from "
                                   f"{g.cluster.describe(o)}", where="parameter server",
                                   fix="this is a bug; please report it")
        data = torch.empty(nbytes, dtype=torch.uint8)
        if nbytes:
            g.run(lambda: g.recv(data, o, RBODY), f"pulling from {g.cluster.describe(o)}")
        self.stats.pull_bytes += nbytes + HLEN * I64
        return version, data

    def _local_read(self, flags: int, body: torch.Tensor | None) -> tuple[int, torch.Tensor]:
        owner = self.owner
        need = self.min_version
        with owner.cond:
            if not owner.cond.wait_for(lambda: owner.version >= need or
                                       self._service_error is not None,
                                       timeout=data_timeout().total_seconds()):
                raise DistributedError(f"waited {data_timeout()} for the other workers to "
                                       f"reach step {need}", where=self.cluster.describe(
                                           self.rank), fix="check for a stuck worker")
            self._check_service()
            chunks = owner.read(flags, body)
            version = owner.version
        return version, (torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.uint8))

    def _receive_dense(self, o: int, reqid: int) -> None:
        version, data = self._receive(o, reqid)
        r = _Reader(data)
        with torch.no_grad():
            for p in self.pieces_of_owner[o]:
                if not p.sparse:
                    vals = r.take(getattr(torch, p.dtype), p.shape)
                    piece_view(self.params[p.param], p).copy_(vals)
        self._saw(version)

    def _saw(self, version: int) -> None:
        if self.history:
            h = self.history[-1]
            h["version"] = version if h["version"] is None else min(h["version"], version)

    # -- service (owners) ----------------------------------------------------------------
    def _service_main(self) -> None:
        try:
            self._serve_loop()
        except BaseException as exc:  # noqa: BLE001 - reported to the main thread
            self._service_error = exc
            if self.owner is not None:
                with self.owner.cond:
                    self.owner.cond.notify_all()

    def _serve_loop(self) -> None:
        owner = self.owner
        g = self.g_to[self.rank]
        expected = self.W - (0 if self.is_server else 1)
        stops = 0
        while stops < expected:
            hdr = torch.empty(HLEN, dtype=torch.int64)
            g.run(lambda hdr=hdr: g.recv_any(hdr, HDR), "waiting for requests")
            kind, src, _step, nbytes, reqid, minv, flags, _nh = (int(v) for v in hdr)
            body = torch.empty(nbytes, dtype=torch.uint8)
            if nbytes:
                g.run(lambda body=body, src=src: g.recv(body, src, BODY),
                      f"receiving from {self.cluster.describe(src)}")
            if kind == STOP:
                stops += 1
                continue
            if kind == PUSH:
                with owner.cond:
                    owner.apply_push(src, body)
            elif kind == RESTORE:
                with owner.cond:
                    self._apply_owned(owner.shards, owner.optimizer, from_bytes(body))
                self._reply(src, reqid, owner.version, torch.empty(0, dtype=torch.uint8))
            elif kind == PULL:
                with self._wait_lock:
                    self._waiting.append((minv, src, reqid, flags, body if nbytes else None))
            self._answer_ready()
        self._answer_ready(force=True)

    def _answer_ready(self, force: bool = False) -> None:
        """Reply to the waiting pulls the owner's version now allows, oldest first (a
        worker's later request never overtakes its earlier one)."""
        owner = self.owner
        with self._wait_lock:
            left, blocked = [], set()
            for minv, src, reqid, flags, body in self._waiting:
                with owner.cond:
                    ready = src not in blocked and (force or owner.version >= minv)
                    if ready:
                        chunks = owner.read(flags, body)
                        version = owner.version
                if not ready:
                    blocked.add(src)
                    left.append((minv, src, reqid, flags, body))
                    continue
                data = torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.uint8)
                self._reply(src, reqid, version, data)
            self._waiting = left

    def _reply(self, dst: int, reqid: int, version: int, data: torch.Tensor) -> None:
        g = self.g_from[self.rank]
        hdr = torch.tensor([REPLY, self.rank, version, data.numel(), reqid, 0, 0, 0],
                           dtype=torch.int64)
        with self._send_lock:
            g.run(lambda: g.send(hdr, dst, RHDR), f"replying to {self.cluster.describe(dst)}")
            if data.numel():
                g.run(lambda: g.send(data, dst, RBODY),
                      f"replying to {self.cluster.describe(dst)}")

    def serve(self) -> None:
        """Dedicated server: the service loop, until every worker has sent STOP."""
        self._serve_loop()
        self.cluster.retire(self.namespace)

    def _check_service(self) -> None:
        if self._service_error is not None:
            err = self._service_error
            if isinstance(err, DistributedError):
                raise err
            raise DistributedError(f"the parameter-server service thread failed: {err}",
                                   where=self.cluster.describe(self.rank),
                                   fix="see the error above") from err

    # -- refresh and shutdown ------------------------------------------------------------
    def refresh(self) -> None:
        """Fetch every PS piece's current value from its owner (no staleness wait)."""
        for o, reqid in list(self._prefetch.items()):
            self._receive(o, reqid)
        self._prefetch.clear()
        with torch.no_grad():
            for o in self.services:
                pieces = self.pieces_of_owner[o]
                if not pieces:
                    continue
                if o == self.rank:
                    with self.owner.cond:
                        chunks = self.owner.read(F_FULL, None)
                    data = torch.cat(chunks)
                else:
                    self._reqid += 1
                    self._send(o, PULL, torch.empty(0, dtype=torch.uint8), self._reqid, -1,
                               F_FULL)
                    _, data = self._receive(o, self._reqid)
                r = _Reader(data)
                for p in (*[p for p in pieces if not p.sparse], *[p for p in pieces if p.sparse]):
                    vals = r.take(getattr(torch, p.dtype), p.shape)
                    piece_view(self.params[p.param], p).copy_(vals)

    def make_current(self) -> None:
        """Before ``state_dict()``: :meth:`refresh` (point to point, not collective)."""
        if not self._closed:
            self.refresh()

    def before_checkpoint(self) -> None:
        """Before saving, on this rank alone: :meth:`refresh` (point to point). The owners'
        optimizer state comes with ``optimizer.state_dict()`` (:meth:`pieces_state`)."""
        self.refresh()

    def pieces_state(self, pieces: Sequence[PSPiece]) -> dict[int, dict[str, Any]]:
        """The owners' optimizer state of ``pieces``, each as of this moment (point to
        point, from any worker)."""
        payload: dict[int, Any] = {}
        for o in sorted({p.owner for p in pieces}):
            _, data = self._receive(o, self._request(o, F_STATE))
            payload.update(from_bytes(data))
        return {p.id: payload[p.id]["state"] for p in pieces}

    def after_restore(self) -> None:
        """Collective, after every worker loaded the same checkpoint: owners take their
        slices of the loaded values and optimizer state (servers from the chief)."""
        for o, reqid in list(self._prefetch.items()):
            self._receive(o, reqid)
        self._prefetch.clear()
        if self.owner is not None:
            with self.owner.cond:
                self._apply_owned(self.owner.shards, self.owner.optimizer,
                                  self._slices(self.owner.pieces, values=True))
        if self.rank == 0:
            for o in self.services:
                if o >= self.W and self.pieces_of_owner[o]:
                    self._reqid += 1
                    self._send(o, RESTORE, to_bytes(self._slices(self.pieces_of_owner[o],
                                                                 values=True)), self._reqid)
                    self._receive(o, self._reqid)
        self._drop_user_state()
        flag = torch.zeros(1)
        self.g_workers.run(lambda: self.g_workers.all_reduce(flag), "restoring a checkpoint")

    def finish_pulls(self) -> None:
        """Nothing pending between steps that a state_dict() must wait for."""

    def close(self, wait_s: float | None = None) -> None:
        """Tell every owner this worker is done; an owning worker then waits for the
        others to finish (its service answers them until their STOP; at most ``wait_s``
        seconds, None: as long as it takes)."""
        if self._closed:
            return
        self._closed = True
        for o, reqid in list(self._prefetch.items()):
            with contextlib.suppress(Exception):
                self._receive(o, reqid)
        self._prefetch.clear()
        self._wait_sends()
        self._send_stops()
        if self._service is not None:
            self._service.join(wait_s)
            if not self._service.is_alive():
                self._check_service()
        self.remove_hooks()
        self.cluster.retire(self.namespace)

    def _send_stops(self) -> None:
        """STOP to every other owner and dedicated server: they count this worker done."""
        for o in self.services:
            if o != self.rank:
                self._send(o, STOP, torch.empty(0, dtype=torch.uint8))
        self._wait_sends()


def _close_at_exit(ref: weakref.ref) -> None:
    """Interpreter exit of a worker that did not close: every owner and dedicated server
    waits for each worker's STOP, and without it a dedicated server never ends. After an
    uncaught exception, or in the middle of a backward pass, only the STOPs are sent;
    otherwise the worker closes, serving the others (if it owns pieces) until they are
    done, at most the data timeout."""
    engine = ref()
    if engine is None or engine._closed:
        return
    with contextlib.suppress(Exception):  # at exit, peers may already be gone
        if engine._queued or getattr(sys, "last_value", None) is not None:
            engine._closed = True
            engine._sends.clear()  # (a failed step's sends are not waited for)
            engine._send_stops()
        else:
            engine.close(wait_s=data_timeout().total_seconds())

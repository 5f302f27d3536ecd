"""The bulk-synchronous parameter-server engine: one per rank, worker or server.

A step on a worker (``DistributedModel`` calls these):

``before_forward``  wait for the values broadcast after the last update and write them
                    into the local copy; announce the forward to the servers;
embedding hooks     one pull round per embedding call (rows this batch needs and has
                    not asked for since the last push);
``after_forward``   closing pull rounds until every worker is done, on a background
                    thread: this worker's backward starts at once while it keeps serving
                    rows to peers still in their forward (joined before the push);
gradient hooks      dense pieces go into their bucket as they become ready, a bucket is
                    reduced to its owner as soon as it (and the ones before it) is full;
end of backward     the rest of the buckets, then the sparse push; the worker's own
                    ``.grad`` of a PS parameter is left ``None`` (its optimizer skips it);
``on_step``         (``optimizer.step()`` pre-hook) owners apply their optimizer to their
                    shards and broadcast the new values (waited for in the next forward).

The chief (worker 0) tells dedicated servers which phase comes next with a small control
broadcast (phase, step, the optimizers' current hyperparameters); a server runs the same
engine in :meth:`serve`, taking part in every exchange with empty contributions.

Reads on one rank (``state_dict()``, evaluation forwards) need no other worker: stale
embedding rows come from the owners' fetch services (``fetch.py``), which every owner keeps
serving until all workers are done (:meth:`PSEngine.close`, also at interpreter exit).
"""

from __future__ import annotations

import atexit
import contextlib
import sys
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from stratagem import env
from stratagem.errors import StrategyError, UnsupportedModelError
from stratagem.runtime.plan import Plan
from stratagem.runtime.ps.background import Background
from stratagem.runtime.ps.base import EngineBase
from stratagem.runtime.ps.cluster import IDLE_TIMEOUT, Cluster, Group
from stratagem.runtime.ps.dense import DenseBucket, piece_view
from stratagem.runtime.ps.fetch import FetchClient, FetchService, recv_state, send_state
from stratagem.runtime.ps.optim import (
    ShardOptimizer,
    hparam_layout,
    pack_hparams,
    unpack_hparams,
)
from stratagem.runtime.ps.pacing import ReceivePacer, paced_buckets
from stratagem.runtime.ps.plan import PSPiece
from stratagem.runtime.ps.sparse import SparseExchange, write_rows
from stratagem.runtime.ps.state import export_state
from stratagem.runtime.stats import CommStats

PULL, PUSH, UPDATE, REFRESH, STOP, SCATTER, DISCARD = 1, 2, 3, 4, 5, 7, 8
CMD_NAMES = {PULL: "pull", PUSH: "push", UPDATE: "update", REFRESH: "refresh", STOP: "stop",
             SCATTER: "scatter", DISCARD: "discard"}
HEADER = 4  # cmd, step, arg, number of hyperparameter values
SLICE_TAG = 51  # a restored piece's values, chief -> dedicated server


def _queue_callback(fn: Callable[[], None]) -> None:
    torch.autograd.Variable._execution_engine.queue_callback(fn)


class _Stopper:
    """Sends STOP to the servers once (at close() or interpreter exit)."""

    def __init__(self, ctrl: Group | None, length: int) -> None:
        self.ctrl = ctrl
        self.length = length
        self.sent = False
        self.works: list[Any] = []

    def send(self, cmd: int, step: int = 0, arg: int = 0,
             hparams: Sequence[float] = ()) -> None:
        if self.ctrl is None or self.sent:
            return
        msg = torch.zeros(self.length, dtype=torch.float64)
        msg[0], msg[1], msg[2], msg[3] = cmd, step, arg, len(hparams)
        if hparams:
            msg[HEADER:HEADER + len(hparams)] = torch.tensor(hparams, dtype=torch.float64)
        self.works = [(w, m) for w, m in self.works if not w.is_completed()]
        self.works.append((self.ctrl.broadcast(msg, 0), msg))
        if cmd == STOP:
            self.sent = True

    def stop(self) -> None:
        try:
            self.send(STOP)
            for w, _ in self.works:
                w.wait()
        except Exception:  # noqa: BLE001 - at exit, peers may already be gone
            pass


class PSEngine(EngineBase):
    """Runs ``plan.ps`` (bulk-synchronous) on this rank. Workers: hooks on the model;
    servers: :meth:`serve`."""

    def __init__(self, plan: Plan, module: nn.Module,
                 optimizers: Sequence[torch.optim.Optimizer], cluster: Cluster,
                 stats: CommStats) -> None:
        super().__init__(plan, module, optimizers, cluster, stats)
        ps = self.ps
        if not ps.sync or ps.staleness:
            raise StrategyError(f"PS consistency mode {ps.mode!r} needs the consistency "
                                "engine", where=f"strategy {plan.strategy_id}",
                                fix="use stratagem.runtime.ps.make_engine")
        self.step_count = 0

        # Process groups: created in the same order on every rank (members only).
        ns = self.namespace = cluster.next_namespace()
        everyone = range(ps.size)
        self.g_all = cluster.make_group(f"{ns}/all", everyone)
        self.g_ctrl = (cluster.make_group(f"{ns}/ctrl", [0, *range(self.W, ps.size)],
                                          IDLE_TIMEOUT) if ps.servers else None)
        self.g_owner: dict[int, Group] = {}
        colocated = any(o < self.W for o in ps.owners)
        g_workers = cluster.make_group(f"{ns}/colocated", range(self.W)) if colocated else None
        for o in ps.owners:
            if o < self.W:
                if g_workers is not None:
                    self.g_owner[o] = g_workers
            else:
                g = cluster.make_group(f"{ns}/server{o}", [*range(self.W), o])
                if g is not None:
                    self.g_owner[o] = g

        self._broadcast_initial_state(self.g_all)

        # Owned shards and their optimizer.
        self.shards: dict[int, torch.Tensor] = {}
        entries = []
        for p in ps.pieces:
            if p.owner == self.rank:
                shard = piece_view(self.params[p.param], p)
                self.shards[p.id] = shard
                oi, gi = self._loc[p.param]
                entries.append((shard, oi, gi, p.sparse, f"node_config[{p.param}]"))
        self.shard_optimizer = ShardOptimizer(self.optimizers, entries) if entries else None
        self.hlayout = hparam_layout(self.optimizers) if ps.servers else []
        self.ctrl_len = HEADER + sum(n for *_, n in self.hlayout)
        self.stopper = _Stopper(self.g_ctrl if self.is_chief else None, self.ctrl_len)

        device = torch.device(plan.device)
        self._pacer = ReceivePacer(f"stratagem-ps-pace-{self.rank}", cluster.track)
        paced = paced_buckets(ps.buckets, self.W, env.ps_pace_bytes())
        self.buckets: list[DenseBucket] = []
        for b in ps.buckets:
            if b.owner not in self.g_owner:
                continue  # a server's bucket this server does not own
            pieces = [ps.pieces[i] for i in b.pieces]
            self.buckets.append(DenseBucket(b, pieces, self.params, self.g_owner[b.owner],
                                            self.rank, self.W, device, stats,
                                            self._pacer if b.id in paced else None))
        self.slot: dict[int, tuple[DenseBucket, int]] = {}
        for bucket in self.buckets:
            for i, p in enumerate(bucket.pieces):
                self.slot[p.id] = (bucket, i)
        self.sparse = (SparseExchange(list(ps.sparse), self.g_all, self.rank, self.W,
                                      self.params, self.shards, stats)
                       if ps.sparse else None)
        self.on_demand = [p for p in ps.sparse if not p.local_replication]
        self._closer = Background(f"stratagem-ps-pull-{self.rank}", cluster.track)
        self._closer_stats = CommStats()

        # Single-rank reads (fetch.py): a group per owner (on-demand rows and every owned
        # piece's optimizer state), its service.
        fetch_groups: dict[int, Group] = {}
        for o in sorted(ps.owners):
            g = cluster.make_group(f"{ns}/fetch{o}", [*range(self.W), o])
            if g is not None:
                fetch_groups[o] = g
        self.version = 0  # value changes (updates, restores): the same count on every rank
        positions = self.sparse.pos if self.sparse is not None else {}
        self.fetch_service = (FetchService(
            fetch_groups[self.rank], [p for p in self.on_demand if p.owner == self.rank],
            positions, self.shards, self.W, self._owned_state)
            if self.rank in fetch_groups else None)
        self.fetcher = (FetchClient(
            fetch_groups, list(ps.sparse), self.rank,
            self.sparse.row_bytes if self.sparse is not None else [],
            self.sparse.dtypes if self.sparse is not None else [])
            if fetch_groups and not self.is_server else None)
        # piece position -> (version, the rows known current then; None: all of them)
        self._fresh: dict[int, tuple[int, torch.Tensor | None]] = {
            self.sparse.pos[p.id]: (0, None) for p in self.on_demand}
        self._closed = False

        # Worker state.
        self._next = 0
        self._queued = False
        self._pushed = False  # a push happened since the last update
        self._push_open = False  # its reduces/all-to-alls may still be in flight
        self._pulling = False
        self._in_step = False  # a training forward since the last update (or skip)
        if not self.is_server:
            self._install_hooks()
            atexit.register(_close_at_exit, weakref.ref(self))

    # -- set-up --------------------------------------------------------------------------
    # -- forward -------------------------------------------------------------------------
    def before_forward(self) -> None:
        """Wait for pending pulls; start the pull phase of a training forward."""
        if self._queued:  # a backward pass failed before its end callback ran
            self._reset_backward()
        self._finish_push()
        self.finish_pulls()
        self._in_step = self._in_step or self._training_forward()
        if self._training_forward() and self.on_demand:
            if self.ps.servers and self.is_chief:
                self.stopper.send(PULL, self.step_count)
            self.sparse.begin_pulls()
            self._pulling = True

    def after_forward(self) -> None:
        """Start the closing pull rounds in the background (see :meth:`_join_closer`)."""
        if self._pulling:
            self._pulling = False
            # The thread counts apart: CommStats is shared with the main thread's hooks.
            self.sparse.stats = self._closer_stats
            self._closer.submit(self._closing_rounds)

    def _closing_rounds(self) -> None:
        while not self.sparse.pull_round(None):
            pass

    def _join_closer(self) -> None:
        """Wait for the closing pull rounds: before anything else uses the sparse group
        or the ids announced to this owner (push, next forward, update, refresh)."""
        if self.sparse is None or self.sparse.stats is self.stats:
            return
        try:
            self._closer.join()
        finally:
            self.sparse.stats = self.stats
            self.stats.add(self._closer_stats)
            self._closer_stats.reset()

    def _training_forward(self) -> bool:
        """A forward whose rows are pulled collectively: gradients on, training mode. Any
        other (evaluation) forward fetches its stale rows on its own (:meth:`_fetch_rows`)."""
        return torch.is_grad_enabled() and self.module.training

    def _on_embedding(self, name: str, module: nn.Module, ids: torch.Tensor) -> None:
        flat = ids.reshape(-1)
        if torch.is_grad_enabled():
            self.record_touched(name, module, flat)
        if not self._pulling:
            if not self._training_forward():
                self._fetch_rows(name, flat)
            return
        pieces = self.by_param[name]
        uniq = torch.unique(flat).cpu()  # the row exchange is staged in host memory
        requests = {}
        for p in pieces:
            if p.local_replication:
                continue
            i = self.sparse.pos[p.id]
            sel = uniq[(uniq >= p.row_start) & (uniq < p.row_start + p.rows)]
            requests[i] = self.sparse.not_yet_asked(i, sel)
        self.sparse.pull_round(requests)

    def finish_pulls(self) -> None:
        self._join_closer()
        for b in self.buckets:
            b.finish_pull()
        if self.sparse is not None:
            self.sparse.finish_updates()

    # -- backward ------------------------------------------------------------------------
    def _on_grad(self, param: torch.Tensor) -> None:
        if not self.require_sync:
            return
        with self._lock:
            if not self._queued:
                self._finish_push()  # (a second backward before optimizer.step())
                self._expect_push()
                self._queued = True
                _queue_callback(self._finish_backward)
                if self.is_chief and self.ps.servers:
                    self.stopper.send(PUSH, self.step_count)
            name = self._name_of[id(param)]
            pieces = self.by_param.get(name)
            if pieces is None:
                return
            factor = self.grad_weight / self.W / self.loss_scale
            if self.check_finite and param.grad is not None:
                g = param.grad._values() if param.grad.is_sparse else param.grad
                if not bool(torch.isfinite(g).all()):
                    self.nonfinite = True
            self._capture(name, pieces, param.grad, factor)
            param.grad = None
            self._launch_ready()

    def _capture(self, name: str, pieces: list[PSPiece], grad: torch.Tensor | None,
                 factor: float) -> None:
        if pieces[0].sparse:
            idx, vals = self._sparse_rows(name, pieces[0], grad, factor)
            self.sparse.stash_grad(pieces, idx, vals)
            return
        for p in pieces:
            bucket, i = self.slot[p.id]
            if bucket.captured[i]:
                raise UnsupportedModelError(
                    f"the gradient of {name!r} was accumulated twice in one backward pass",
                    where="DistributedModel backward",
                    fix="use torch.utils.checkpoint with use_reentrant=False")
            bucket.capture(i, grad, factor)

    def _expect_push(self) -> None:
        """Owners post every receive of this push before this rank sends (see dense.py)."""
        for b in self.buckets:
            b.expect_push()

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets) and self.buckets[self._next].pending == 0:
            self.buckets[self._next].launch()
            self.stats.overlapped += 1
            self._next += 1

    def _finish_backward(self) -> None:
        with self._lock:
            try:
                self._join_closer()
                for name, pieces in self.by_param.items():
                    if pieces[0].sparse:
                        if self.sparse.pos[pieces[0].id] not in self.sparse.stash:
                            self._capture(name, pieces, None, 1.0)
                        continue
                for b in self.buckets[self._next:]:
                    b.fill_missing()
                    b.launch()
                self._next = len(self.buckets)
                self._push_and_wait()
                if not self.plan.groups:  # else the all-reduce reducer counts the step
                    self.stats.steps += 1
            finally:
                self._reset_backward()

    def _push_and_wait(self) -> None:
        """Send the sparse rows; the waits (for them and the buckets' reduces) happen at
        the update, or before the buffers are needed again, so backward returns at once."""
        if self.sparse is not None:
            self.sparse.push_start()
        self._pushed = True
        self._push_open = True

    def _finish_push(self) -> None:
        if not self._push_open:
            return
        self._push_open = False
        if self.sparse is not None:
            self.sparse.push_finish()
        for b in self.buckets:
            b.finish_push()

    def _reset_backward(self) -> None:
        self._queued = False
        self._next = 0
        self._touched.clear()
        for b in self.buckets:
            b.captured = [False] * len(b.pieces)
            b.pending = len(b.pieces)

    # -- update --------------------------------------------------------------------------
    def on_step(self) -> None:
        """Owners apply the update and broadcast the values (optimizer.step() pre-hook)."""
        if not self._pushed:
            return
        if self.is_chief and self.ps.servers:
            self.stopper.send(UPDATE, self.step_count, 0,
                              pack_hparams(self.optimizers, self.hlayout))
        self._update()

    def _update(self) -> None:
        """Dense shards first: their values travel back while this rank still waits for
        (and applies) the sparse rows, whose push is usually the later one to arrive."""
        self._join_closer()  # (a training forward after the backward: its closing rounds)
        for b in self.buckets:
            b.finish_push()
        for b in self.buckets:  # receives first, before any owner sends (see dense.py)
            b.expect_values()
        self._pushed = False
        self._in_step = False
        self.nonfinite = False
        self.step_count += 1
        owned = [b for b in self.buckets if b.is_owner]
        for b in owned:
            b.attach_grads(self.shards)
        if owned:
            self.shard_optimizer.step(sparse=False)
        for b in owned:
            b.clear_grads(self.shards)
        for b in owned:
            b.post_values(self.shards)
        self._finish_push()  # the sparse rows (the buckets are done)
        if self.sparse is None:
            self._values_changed()
            return
        updated_sparse: dict[int, torch.Tensor] = {}
        sparse_ids = self.sparse.attach_grads()
        if sparse_ids:  # (this owner's pieces that have a gradient)
            for pid in sparse_ids:
                if self.ps.pieces[pid].local_replication:
                    updated_sparse[self.sparse.pos[pid]] = self._updated_rows(pid)
            self.shard_optimizer.step(sparse=True)
        self.sparse.clear()
        self._values_changed()
        if any(p.local_replication for p in self.ps.sparse):
            self.sparse.send_updates(updated_sparse)

    def discard(self) -> None:
        """A skipped step (a GradScaler found inf/NaN, on every rank alike): owners drop
        the gradients pushed since the last update instead of applying them."""
        self.nonfinite = False
        if not self._pushed:
            return
        if self.is_chief and self.ps.servers:
            self.stopper.send(DISCARD, self.step_count)
        self._discard()

    def _discard(self) -> None:
        self._join_closer()
        self._finish_push()
        for b in self.buckets:
            b.finish_push()
            if b.acc is not None:
                b.acc.zero_()
                b.pushed = False
        if self.sparse is not None:
            self.sparse.clear()
        self._pushed = False
        self._in_step = False

    def _values_changed(self) -> None:
        """Every rank, after each update and restore: workers' copies of rows they did not
        pull are stale from here on; the service answers fetches of this version."""
        self.version += 1
        if self.fetch_service is not None:
            self.fetch_service.advance()

    # -- single-rank reads ---------------------------------------------------------------
    def make_current(self) -> None:
        """This worker's copy of every PS parameter becomes current, without the other
        workers: pending values are waited for (their owners sent them at the update),
        stale embedding rows fetched from their owners' services. Called before
        ``state_dict()`` (a pre-hook) and by :meth:`close`."""
        if self.is_server or self._queued or self._closed:
            return
        self.finish_pulls()
        if self.fetcher is None:
            return
        self._fetch({i: None for i, p in enumerate(self.ps.sparse)
                     if not p.local_replication and p.owner != self.rank
                     and self._fresh.get(i) != (self.version, None)})

    def _fetch_rows(self, name: str, flat: torch.Tensor) -> None:
        """An evaluation forward's embedding call: fetch the rows it reads that may be
        stale (not owned, not pulled or fetched since the last update)."""
        if self.fetcher is None or self._closed:
            return
        uniq = torch.unique(flat).cpu()
        requests: dict[int, torch.Tensor | None] = {}
        for p in self.by_param[name]:
            if p.local_replication or p.owner == self.rank:
                continue
            i = self.sparse.pos[p.id]
            version, have = self._fresh.get(i, (-1, None))
            if version == self.version and have is None:
                continue
            sel = self.sparse.not_yet_asked(i, uniq[(uniq >= p.row_start)
                                                    & (uniq < p.row_start + p.rows)])
            if version == self.version:
                sel = sel[~torch.isin(sel, have)]
            if len(sel):
                requests[i] = sel
        self._fetch(requests)

    @torch.no_grad()
    def _fetch(self, requests: dict[int, torch.Tensor | None]) -> None:
        if not requests:
            return
        rows = self.fetcher.fetch(requests, self.version)
        for i, ids in requests.items():
            p = self.ps.sparse[i]
            param = self.params[p.param]
            if ids is None:
                piece_view(param, p).copy_(rows[i].to(param.device))
                self._fresh[i] = (self.version, None)
                continue
            write_rows(param, ids, rows[i])
            version, have = self._fresh.get(i, (-1, None))
            self._fresh[i] = (self.version, ids if version != self.version
                              else torch.cat([have, ids]))

    def _all_fresh(self) -> None:
        """Every worker's copy is complete (after a refresh or a restore)."""
        self._fresh = {i: (self.version, None) for i in self._fresh}

    def _updated_rows(self, pid: int) -> torch.Tensor:
        """Local rows the coming update changes: the gradient's, plus for SGD with momentum
        every row with a momentum buffer (torch's sparse SGD keeps moving them)."""
        shard = self.shards[pid]
        rows = shard.grad.coalesce().indices()[0]
        for opt, _, _ in self.shard_optimizer.optimizers:
            buf = opt.state.get(shard, {}).get("momentum_buffer")
            if buf is not None and buf.is_sparse:
                rows = torch.unique(torch.cat([rows, buf.coalesce().indices()[0]]))
        return rows

    # -- whole-value refresh -------------------------------------------------------------
    def refresh(self) -> None:
        """Collective: every worker's copy of every PS parameter becomes the owners'."""
        self._finish_push()
        self.finish_pulls()
        if self.is_chief and self.ps.servers:
            self.stopper.send(REFRESH, self.step_count)
        self._refresh()

    @torch.no_grad()
    def _refresh(self) -> None:
        for p in self.ps.pieces:
            g = self.g_owner.get(p.owner)
            if g is None:
                continue
            if p.owner == self.rank:
                buf = self.shards[p.id].detach().cpu().clone()
            else:
                buf = torch.empty(p.shape, dtype=getattr(torch, p.dtype))
            g.run(lambda g=g, buf=buf, p=p: g.broadcast(buf, p.owner),
                  f"refreshing {p.param} from {self.cluster.describe(p.owner)}")
            if p.owner != self.rank and self.rank < self.W:
                piece_view(self.params[p.param], p).copy_(buf)
        self._all_fresh()

    # -- checkpoints ---------------------------------------------------------------------
    def before_checkpoint(self) -> None:
        """Before saving, on this rank alone: its copy of every PS parameter becomes current.
        The owners' optimizer state comes with ``optimizer.state_dict()`` (a pre-hook, see
        base.py), fetched from their services: no other worker takes part."""
        self.make_current()

    def _owned_state(self, pid: int) -> dict[str, Any]:
        """An owned piece's optimizer state, detached on the CPU (the fetch service's)."""
        if self.shard_optimizer is None:
            return {}
        return export_state(self.shard_optimizer.state_of(self.shards[pid]))

    def pieces_state(self, pieces: Sequence[PSPiece]) -> dict[int, dict[str, Any]]:
        """The optimizer state of ``pieces`` as their owners hold it after this worker's
        last update: owned ones from here, the others from their owners' services."""
        if self._closed or self.fetcher is None and any(p.owner != self.rank for p in pieces):
            raise StrategyError(
                "the optimizer state of parameter-server parameters lives on their owners, "
                "and this worker has closed its connection to them",
                where="optimizer.state_dict()",
                fix="save the optimizer before DistributedModel.close()")
        self._finish_push()
        self.finish_pulls()
        return {p.id: (self._owned_state(p.id) if p.owner == self.rank
                       else self.fetcher.state(p, self.version)) for p in pieces}

    def after_restore(self) -> None:
        """Collective, after every worker loaded the same checkpoint into the model and
        optimizer: owners take their slices (servers get theirs from the chief)."""
        self._finish_push()
        self.finish_pulls()
        for b in self.buckets:  # gradients pushed before the restore are dropped
            if b.acc is not None:
                b.acc.zero_()
        if self.sparse is not None:
            self.sparse.clear()
        self._pushed = False
        if self.is_chief and self.ps.servers:
            self.stopper.send(SCATTER, self.step_count)
        self._scatter()

    def _scatter(self) -> None:
        """Owners take their slices; only then does the version advance (a fetch waiting
        for it must see the restored state, not the one before)."""
        if self.rank == 0:
            for o in self.ps.owners:
                if o >= self.W:
                    self._send_slices(o)
        if self.is_server:
            if self.rank in self.ps.owners:
                self._apply_owned(self.shards, self.shard_optimizer, self._recv_slices())
            self._values_changed()
            return
        if self.shards:  # (values: the shards are views of the loaded parameters)
            self._apply_owned(self.shards, self.shard_optimizer,
                              self._slices(list(self.ps.owned_by(self.rank)), values=False))
        self._drop_user_state()
        self._values_changed()
        self._all_fresh()  # (the loaded values are complete)

    def _send_slices(self, o: int) -> None:
        """Chief: dedicated server ``o``'s share of the loaded values and optimizer state,
        piece by piece as plain tensors (nothing pickled)."""
        g = self.g_owner[o]
        what = f"restoring {self.cluster.describe(o)}"
        for entry in self._slices(list(self.ps.owned_by(o)), values=True).values():
            value = entry["value"].contiguous()
            g.run(lambda v=value: g.send(v, o, SLICE_TAG), what)
            send_state(g, o, entry["state"], what)

    def _recv_slices(self) -> dict[int, dict[str, Any]]:
        """Dedicated server: what :meth:`_send_slices` sent, checked against each piece."""
        g = self.g_owner[self.rank]
        out = {}
        for p in self.ps.owned_by(self.rank):
            value = torch.empty(p.shape, dtype=getattr(torch, p.dtype))
            g.run(lambda v=value: g.recv(v, 0, SLICE_TAG), "receiving restored values")
            out[p.id] = {"value": value,
                         "state": recv_state(g, 0, p, "receiving restored optimizer state")}
        return out

    # -- server loop ---------------------------------------------------------------------
    def serve(self) -> None:
        """Dedicated server: follow the chief's phases until it sends STOP."""
        msg = torch.zeros(self.ctrl_len, dtype=torch.float64)
        while True:
            self.g_ctrl.run(lambda: self.g_ctrl.broadcast(msg, 0), "waiting for the chief")
            cmd, nh = int(msg[0]), int(msg[3])
            if cmd == STOP:
                self.finish_pulls()
                self._pacer.stop()
                if self.fetch_service is not None:  # until the workers are done reading
                    self.fetch_service.linger()
                self.cluster.retire(self.namespace)
                return
            if cmd == PULL:
                self.finish_pulls()
                self.sparse.begin_pulls()
                while not self.sparse.pull_round(None):
                    pass
            elif cmd == PUSH:
                self.finish_pulls()
                self._finish_push()
                self._expect_push()
                for b in self.buckets:
                    b.fill_missing()
                    b.launch()
                self._push_and_wait()
                self._finish_push()
                self._reset_backward()
            elif cmd == UPDATE:
                unpack_hparams(self.optimizers, self.hlayout,
                               msg[HEADER:HEADER + nh].tolist())
                self.finish_pulls()
                self._update()
            elif cmd == REFRESH:
                self.finish_pulls()
                self._refresh()
            elif cmd == DISCARD:
                self.finish_pulls()
                self._discard()
            elif cmd == SCATTER:
                self.finish_pulls()
                self._scatter()
            else:
                raise RuntimeError(f"unknown parameter-server command {cmd}")

    def close(self, current: bool = True) -> None:
        """Finish pending traffic, make this worker's copy current (``current``), tell the
        owners this worker is done and release the servers (the chief sends STOP); an
        owning worker then serves fetches until every other worker is done too."""
        if self._closed:
            return
        self._finish_push()
        if current:
            self.make_current()
        else:
            self.finish_pulls()
        self._closed = True
        self.remove_hooks()
        self._closer.stop()
        self._pacer.stop()
        if self.fetcher is not None:
            self.fetcher.close()
        if self.is_chief:
            self.stopper.stop()
        if self.fetch_service is not None:
            self.fetch_service.linger()
        self.cluster.retire(self.namespace)


def _close_at_exit(ref: weakref.ref) -> None:
    """Interpreter exit of a worker: close without fetching, so peers still reading are
    served. Mid-step (a training forward or backward without its update) or after an
    uncaught exception only release the servers: peers may be waiting for this rank in the
    step, and must see it go at once (the failure is what they report)."""
    engine = ref()
    if engine is None:
        return
    with contextlib.suppress(Exception):  # at exit, peers may already be gone
        mid_step = engine._in_step or engine._pushed or engine._queued
        if mid_step or getattr(sys, "last_value", None) is not None:
            if engine.is_chief:
                engine.stopper.stop()
            if engine.fetch_service is not None:
                engine.fetch_service.stop()
            return
        engine.close(current=False)

"""Who is who in a parameter-server job, and the gloo groups the PS runtime talks over.

**Rank layout.** Every process has a *logical rank*: the workers are ``0..W-1`` in
``graph_config.replicas`` order, the dedicated servers ``W..W+S-1`` in server order. A
process learns its role from ``STRATAGEM_ROLE`` (``server`` on nodes with ``workers: 0``,
set by the launcher; default ``worker``), its node from ``STRATAGEM_NODE_ADDRESS`` and its
index on the node from ``LOCAL_RANK``. :func:`join_cluster` publishes these in the
rendezvous store, maps every process to its logical rank (by node address when all
processes give one, else by launcher rank), and makes the workers' default process group
(workers only, ``RANK`` = logical rank), so that the rest of Stratagem and user code see a
world of W workers. Servers get no default group.

**Groups.** The PS runtime never uses the default group: it builds its own gloo process
groups straight from the store (``ProcessGroupGloo(PrefixStore(...))``) over logical ranks,
so servers can join them and their collectives never interleave with the all-reduce ones.

**Failure.** Each process refreshes a heartbeat key in the store every second. When a gloo
operation fails (a peer closed its connection), :meth:`Cluster.explain` looks for the rank
whose heartbeat stopped and the error names it (role, device, rank).

**Exit.** No thread may be inside a torch call when the interpreter finalizes: a call that
returns then (its peer answered or left) ends the thread through a forced unwind that C++
turns into ``std::terminate``, and a run that finished aborts ("terminate called without
an active exception"). So at exit, after the runtimes' own exit handlers, a cluster stops
its heartbeat, wakes every thread it tracks (:meth:`Cluster.track`) by interrupting its
groups (:meth:`Group.interrupt`) and joins them (:meth:`Cluster.quiesce`).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from stratagem import env
from stratagem.distributed.gloo_threads import Yielding, new_loops
from stratagem.distributed.process_group import init_process_group, watch_world
from stratagem.errors import DistributedError

ENV_ROLE = env.ROLE
ENV_NODE_ADDRESS = env.NODE_ADDRESS
ENV_TIMEOUT = env.PG_TIMEOUT  # (STRATAGEM_PS_TIMEOUT: its deprecated older name)
DEFAULT_TIMEOUT_S = env.DEFAULT_PG_TIMEOUT_S  # a data operation that takes longer: a hang
IDLE_TIMEOUT = timedelta(days=7)  # servers waiting for the next command
HEARTBEAT_S = 1.0
STALE_S = 3.0
QUIESCE_S = 5.0  # at exit, the longest wait for woken threads to leave torch
INTERRUPT_TAG = (1 << 31) - 1  # never sent: the receive that times out on purpose


def data_timeout() -> timedelta:
    """The job's one process-group timeout (:func:`stratagem.env.pg_timeout`)."""
    return env.pg_timeout()


@dataclass(frozen=True)
class Layout:
    """Launcher (global) rank of every logical rank: workers first, then servers."""

    workers: tuple[int, ...]
    servers: tuple[int, ...] = ()

    @classmethod
    def canonical(cls, workers: int, servers: int = 0) -> Layout:
        return cls(tuple(range(workers)), tuple(range(workers, workers + servers)))

    @property
    def size(self) -> int:
        return len(self.workers) + len(self.servers)

    def logical(self, global_rank: int) -> int:
        return (*self.workers, *self.servers).index(global_rank)


def assign_layout(infos: Sequence[dict], replicas: Sequence[str], servers: Sequence[str]
                  ) -> Layout:
    """Map processes (``role``, ``address``, ``local_rank``, ``rank``) to logical ranks.

    With every process's node address known, replica ``ADDR:KIND:i`` gets the worker with
    the i-th smallest local rank on ``ADDR`` and server ``ADDR:PS:0`` the server on ``ADDR``;
    otherwise workers and servers keep launcher-rank order.
    """
    W, S = len(replicas), len(servers)
    workers = sorted((i for i in infos if i["role"] != "server"), key=lambda i: i["rank"])
    servs = sorted((i for i in infos if i["role"] == "server"), key=lambda i: i["rank"])
    if len(workers) != W or len(servs) != S:
        raise DistributedError(
            f"{len(workers)} worker and {len(servs)} server processes joined, but the "
            f"resource spec has {W} workers and {S} servers", where="parameter-server layout",
            fix=f"start one process per worker and one with {ENV_ROLE}=server per node "
                "with 'workers: 0' (`stratagem run` does this)")
    if all(i.get("address") for i in infos):
        def by_node(procs: list[dict], devices: Sequence[str]) -> tuple[int, ...]:
            pool: dict[str, list[dict]] = {}
            for p in sorted(procs, key=lambda p: (p["local_rank"], p["rank"])):
                pool.setdefault(p["address"], []).append(p)
            out = []
            for d in devices:
                addr = d.rsplit(":", 2)[0]
                if not pool.get(addr):
                    raise DistributedError(
                        f"no process left on node {addr} for {d}",
                        where="parameter-server layout",
                        fix=f"check {ENV_NODE_ADDRESS} and the node's 'workers' in the spec")
                out.append(pool[addr].pop(0)["rank"])
            return tuple(out)

        return Layout(by_node(workers, replicas), by_node(servs, servers))
    return Layout(tuple(i["rank"] for i in workers), tuple(i["rank"] for i in servs))


class Cluster:
    """This process's logical rank, the devices of all ranks, and a store for PS groups."""

    _instances = 0

    def __init__(self, store: dist.Store, rank: int, replicas: Sequence[str],
                 servers: Sequence[str], namespace: str = "stratagem") -> None:
        self.store = store
        self.rank = rank
        self.replicas = tuple(replicas)
        self.servers = tuple(servers)
        self.namespace = namespace
        self._hb_stop = threading.Event()
        self._known_dead: list[int] = []  # filled by the heartbeat thread
        self._hb_thread: threading.Thread | None = None
        self._groups: dict[str, list[Group]] = {}  # runtime namespace -> its groups
        self._retired: list[str] = []  # namespaces of runtimes this rank is done with
        # threads waiting on this rank's groups, and how to end each one's idle wait
        self._threads: list[tuple[threading.Thread, Callable[[], None] | None]] = []

    # -- who is who -----------------------------------------------------------------
    @property
    def workers(self) -> int:
        return len(self.replicas)

    @property
    def size(self) -> int:
        return len(self.replicas) + len(self.servers)

    @property
    def role(self) -> str:
        return "worker" if self.rank < self.workers else "server"

    def device(self, rank: int) -> str:
        return (*self.replicas, *self.servers)[rank]

    def describe(self, rank: int) -> str:
        role = "worker" if rank < self.workers else "server"
        return f"{role} {self.device(rank)} (rank {rank})"

    # -- groups -----------------------------------------------------------------------
    def next_namespace(self) -> str:
        """A fresh store prefix; every process creates PS runtimes in the same order."""
        Cluster._instances += 1
        return f"{self.namespace}/ps{Cluster._instances}"

    def make_group(self, prefix: str, members: Sequence[int],
                   timeout: timedelta | None = None) -> Group | None:
        """A gloo group over ``members`` (logical ranks); None if this rank is not one."""
        members = tuple(sorted(set(members)))
        if self.rank not in members:
            return None
        group = Group(self, prefix, members, timeout or data_timeout())
        self._groups.setdefault(prefix.rsplit("/", 1)[0], []).append(group)
        if members == tuple(range(self.size)):
            # Every rank connected to it, so every rank is past the runtimes it retired
            # before this one: nobody sends on their groups any more.
            self._release_retired()
        return group

    def retire(self, namespace: str) -> None:
        """This rank is done with the runtime of ``namespace`` (closed, or served to its
        STOP). Its groups -- gloo connections and threads, a dozen per runtime -- are shut
        down when the next runtime's first all-ranks group forms, not at once: a peer may
        still be finishing its own close on them. Trial steps and benchmarks create a
        runtime per candidate; without this each one's threads outlived it."""
        if namespace in self._groups and namespace not in self._retired:
            self._retired.append(namespace)

    def _release_retired(self) -> None:
        for namespace in self._retired:
            for group in self._groups.pop(namespace, []):
                group.release()
        self._retired.clear()

    # -- exit --------------------------------------------------------------------------
    def track(self, thread: threading.Thread, stop: Callable[[], None] | None = None
              ) -> None:
        """``thread`` waits on this cluster's groups: :meth:`quiesce` wakes and joins it
        (``stop``: also ends its idle wait for more work, if it has one)."""
        self._threads = [(t, s) for t, s in self._threads if t.is_alive()]
        self._threads.append((thread, stop))

    def quiesce(self) -> None:
        """Interpreter exit, after the runtimes' exit handlers (owners have served their
        readers): stop the heartbeat, interrupt every group this rank still holds and wait
        (at most :data:`QUIESCE_S`) for the heartbeat and the tracked threads to leave
        torch -- see the module's *Exit*. The groups are unusable afterwards."""
        self._hb_stop.set()
        for _, stop in self._threads:
            if stop is not None:
                stop()
        for groups in self._groups.values():
            for group in groups:
                group.interrupt()
        join_all([self._hb_thread, *(t for t, _ in self._threads)])

    # -- heartbeat and failure explanation ---------------------------------------------
    def start_heartbeat(self) -> None:
        if self._hb_thread is not None:
            return
        key = f"{self.namespace}/hb/{self.rank}"
        dead_key, seen_key = f"{self.namespace}/dead", f"{self.namespace}/explained/{self.rank}"
        store, stop, known = self.store, self._hb_stop, self._known_dead

        def beat() -> None:
            while not stop.is_set():
                try:
                    store.set(key, repr(time.time()))
                    # a peer named a dead rank: remember it, for when this process notices
                    # (maybe only once the store's host has exited)
                    if not known and store.check([dead_key]):
                        known.extend(json.loads(store.get(dead_key).decode()))
                        store.set(seen_key, "1")
                except Exception:  # noqa: BLE001 - the store host is gone; nothing to do
                    return
                stop.wait(HEARTBEAT_S)

        self._hb_thread = threading.Thread(target=beat, name="stratagem-heartbeat",
                                           daemon=True)
        self._hb_thread.start()
        weakref.finalize(self, stop.set)
        atexit.register(_quiesce_at_exit, weakref.ref(self))  # after the runtimes' hooks

    def dead_peers(self, candidates: Sequence[int], wait: float = STALE_S + 1.0
                   ) -> list[int]:
        """Ranks among ``candidates`` whose heartbeat stopped (waits up to ``wait`` s)."""
        deadline = time.monotonic() + wait
        known = f"{self.namespace}/dead"
        while True:
            try:  # another survivor may have found it already (and may exit soon)
                if self.store.check([known]):
                    found = json.loads(self.store.get(known).decode())
                    return [r for r in found if r in candidates and r != self.rank]
            except Exception:  # noqa: BLE001 - store unreachable: what the heartbeat saw
                return [r for r in self._known_dead if r in candidates and r != self.rank]
            dead = []
            now = time.time()
            for r in candidates:
                if r == self.rank:
                    continue
                key = f"{self.namespace}/hb/{r}"
                try:
                    if not self.store.check([key]):
                        continue
                    last = float(self.store.get(key).decode())
                except Exception:  # noqa: BLE001 - store unreachable: what the heartbeat saw
                    return [r for r in self._known_dead if r in candidates and r != self.rank]
                if now - last > STALE_S:
                    dead.append(r)
            if dead or time.monotonic() > deadline:
                return dead
            time.sleep(0.25)

    def _share_diagnosis(self, dead: Sequence[int], linger: float = HEARTBEAT_S + 1.5
                         ) -> None:
        """Publish the dead ranks and wait (briefly) until every survivor has read them
        (its heartbeat thread does, even while it waits on something else): the store may
        live in this process, and leaving at once would leave them with "a peer closed
        its connection" and no name."""
        try:
            self.store.set(f"{self.namespace}/dead", json.dumps(sorted(dead)))
            self.store.set(f"{self.namespace}/explained/{self.rank}", "1")
            others = [f"{self.namespace}/explained/{r}" for r in range(self.size)
                      if r != self.rank and r not in dead]
            deadline = time.monotonic() + linger
            while others and time.monotonic() < deadline:
                others = [k for k in others if not self.store.check([k])]
                time.sleep(0.05)
        except Exception:  # noqa: BLE001 - the store is gone: nobody left to tell
            return

    def explain(self, exc: BaseException, what: str, members: Sequence[int]) -> DistributedError:
        """A DistributedError for a failed operation ``what`` over ``members``."""
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        closed = "closed" in text.lower() or "reset" in text.lower()
        dead = self.dead_peers(members) if closed or "timed out" in text.lower() else []
        if dead:
            self._share_diagnosis(dead)
            who = ", ".join(self.describe(r) for r in dead)
            problem = (f"lost {who} while {what}: the process stopped (crashed or was "
                       "killed)")
        elif closed:
            peers = [r for r in members if r != self.rank]
            who = ", ".join(self.describe(r) for r in peers[:4])
            problem = f"a peer closed its connection while {what} (one of {who})"
        else:
            problem = f"failed while {what}: {text}"
        return DistributedError(problem, where=f"{self.describe(self.rank)}",
                                fix="the job cannot go on without it: see that process's "
                                    "own error or exit status (crash, OOM killer), then "
                                    f"restart the job [gloo: {text[:120]}]")


class Group:
    """A raw gloo process group over logical ranks, with failures turned into
    :class:`DistributedError` naming the peer."""

    def __init__(self, cluster: Cluster, prefix: str, members: tuple[int, ...],
                 timeout: timedelta) -> None:
        self.cluster = cluster
        self.members = members
        self.name = prefix
        self.rank = members.index(cluster.rank)
        self.size = len(members)
        store = dist.PrefixStore(f"{prefix}/", cluster.store)
        try:
            self.pg: dist.ProcessGroupGloo | None
            self.pg, loops = new_loops(lambda: dist.ProcessGroupGloo(
                store, self.rank, self.size, timeout))
        except RuntimeError as exc:
            raise cluster.explain(exc, f"connecting group {prefix}", members) from None
        self.yielding = Yielding(loops)  # gloo's I/O threads, while this process waits

    def index(self, rank: int) -> int:
        """Group rank of logical rank ``rank``."""
        return self.members.index(rank)

    # -- collectives (async; wait with :meth:`wait`) ---------------------------------
    def reduce(self, t: torch.Tensor, dst: int) -> dist.Work:
        opts = dist.ReduceOptions()
        opts.rootRank = self.index(dst)
        opts.reduceOp = dist.ReduceOp.SUM
        return self._call(lambda: self.pg.reduce([t], opts), "reduce")

    def broadcast(self, t: torch.Tensor, src: int) -> dist.Work:
        opts = dist.BroadcastOptions()
        opts.rootRank = self.index(src)
        return self._call(lambda: self.pg.broadcast([t], opts), "broadcast")

    def all_reduce(self, t: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> dist.Work:
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        return self._call(lambda: self.pg.allreduce([t], opts), "all-reduce")

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor,
                   out_splits: list[int] | None = None, in_splits: list[int] | None = None
                   ) -> dist.Work:
        return self._call(lambda: self.pg.alltoall_base(
            out, inp, out_splits or [], in_splits or [], dist.AllToAllOptions()), "all-to-all")

    def send(self, t: torch.Tensor, dst: int, tag: int) -> dist.Work:
        return self._call(lambda: self.pg.send([t], self.index(dst), tag), "send")

    def recv(self, t: torch.Tensor, src: int, tag: int) -> dist.Work:
        return self._call(lambda: self.pg.recv([t], self.index(src), tag), "recv")

    def recv_any(self, t: torch.Tensor, tag: int) -> dist.Work:
        return self._call(lambda: self.pg.recv_anysource([t], tag), "recv")

    def wait(self, work: dist.Work, what: str = "") -> None:
        try:
            with self.yielding:
                work.wait()
        except RuntimeError as exc:
            raise self.cluster.explain(exc, what or f"waiting on group {self.name}",
                                       self.members) from None

    def run(self, fn, what: str) -> None:  # noqa: ANN001 - a zero-argument callable
        """Start an operation and wait for it."""
        self.wait(fn(), what)

    def _call(self, fn, what: str) -> dist.Work:  # noqa: ANN001
        if self.pg is None:
            raise DistributedError(f"group {self.name} was released (its runtime closed)",
                                   where=f"a {what} on group {self.name}",
                                   fix="use the runtime's groups only until it closes")
        try:
            return fn()
        except RuntimeError as exc:
            raise self.cluster.explain(exc, f"starting a {what} on group {self.name}",
                                       self.members) from None

    def interrupt(self) -> None:
        """Fail every operation pending on this group now, receives blocked for good
        included (``pg.shutdown()`` does not wake them): gloo closes a group's
        connections when a wait on it times out, so a 1 ms receive of a message nobody
        sends does it. The group is unusable afterwards."""
        if self.pg is None or self.size < 2:
            return
        with contextlib.suppress(Exception):  # (the timeout is the point)
            self.pg.recv([torch.empty(1)], 1 if self.rank == 0 else 0,
                         INTERRUPT_TAG).wait(timedelta(milliseconds=1))

    def shutdown(self) -> None:
        """Interrupt the group (see :meth:`interrupt`) and shut it down."""
        self.interrupt()
        if self.pg is not None:
            with contextlib.suppress(Exception):
                self.pg.shutdown()

    def release(self) -> None:
        """Shut down and drop the gloo group: its connections and threads end with it
        (shutdown alone leaves them until the object is collected)."""
        self.shutdown()
        self.pg = None


def join_all(threads: Sequence[threading.Thread | None], seconds: float = QUIESCE_S
             ) -> None:
    """Wait for ``threads`` to end, at most ``seconds`` for all of them together."""
    deadline = time.monotonic() + seconds
    for t in threads:
        if t is not None and t is not threading.current_thread():
            t.join(max(0.0, deadline - time.monotonic()))


def _quiesce_at_exit(ref: weakref.ref) -> None:
    cluster = ref()
    if cluster is not None:
        with contextlib.suppress(Exception):  # at exit, nothing is left to report to
            cluster.quiesce()


def join_cluster(replicas: Sequence[str], servers: Sequence[str], *,
                 timeout: timedelta | None = None, backend: str = "gloo") -> Cluster:
    """Join a job of ``len(replicas)`` workers and ``len(servers)`` servers (collective).

    Needs ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` (torchrun's env) and
    no default process group yet. Workers end up with a default group of the workers only,
    ranked by logical rank; the returned :class:`Cluster` tells each process its role.
    """
    if dist.is_initialized():
        raise DistributedError("the default process group already exists",
                               where="parameter-server start-up",
                               fix="let AutoDist initialize torch.distributed when the "
                                   "spec has server nodes")
    store, grank, world = next(dist.rendezvous("env://", timeout=timeout or data_timeout()))
    store.set_timeout(timeout or data_timeout())
    watch_world(grank, world)  # a frozen or unreachable server or worker ends the job fast
    namespace = f"stratagem/{os.environ.get('TORCHELASTIC_RUN_ID', 'job')}"
    mine = {"role": env.role(),
            "address": env.node_address(),
            "local_rank": int(os.environ.get("LOCAL_RANK") or 0), "rank": grank}
    if mine["role"] not in ("worker", "server"):
        raise DistributedError(f"{ENV_ROLE}={mine['role']!r}", where="parameter-server start-up",
                               fix="use worker or server")
    store.set(f"{namespace}/join/{grank}", json.dumps(mine))
    infos = [json.loads(store.get(f"{namespace}/join/{r}").decode()) for r in range(world)]
    layout = assign_layout(infos, replicas, servers)
    rank = layout.logical(grank)
    if rank < len(replicas):
        os.environ["RANK"] = str(rank)
        os.environ["WORLD_SIZE"] = str(len(replicas))
        init_process_group(backend, store=dist.PrefixStore(f"{namespace}/workers/", store),
                           rank=rank, world_size=len(replicas), timeout=timeout or data_timeout())
    cluster = Cluster(store, rank, replicas, servers, namespace)
    cluster.start_heartbeat()
    return cluster


def cluster_from_default_group(replicas: Sequence[str],
                               process_group: dist.ProcessGroup | None = None) -> Cluster:
    """A :class:`Cluster` of workers only, over an existing default process group."""
    group = process_group if process_group is not None else dist.group.WORLD
    rank = dist.get_rank(group)
    store = dist.distributed_c10d._get_default_store()
    # The default group's store is shared by every group of the job; namespace by size.
    cluster = Cluster(store, rank, replicas, (),
                      namespace=f"stratagem/w{dist.get_world_size(group)}")
    cluster.start_heartbeat()
    return cluster

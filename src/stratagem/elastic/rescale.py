"""In-process rescale: workers join or leave a running job, nobody restarts.

The job's workers share one ``TCPStore`` (``STRATAGEM_RESCALE_STORE=host:port``), hosted by
``python -m stratagem.elastic serve`` (a launcher) or by one worker with
``STRATAGEM_RESCALE_HOST=1``. The store listens on loopback unless told otherwise; one that
listens on another address requires a shared token (``STRATAGEM_RESCALE_TOKEN``). Any
client can list a TCPStore's keys, so the token is not a secret name: every membership
value (tickets, generations, admissions, the end mark) carries an HMAC-SHA256 of it under
the job's token, and readers check it. A value without a valid one (written by a client
that lacks the token) is refused and named: a forged ticket is skipped with an error line,
a forged generation or admission is a DistributedError; a ticket whose worker never
arrives (stale) is a DistributedError naming it within the rescale timeout.
Membership moves in *generations*:

* The first ``STRATAGEM_RESCALE_NPROC`` workers form generation 0 when ``AutoDist()`` is
  created (each takes a ticket; ticket 0 writes the member list).
* A worker started later builds its model alone (world 1, no process group) and, at its
  first exit point (the top of ``remaining_epochs_until``), takes a ticket and waits.
* At every step boundary (each exit point, :func:`rescale_point`) the members agree in one
  small all-reduce on who leaves (SIGTERM or :func:`request_leave`) and how many ready
  joiners to admit. On a change, rank 0 writes generation ``g+1`` to the store; every member
  syncs its job state (accumulators), leavers exit, the rest destroy the old process group
  and create the new one under the store prefix of ``g+1``; the joiners do the same.
* Then (:mod:`stratagem.elastic.membership`) rank 0 sends all job state (optimizer, loader
  position, epoch, adaptive loop, user states: tensors and JSON, no pickles) to the
  joiners, and every participant follows the change through its own callback: AutoDist
  rebuilds the strategy, plan and gradient synchronizers for the new world and broadcasts
  parameters and buffers, loaders re-plan the epoch's remaining global batches from the
  current sample offset. Global batch ``t`` is the same set of samples at
  any world size, so no sample is lost or repeated and training equals one process's.

When every member leaves at once (the whole job is stopped), the checkpoint path of
:func:`stratagem.elastic.exit_point` saves the job state and exits as usual (without a
checkpoint directory the workers just exit). In an elastic job that agreement is the only
way to the stop path: a SIGTERM always asks *this* worker to leave, and one that arrives
after a boundary's agreement waits for the next boundary -- it never turns into a stop of
the whole job because it landed between the agreement and the exit point's checks.
All-reduce and ZeRO strategies (stage-3 units are gathered whole in the old group and
sharded again in the new one: ``DistributedModel.before_regroup``; parameter-server
strategies are refused at the first rescale); single-node resource specs (the world is
rebuilt as this machine's workers).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import hashlib
import hmac
import ipaddress
import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from stratagem import env
from stratagem.distributed.peer_watchdog import PeerWatchdog
from stratagem.distributed.process_group import (
    default_backend,
    destroy_process_group,
    init_process_group,
)
from stratagem.distributed.process_group import init_single_process_group as init_alone
from stratagem.elastic.context import JobContext, MembershipChange, current_job
from stratagem.elastic.membership import after_change, before_change
from stratagem.elastic.signals import EXIT_CODE, install_signal_handler, request_exit
from stratagem.elastic.state import checkpoint_root
from stratagem.errors import DistributedError

ENV_STORE = env.RESCALE_STORE
ENV_HOST = env.RESCALE_HOST
ENV_NPROC = env.RESCALE_NPROC
ENV_ID = env.RESCALE_ID
ENV_TIMEOUT = env.RESCALE_TIMEOUT
ENV_TOKEN = env.RESCALE_TOKEN
NS = "sg-rescale"


@dataclass(frozen=True)
class Generation:
    """One membership: ``members`` in rank order; tickets below ``admitted`` are handled."""

    number: int
    members: tuple[str, ...]
    admitted: int

    def to_json(self) -> str:
        return json.dumps({"number": self.number, "members": list(self.members),
                           "admitted": self.admitted})

    @classmethod
    def from_json(cls, text: str | bytes) -> Generation:
        d = json.loads(text)
        return cls(int(d["number"]), tuple(d["members"]), int(d["admitted"]))


@dataclass(frozen=True)
class Change:
    """A completed rescale, as seen by one member."""

    generation: int
    old_world: int
    new_world: int
    left: tuple[str, ...]
    joined: tuple[str, ...]
    seconds: float  # this member's pause: agreement, regroup and state transfer


def parse_address(value: str) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit():
        raise DistributedError(f"{ENV_STORE}={value!r} is not host:port",
                               fix="e.g. STRATAGEM_RESCALE_STORE=127.0.0.1:29600")
    return host, int(port)


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine only (``localhost``, 127.0.0.0/8, ``::1``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def namespace(token: str | None) -> str:
    """The prefix of a job's store keys: with a token, a digest of it, so a client that
    does not know the token cannot find (read or forge) the job's membership."""
    if not token:
        return NS
    return f"{NS}/{hashlib.sha256(token.encode()).hexdigest()[:32]}"


def sign(token: str | None, key: str, value: str) -> str:
    """``value`` stored under ``key``, prefixed with its HMAC-SHA256 under ``token`` (bound
    to the key, so a signed value cannot be replayed under another key)."""
    mac = hmac.new((token or "").encode(), f"{key}\0{value}".encode(), hashlib.sha256)
    return f"{mac.hexdigest()}:{value}"


def verify(token: str | None, key: str, stored: bytes | str, what: str) -> str:
    """The value of a :func:`sign`-ed store entry; a DistributedError naming ``what`` and
    ``key`` when it does not carry a valid HMAC of the job's token."""
    text = stored.decode("utf-8", "replace") if isinstance(stored, bytes) else stored
    mac, sep, value = text.partition(":")
    if sep and hmac.compare_digest(sign(token, key, value), text):
        return value
    raise DistributedError(
        f"{what} is not signed with the job's token (a client without the token wrote it, "
        f"or the workers were given different tokens)", where=f"rescale store key {key!r}",
        fix=f"give every worker the same {ENV_TOKEN}; keep the store's port away from "
            "other users (a firewall, or a loopback store)")


def current_generation(store: dist.Store, token: str | None) -> Generation | None:
    """The job's current generation as its store records it (signatures checked), or None
    before the first one formed: for observers such as the cluster service."""
    prefix = namespace(token)
    if not store.check([f"{prefix}/gen"]):
        return None
    number = verify(token, f"{prefix}/gen", store.get(f"{prefix}/gen"), "the generation")
    key = f"{prefix}/gen/{number}"
    return Generation.from_json(verify(token, key, store.get(key), f"generation {number}"))


def host_store(host: str, port: int, timeout_s: float = 600.0, *,
               token: str | None = None) -> dist.TCPStore:
    """Serve a job's rescale store on ``host:port`` only (keep the returned object alive).

    A store on anything but loopback is reachable from other machines: it needs a token.
    """
    if not is_loopback(host) and not token:
        raise DistributedError(
            f"a rescale store on {host}:{port} would accept any client on the network",
            where="rescale store",
            fix=f"keep it on 127.0.0.1, or set {ENV_TOKEN} (or --token) to a shared secret "
                "on the store and on every worker")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise DistributedError(f"cannot listen on {host}:{port}: {exc}",
                               where="rescale store", fix="pick a free port") from None
    # torch's store server would listen on every interface; it takes this socket instead.
    return dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=timeout_s), master_listen_fd=sock.detach())


class ElasticGroup:
    """This worker's membership of an in-process elastic job (see the module docstring)."""

    def __init__(self, store: dist.Store, member_id: str, *, nproc: int = 1,
                 timeout_s: float = 300.0, backend: str | None = None,
                 token: str | None = None, job: JobContext | None = None) -> None:
        self.store = store
        self.job = job if job is not None else current_job()  # whose participants follow
        self.namespace = namespace(token)
        self.token = token
        self.id = member_id
        self.nproc = max(int(nproc), 1)
        self.timeout = timedelta(seconds=timeout_s)
        self.backend = backend or default_backend()
        self.rank, self.world_size = 0, 1
        self.generation: Generation | None = None
        self.ticket: int | None = None
        self.pending = False  # started late: joins at its first exit point
        self.history: list[Change] = []
        self.server: dist.TCPStore | None = None  # the store, when this worker hosts it
        self.watchdog: PeerWatchdog | None = None  # the members' heartbeats

    @classmethod
    def from_env(cls) -> ElasticGroup | None:
        """The group described by ``STRATAGEM_RESCALE_*``, or None when unset."""
        address = env.rescale_store()
        if not address:
            return None
        host, port = parse_address(address)
        timeout_s = env.rescale_timeout().total_seconds()
        token = env.rescale_token()
        server = host_store(host, port, timeout_s, token=token) if env.rescale_host() else None
        store = dist.TCPStore(host, port, is_master=False,
                              timeout=timedelta(seconds=timeout_s))
        member = env.rescale_id() or f"{socket.gethostname()}-{os.getpid()}"
        group = cls(store, member, nproc=env.rescale_nproc(), timeout_s=timeout_s, token=token)
        group.server = server
        return group

    # -- keys ----------------------------------------------------------------------------
    def _key(self, *parts: object) -> str:
        return "/".join([self.namespace, *map(str, parts)])

    def _put(self, value: str, *parts: object) -> None:
        key = self._key(*parts)
        self.store.set(key, sign(self.token, key, value))

    def _get(self, what: str, *parts: object) -> str:
        key = self._key(*parts)
        return verify(self.token, key, self.store.get(key), what)

    def _read_generation(self, number: int) -> Generation:
        key = self._key("gen", number)
        self.store.wait([key], self.timeout)
        text = self._get(f"generation {number}", "gen", number)
        try:
            return Generation.from_json(text)
        except (ValueError, KeyError, TypeError) as exc:
            raise DistributedError(f"generation {number} is malformed: {exc!r}"[:300],
                                   where=f"rescale store key {key!r}") from None

    def _take_ticket(self) -> int:
        ticket = self.store.add(self._key("tickets"), 1) - 1
        self._put(self.id, "ticket", ticket)
        return ticket

    def _ticket_holder(self, ticket: int) -> str | None:
        """The member id on ``ticket``, or None (logged) when it is not validly signed."""
        try:
            return self._get(f"rescale ticket {ticket}", "ticket", ticket)
        except DistributedError as exc:
            print(f"stratagem: error: refused {exc.render()}", file=sys.stderr, flush=True)
            return None

    # -- joining -------------------------------------------------------------------------
    def start(self) -> None:
        """Join generation 0 if the job is forming, else wait to join at the first exit
        point. Exports this worker's ``RANK`` and ``WORLD_SIZE``."""
        atexit.register(self._close)
        if not self.store.check([self._key("gen")]):
            ticket = self._take_ticket()
            if ticket < self.nproc:
                if ticket == 0:
                    self.store.wait([self._key("ticket", self.nproc - 1)], self.timeout)
                    ids = [self._get(f"rescale ticket {t}", "ticket", t)
                           for t in range(self.nproc)]
                    self._publish(Generation(0, tuple(ids), self.nproc), [])
                self._enter(self._read_generation(0))
                return
            self.ticket = ticket  # the job filled up meanwhile: a late joiner
        self.pending = True
        os.environ["RANK"], os.environ["WORLD_SIZE"] = "0", "1"
        if not dist.is_initialized():  # alone until admitted (collectives in the script work)
            init_alone("gloo")

    def _close(self) -> None:
        """At exit: rank 0 marks the job finished (waiting joiners then give up)."""
        if self.rank == 0 and not self.pending and self.generation is not None:
            with contextlib.suppress(RuntimeError, OSError):  # no store: nobody to tell
                self._put(str(self.generation.number), "done")
        self._destroy()

    def _publish(self, gen: Generation, tickets: list[int]) -> None:
        self._put(gen.to_json(), "gen", gen.number)
        for t in tickets:
            self._put(str(gen.number), "admit", t)
        self._put(str(gen.number), "gen")

    def _arrive(self, gen: Generation, rank: int) -> None:
        """Every member of ``gen`` checks in within the rescale timeout, else a
        DistributedError names the ones that did not (a stale ticket: its worker is gone)."""
        self.store.set(self._key("arrived", gen.number, rank), "1")
        deadline = time.monotonic() + self.timeout.total_seconds()
        while True:
            missing = [(r, m) for r, m in enumerate(gen.members)
                       if not self.store.check([self._key("arrived", gen.number, r)])]
            if not missing:
                return
            if time.monotonic() > deadline:
                names = ", ".join(f"{m} (rank {r})" for r, m in missing[:5])
                raise DistributedError(
                    f"generation {gen.number} did not form within {self.timeout}: {names} "
                    "never arrived (a stale ticket: its worker left or died after taking it)",
                    where=f"rescale generation {gen.number}",
                    fix=f"restart the job; raise {ENV_TIMEOUT} if workers are just slow")
            time.sleep(0.01)

    def _enter(self, gen: Generation) -> None:
        """Create this worker's process group of generation ``gen``."""
        rank, world = gen.members.index(self.id), len(gen.members)
        if world > 1:
            self._arrive(gen, rank)
        store = dist.PrefixStore(self._key("pg", gen.number), self.store)
        init_process_group(self.backend, store=store, rank=rank, world_size=world)
        self.rank, self.world_size, self.generation = rank, world, gen
        os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(world)
        seconds = env.peer_timeout()
        if seconds and world > 1:  # a frozen member must not hold the others for the timeout
            beats = dist.PrefixStore(self._key("peers", gen.number), self.store)
            self.watchdog = PeerWatchdog(beats, rank, world, seconds,
                                         names=gen.members).start()

    def join_late(self) -> Change:
        """A late worker's first exit point: wait for admission, then take the job state."""
        t0 = time.perf_counter()
        if self.ticket is None:
            self.ticket = self._take_ticket()
        key = self._key("admit", self.ticket)
        deadline = time.monotonic() + self.timeout.total_seconds()
        while not self.store.check([key]):
            if self.store.check([self._key("done")]) and self._done_signed():
                print(f"stratagem: worker {self.id}: the job finished before it could join",
                      file=sys.stderr, flush=True)
                sys.exit(0)
            if time.monotonic() > deadline:
                raise DistributedError(f"not admitted within {self.timeout}",
                                       where=f"rescale ticket {self.ticket}",
                                       fix="check that the job is running and reaches "
                                           f"step boundaries; raise {ENV_TIMEOUT}")
            time.sleep(0.005)
        number = self._get(f"admission of rescale ticket {self.ticket}", "admit", self.ticket)
        gen = self._read_generation(int(number))
        self._destroy()  # the world-1 group it trained alone with
        self._enter(gen)
        self.pending = False
        after_change(self.job, MembershipChange(self.rank, self.world_size, newcomer=True,
                                                joiners=True))
        change = Change(gen.number, len(gen.members) - 1, len(gen.members), (), (self.id,),
                        time.perf_counter() - t0)
        self.history.append(change)
        return change

    def _done_signed(self) -> bool:
        """Whether the job's end mark is genuine (a forged one is named and ignored)."""
        try:
            self._get("the job's end mark", "done")
            return True
        except DistributedError as exc:
            print(f"stratagem: error: ignored {exc.render()}", file=sys.stderr, flush=True)
            return False

    # -- members -------------------------------------------------------------------------
    def ready_joiners(self) -> int:
        """Joiners waiting with consecutive tickets from ``admitted`` (a store read)."""
        gen = self.generation
        if gen is None:
            return 0
        n = 0
        while self.store.check([self._key("ticket", gen.admitted + n)]):
            n += 1
        return n

    def poll(self, leaving: bool) -> Change | None:
        """Collective over the members: agree on leavers and joiners, then rescale."""
        t0 = time.perf_counter()
        gen = self.generation
        assert gen is not None
        joiners = self.ready_joiners() if self.rank == 0 else 0
        if self.world_size == 1:
            flags, n = [leaving], joiners
        else:
            t = torch.zeros(self.world_size + 1, dtype=torch.int64)
            t[self.rank], t[-1] = int(leaving), joiners
            dist.all_reduce(t)
            flags, n = [bool(v) for v in t[:-1].tolist()], int(t[-1])
        if not any(flags) and n == 0:
            return None
        survivors = [m for m, f in zip(gen.members, flags, strict=True) if not f]
        if not survivors:
            return self._stop_all()
        if self.rank == 0:  # rank 0 alone reads the tickets: the others take its generation
            holders = {t: self._ticket_holder(t) for t in range(gen.admitted, gen.admitted + n)}
            good = [t for t, h in holders.items() if h is not None]
            new = Generation(gen.number + 1, tuple(survivors + [holders[t] for t in good]),
                             gen.admitted + n)
            self._publish(new, good)
        else:
            new = self._read_generation(gen.number + 1)
        joined = list(new.members[len(survivors):])
        if not any(flags) and not joined:  # only refused tickets: nobody to regroup with
            self.generation = new
            return None
        before_change(self.job)  # pending accumulator updates, leavers' included
        left = tuple(m for m, f in zip(gen.members, flags, strict=True) if f)
        old_world = self.world_size
        self._destroy()
        if leaving:
            self.generation = None  # gone: not the one to mark the job finished at exit
            print(f"stratagem: worker {self.id} left the job (generation {new.number}: "
                  f"{len(new.members)} workers)", file=sys.stderr, flush=True)
            sys.exit(0)
        self._enter(new)
        after_change(self.job, MembershipChange(self.rank, self.world_size, newcomer=False,
                                                joiners=n > 0))
        change = Change(new.number, old_world, self.world_size, left, tuple(joined),
                        time.perf_counter() - t0)
        self.history.append(change)
        if self.rank == 0:
            print(f"stratagem: rescaled {old_world} -> {self.world_size} workers (generation "
                  f"{new.number}) in {change.seconds:.2f} s", file=sys.stderr, flush=True)
        return change


    def _destroy(self) -> None:
        """Leave the current process group (its cached control group goes with it)."""
        if self.watchdog is not None:  # done with this generation: not lost
            self.watchdog.stop(done=True)
            self.watchdog = None
        self.job.forget_control_group()
        destroy_process_group()

    def _stop_all(self) -> None:
        """Every member leaves: the job stops. With a checkpoint directory the exit point
        saves the job state and exits next (every member agreed here, so every member
        does); without one, exit now."""
        request_exit()
        self.job.stop_agreed = True
        if checkpoint_root() is None:
            self._destroy()
            sys.exit(EXIT_CODE)


# -- module API -------------------------------------------------------------------------------
def join_job() -> ElasticGroup | None:
    """Join the in-process elastic job described by the environment
    (``STRATAGEM_RESCALE_STORE``; called by ``AutoDist()``), or return None when there is
    none. Idempotent: the group is kept in the job context."""
    ctx = current_job()
    if ctx.group is None:
        group = ElasticGroup.from_env()
        if group is None:
            return None
        install_signal_handler()  # SIGTERM: leave at the next step boundary
        group.start()
        ctx.group = group
    return ctx.group


def active_group() -> ElasticGroup | None:
    """This worker's elastic group, or None outside in-process elastic jobs."""
    return current_job().group


def request_leave() -> None:
    """Leave the job at the next step boundary (like SIGTERM, without stopping the rest)."""
    current_job().leave_requested = True


def rescale_point() -> Change | None:
    """A step boundary (every exit point calls it): apply pending joins and leaves.
    Collective over the members; a no-op outside in-process elastic jobs."""
    ctx = current_job()
    group = ctx.group
    if group is None:
        return None
    if group.pending:
        return group.join_late()
    return group.poll(ctx.leave_requested or ctx.exit_requested)


def main(argv: list[str] | None = None) -> int:
    """``python -m stratagem.elastic serve [--host H] --port P [--token T]``: host a job's
    store (on loopback unless ``--host`` says otherwise, which needs a token)."""
    parser = argparse.ArgumentParser(prog="python -m stratagem.elastic")
    parser.add_argument("command", choices=["serve"])
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--token", default=None,
                        help=f"shared secret of the job's workers (default: ${ENV_TOKEN}); "
                             "required when listening beyond loopback")
    args = parser.parse_args(argv)
    try:
        if not 1 <= args.port <= 65535:
            raise DistributedError(f"--port {args.port} is not a TCP port", where="--port",
                                   fix="pass a free port from 1 to 65535, e.g. --port 29600")
        server = host_store(args.host, args.port, token=args.token or env.rescale_token())
    except DistributedError as exc:
        print(exc.render(), file=sys.stderr)
        return 2
    print(f"stratagem: rescale store on {args.host}:{args.port}", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    del server
    return 0


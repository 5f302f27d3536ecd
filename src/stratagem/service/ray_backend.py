"""Jobs' workers on Ray: one actor per replica, each in a one-bundle placement group pinned
to the node the backend chose for it.

Placement: the backend picks the nodes itself (:meth:`RayBackend.place`): nodes that are not
preemptible first (a ``spot`` resource, or the label ``ray.io/market-type: spot``), then
spot nodes; among equals, the nodes this allocation already uses, then the fullest that
still fits (so jobs pack onto few nodes and whole nodes stay free). Each replica's bundle is
pinned there with a ``ray.io/node-id`` label selector, so Ray cannot put it elsewhere; one
group per replica lets a shrink free exactly the leavers' resources and a grow add bundles
without touching the running ones. The replicas of an allocation share its name prefix.

Each actor starts the job's training script as a child process. Two ways to form the job:

* *checkpoint-restart*: torch.distributed's environment (``RANK``, ``WORLD_SIZE``,
  ``MASTER_ADDR``/``MASTER_PORT`` of the rank-0 actor's node), one gloo (CPU) or nccl (GPU)
  group over the nodes Ray placed them on. Stopping sends SIGTERM to every replica: the
  elastic exit point saves the job state and exits with status 143; the next allocation
  resumes from it. After ``grace`` seconds a replica is killed.
* *in-process* (all replicas on one machine): a store actor (``<allocation>.store``) hosts
  the job's rescale store on loopback with a fresh token, and the replicas join it
  (``STRATAGEM_RESCALE_*``). :meth:`RayBackend.resize` then shrinks by sending SIGTERM to
  the leavers only (they leave at the next step boundary, the others keep training) and
  grows by starting new replicas that join at a step boundary (see
  :mod:`stratagem.elastic.rescale`).

Actors and placement groups are *detached* and named, so they outlive the scheduler process:
a restarted scheduler finds them by the names the store kept.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import astuple, dataclass
from pathlib import Path

from stratagem import env as sg_env
from stratagem.errors import StratagemError
from stratagem.service.jobfile import JobSpec

log = logging.getLogger("stratagem.service")
NAMESPACE = "stratagem"
LOST = -1000  # exit status reported for a replica whose actor or node is gone
POLL_TIMEOUT = 30.0  # s a replica's actor has to answer a poll
MAX_UNANSWERED = 10  # polls in a row without an answer before a replica counts as lost
NODE_ID_LABEL = "ray.io/node-id"
MARKET_LABEL = "ray.io/market-type"


def _own_session_dies_with_parent() -> None:
    """In the replica's child before exec: its own process group (so a stop reaches the
    whole tree), and SIGTERM (a checkpoint) when the actor dies (Linux)."""
    os.setsid()
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class ReplicaWorker:
    """A Ray actor that runs one replica's process (defined plain; wrapped by ray.remote)."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None

    def address(self) -> tuple[str, int]:
        """This node's IP and a free TCP port on it (for the rank-0 rendezvous)."""
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            return ray.util.get_node_ip_address(), int(s.getsockname()[1])

    def start(self, argv: Sequence[str], env: Mapping[str, str], log_path: str) -> int:
        log = Path(log_path)
        log.parent.mkdir(parents=True, exist_ok=True)
        full = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        full.update(env)
        who = (f"rank {env['RANK']} of {env['WORLD_SIZE']}" if "RANK" in env else
               f"{env.get(sg_env.RESCALE_ID, '?')} (in-process rescale)")
        if nice := os.nice(0):  # Ray's worker niceness, which the replica inherits
            who += f", niceness {nice}: it yields the CPU to other work (RAY_worker_niceness)"
        with log.open("ab") as out:
            out.write(f"--- {time.strftime('%H:%M:%S')} start {who} ---\n".encode())
            out.flush()
            self.proc = subprocess.Popen(list(argv), env=full, stdout=out,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         preexec_fn=_own_session_dies_with_parent)
        return self.proc.pid

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def poll(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def stop(self, grace: float) -> int | None:
        """SIGTERM, then SIGKILL after ``grace`` seconds; the exit status."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            return self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            return self.proc.wait()
        except ProcessLookupError:
            return self.proc.wait()


class RescaleStoreHost:
    """A Ray actor hosting one job's in-process rescale store on its node's loopback."""

    def __init__(self) -> None:
        self.server: object | None = None
        self.token = ""
        self.port = 0

    def serve(self) -> tuple[str, int, str]:
        """Start the store (once); (node IP, port, token) for the job's replicas."""
        import ray

        from stratagem.elastic.rescale import host_store

        if self.server is None:
            self.token = secrets.token_hex(16)
            for _ in range(5):  # a free port can be taken between the probe and the bind
                with socket.socket() as s:
                    s.bind(("127.0.0.1", 0))
                    port = int(s.getsockname()[1])
                try:
                    self.server = host_store("127.0.0.1", port, token=self.token)
                    self.port = port
                    break
                except Exception:
                    continue
            else:
                raise RuntimeError("no free port for the rescale store")
        return ray.util.get_node_ip_address(), self.port, self.token

    def members(self) -> list[str] | None:
        """The replicas (their ids) of the job's current generation; None before the first
        generation formed."""
        from datetime import timedelta

        import torch.distributed as dist

        from stratagem.elastic.rescale import current_generation

        if self.server is None:
            return None
        client = dist.TCPStore("127.0.0.1", self.port, is_master=False,
                               timeout=timedelta(seconds=10))
        gen = current_generation(client, self.token)  # signed values, checked
        return None if gen is None else list(gen.members)


class _Phases:
    """Seconds each phase of a start took (for the log: where a slow start spends them)."""

    def __init__(self) -> None:
        self.last = time.monotonic()
        self.spent: list[tuple[str, float]] = []

    def mark(self, phase: str) -> None:
        now = time.monotonic()
        self.spent.append((phase, now - self.last))
        self.last = now

    def __str__(self) -> str:
        return ", ".join(f"{p} {s:.1f} s" for p, s in self.spent)


@dataclass(frozen=True)
class Launched:
    """A started allocation: its name and its replicas' actor names (each actor's placement
    group has the actor's name)."""

    group_name: str
    actors: tuple[str, ...]


@dataclass(frozen=True)
class NodeInfo:
    """One alive node: its id, IP, whether it is preemptible, and its resources."""

    node_id: str
    ip: str
    spot: bool
    total: dict[str, float]
    free: dict[str, float]


def _ray():
    try:
        import ray
    except ImportError as exc:  # pragma: no cover - depends on the extra
        raise StratagemError("Ray is not installed", where="stratagem cluster",
                             fix="pip install 'stratagem[cluster]'") from exc
    return ray


def actor_options(resources: Mapping[str, float], gpu_resource: str) -> dict:
    """Ray actor options for one replica's resources (``GPU`` is the cluster's accelerator
    resource, which may be a custom one such as fake GPUs)."""
    opts: dict = {"num_cpus": 0.0, "num_gpus": 0.0, "resources": {}}
    for key, amount in resources.items():
        if key == "CPU":
            opts["num_cpus"] = amount
        elif key == "GPU" and gpu_resource == "GPU":
            opts["num_gpus"] = amount
        else:
            opts["resources"][gpu_resource if key == "GPU" else key] = amount
    return opts


def bundle(resources: Mapping[str, float], gpu_resource: str) -> dict[str, float]:
    out = {gpu_resource if k == "GPU" else k: float(v) for k, v in resources.items() if v}
    return out or {"CPU": 0.001}


class RayBackend:
    """Starts, polls and stops jobs' replicas on the connected Ray cluster."""

    def __init__(self, gpu_resource: str = "GPU", start_timeout: float = 60.0,
                 grace: float = 30.0) -> None:
        self.ray = _ray()
        if not self.ray.is_initialized():
            raise StratagemError("not connected to a Ray cluster", where="scheduler",
                                 fix="ray.init(...) first, or 'stratagem cluster up'")
        self.gpu_resource = gpu_resource
        self.start_timeout = start_timeout
        self.grace = grace
        self._remote = self.ray.remote(ReplicaWorker)
        # Starts run side by side (the scheduler's background starts): a node is chosen and
        # its bundles reserved under one lock, and the bundles of groups not yet placed count
        # as taken, so that two starts never pick the same free accelerator.
        self._placing = threading.Lock()
        self._reserved: dict[str, tuple[str, dict[str, float]]] = {}  # group -> node, bundle
        self._unanswered: dict[str, int] = {}  # actor -> polls in a row it did not answer

    # -- the cluster -----------------------------------------------------------------------
    def nodes(self, exclude: frozenset[str] = frozenset()) -> list[tuple[str, float]]:
        """(node id, accelerators) of every alive node that has some, not in ``exclude``
        (draining); preemptible nodes (a ``spot`` resource) last, so used last."""
        out = [(n.spot, n.node_id, n.total.get(self.gpu_resource, 0.0))
               for n in self.node_infos(exclude)]
        return [(node, amount) for _, node, amount in sorted(out) if amount >= 1]

    def node_infos(self, exclude: frozenset[str] = frozenset()) -> list[NodeInfo]:
        """Every alive node not in ``exclude``, with what placement groups left free."""
        from ray.util.placement_group import placement_group_table

        used: dict[str, dict[str, float]] = {}
        placed = set()
        for pg in placement_group_table().values():
            if pg.get("state") not in ("CREATED", "RESCHEDULING"):
                continue
            placed.add(pg.get("name"))
            for index, node in pg.get("bundles_to_node_id", {}).items():
                for key, amount in pg["bundles"].get(index, {}).items():
                    slot = used.setdefault(node, {})
                    slot[key] = slot.get(key, 0.0) + float(amount)
        for name, (node, need) in list(self._reserved.items()):
            if name not in placed:  # chosen by a start in flight, not placed by Ray yet
                slot = used.setdefault(node, {})
                for key, amount in need.items():
                    slot[key] = slot.get(key, 0.0) + amount
        out = []
        for n in self.ray.nodes():
            if not n.get("Alive") or n["NodeID"] in exclude:
                continue
            res = {k: float(v) for k, v in n.get("Resources", {}).items()}
            spot = res.get("spot", 0.0) > 0 or n.get("Labels", {}).get(MARKET_LABEL) == "spot"
            taken = used.get(n["NodeID"], {})
            out.append(NodeInfo(n["NodeID"], n.get("NodeManagerAddress", ""), spot, res,
                                {k: v - taken.get(k, 0.0) for k, v in res.items()}))
        return out

    def place(self, count: int, need: Mapping[str, float],
              exclude: frozenset[str] = frozenset(), near: Sequence[str] = (),
              ip: str | None = None) -> list[NodeInfo] | None:
        """Nodes for ``count`` bundles of ``need`` (module doc: not-spot first, then the
        nodes in ``near``, then the fullest that fits), only on ``ip`` if given; None when
        they do not fit."""
        nodes = [n for n in self.node_infos(exclude) if ip is None or n.ip == ip]
        return choose_nodes(nodes, count, need, self.gpu_resource, near)

    @contextlib.contextmanager
    def _reserve(self, names: Sequence[str], count: int, need: Mapping[str, float],
                 exclude: frozenset[str] = frozenset(), near: Sequence[str] = (),
                 ip: str | None = None):
        """:meth:`place` ``count`` bundles and hold them for the groups ``names`` until the
        block ends (by then Ray has placed the groups, or they were removed)."""
        with self._placing:
            nodes = self.place(count, need, exclude, near, ip)
            for name, node in zip(names, nodes or (), strict=False):
                self._reserved[name] = (node.node_id, dict(need))
        try:
            yield nodes
        finally:
            with self._placing:
                for name in names:
                    self._reserved.pop(name, None)

    def actor_nodes(self, launched: Launched) -> set[str]:
        """The nodes an allocation's replicas run on."""
        actors = [a for a in map(self._actor, launched.actors) if a is not None]
        return set(self.ray.get([a.node_id.remote() for a in actors], timeout=30))

    def in_process(self, launched: Launched) -> bool:
        """Whether the allocation was formed for in-process rescale (it has a store)."""
        return self._actor(store_name(launched)) is not None

    # -- one allocation --------------------------------------------------------------------
    def launch(self, spec: JobSpec, replicas: int, generation: int, env: Mapping[str, str],
               log_dir: Path, exclude: frozenset[str] = frozenset(),
               in_process: bool = False) -> Launched:
        """Start ``replicas`` workers of ``spec`` on nodes chosen by :meth:`place`. With
        ``in_process`` and every replica on one machine, the job is formed for in-process
        rescale (module doc); otherwise for checkpoint-restart."""
        group_name, names = astuple(planned_names(spec.name, generation, replicas))
        res = dict(spec.resources)
        with self._reserve(names, replicas, bundle(res, self.gpu_resource), exclude) as nodes:
            if nodes is None:
                raise StratagemError(f"Ray has no room for {replicas} replicas of {res}",
                                     where=spec.name, fix="check 'stratagem cluster status'; "
                                     "lower resources per replica")
            return self._launch(spec, group_name, names, nodes, env, log_dir, in_process)

    def _launch(self, spec: JobSpec, group_name: str, names: tuple[str, ...],
                nodes: Sequence[NodeInfo], env: Mapping[str, str], log_dir: Path,
                in_process: bool) -> Launched:
        res = dict(spec.resources)
        replicas = len(names)
        in_process = in_process and len({n.ip for n in nodes}) == 1
        phases = _Phases()
        try:
            actors = self._place_actors(names, nodes, res, spec.name, phases)
            if in_process:
                renv = {**env, **self._serve_store(group_name, nodes[0].node_id),
                        **self._own_gpus(spec), sg_env.RESCALE_NPROC: str(replicas)}
                phases.mark("store")
                starts = [a.start.remote(self._argv(spec), {**renv, sg_env.RESCALE_ID: n},
                                         log_file(log_dir, n))
                          for a, n in zip(actors, names, strict=True)]
            else:
                starts = self._start_ranked(spec, actors, names, env, log_dir)
                phases.mark("actors")
            self.ray.get(starts, timeout=self.start_timeout)
            phases.mark("started")
            log.info("%s: %d replicas started (%s)", group_name, replicas, phases)
        except Exception as exc:
            log.warning("%s: start failed after %s: %s", group_name, phases, exc)
            self.stop(Launched(group_name, names), grace=0.0)
            if isinstance(exc, StratagemError):
                raise
            raise StratagemError(f"starting the workers failed: {exc}", where=spec.name,
                                 fix="see 'stratagem logs NAME'") from exc
        return Launched(group_name, names)

    @staticmethod
    def _argv(spec: JobSpec) -> list[str]:
        # through the worker wrapper: a clean exit is never reported as a gloo abort
        return [sys.executable, "-m", "stratagem.launch.worker", spec.script, *spec.args]

    def _start_ranked(self, spec: JobSpec, actors: list, names: Sequence[str],
                      env: Mapping[str, str], log_dir: Path) -> list:
        """Checkpoint-restart form: fixed ranks, rank 0's node hosts the rendezvous."""
        addrs = self.ray.get([a.address.remote() for a in actors], timeout=self.start_timeout)
        master, port = addrs[0]
        own_gpus = self._own_gpus(spec)
        local: dict[str, int] = {}
        starts = []
        for rank, (actor, (ip, _)) in enumerate(zip(actors, addrs, strict=True)):
            local_rank = local.get(ip, 0)
            local[ip] = local_rank + 1
            renv = {**env, "RANK": str(rank), "WORLD_SIZE": str(len(actors)),
                    "LOCAL_RANK": str(local_rank), "MASTER_ADDR": master,
                    "MASTER_PORT": str(port), "GROUP_RANK": "0"}
            if own_gpus:  # otherwise the workers of one machine count locally
                renv.update(own_gpus, GROUP_RANK=str(rank))
            starts.append(actor.start.remote(self._argv(spec), renv,
                                             log_file(log_dir, names[rank])))
        return starts

    def _own_gpus(self, spec: JobSpec) -> dict[str, str]:
        """Ray shows an actor that holds GPUs only those (CUDA_VISIBLE_DEVICES): to its
        worker, a node of its own with one worker, which trains on ``cuda:0`` (see
        :func:`stratagem.env.job_nodes`). Empty without Ray's own GPU resource."""
        if self.gpu_resource == "GPU" and dict(spec.resources).get("GPU", 0) > 0:
            return {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
        return {}

    def _place_actors(self, names: Sequence[str], nodes: Sequence[NodeInfo],
                      res: Mapping[str, float], job: str, phases: _Phases | None = None
                      ) -> list:
        """One pinned one-bundle placement group and one actor per name."""
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        need = bundle(res, self.gpu_resource)
        groups = [placement_group([need], strategy="STRICT_PACK", name=name,
                                  lifetime="detached",
                                  bundle_label_selector=[{NODE_ID_LABEL: node.node_id}])
                  for name, node in zip(names, nodes, strict=True)]
        try:
            self.ray.get([pg.ready() for pg in groups], timeout=self.start_timeout)
        except Exception as exc:
            for pg in groups:
                remove_placement_group(pg)
            raise StratagemError(f"Ray could not place {len(names)} replicas of {dict(res)}: "
                                 f"{exc}", where=job, fix="check 'stratagem cluster status'; "
                                 "lower resources per replica") from exc
        if phases is not None:
            phases.mark("placed")
        opts = actor_options(res, self.gpu_resource)
        return [self._remote.options(
            name=name, namespace=NAMESPACE, lifetime="detached", max_restarts=0, **opts,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, 0),
        ).remote() for name, pg in zip(names, groups, strict=True)]

    def _serve_store(self, group_name: str, node_id: str) -> dict[str, str]:
        """Start (or find) the allocation's rescale store on ``node_id``; the replicas'
        environment for it."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        host = self._actor(f"{group_name}.store") or self.ray.remote(RescaleStoreHost).options(
            name=f"{group_name}.store", namespace=NAMESPACE, lifetime="detached",
            max_restarts=0, num_cpus=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        ).remote()
        _, port, token = self.ray.get(host.serve.remote(), timeout=self.start_timeout)
        return {sg_env.RESCALE_STORE: f"127.0.0.1:{port}", sg_env.RESCALE_TOKEN: token}

    def resize(self, spec: JobSpec, launched: Launched, replicas: int, env: Mapping[str, str],
               log_dir: Path, exclude: frozenset[str] = frozenset()) -> Launched | None:
        """Change an in-process allocation to ``replicas`` without a restart: a shrink sends
        SIGTERM to the last replicas (they leave at the next step boundary), a grow starts
        new ones on the same machine that join at one. None (nothing changed) when the
        allocation has no store, when not every replica is a member of the job's current
        generation yet (one still starting would die of the SIGTERM instead of leaving, and
        stall the others), or when the new replicas do not fit on its machine: the caller
        then falls back to checkpoint-restart."""
        store = self._actor(store_name(launched))
        if store is None:
            return None
        members = self.ray.get(store.members.remote(), timeout=self.start_timeout)
        if members is None or set(members) != set(launched.actors):
            return None  # still forming, or a joiner not yet in: a SIGTERM could kill it
        current = len(launched.actors)
        if replicas < current:
            leave = launched.actors[replicas:]
            self.stop(Launched(launched.group_name, leave), free_store=False)
            return Launched(launched.group_name, launched.actors[:replicas])
        ip, _, _ = self.ray.get(store.serve.remote(), timeout=self.start_timeout)
        near = self.actor_nodes(launched)
        last = max((int(a.rsplit(".r", 1)[-1]) for a in launched.actors), default=-1)
        names = tuple(f"{launched.group_name}.r{last + 1 + i}"
                      for i in range(replicas - current))
        with self._reserve(names, len(names), bundle(dict(spec.resources), self.gpu_resource),
                           exclude, near=tuple(near), ip=ip) as nodes:
            if nodes is None:
                return None
            return self._grow(spec, launched, names, nodes, current, env, log_dir)

    def _grow(self, spec: JobSpec, launched: Launched, names: tuple[str, ...],
              nodes: Sequence[NodeInfo], current: int, env: Mapping[str, str],
              log_dir: Path) -> Launched | None:
        try:
            actors = self._place_actors(names, nodes, dict(spec.resources), spec.name)
            renv = {**env, **self._serve_store(launched.group_name, nodes[0].node_id),
                    **self._own_gpus(spec), sg_env.RESCALE_NPROC: str(current)}
            self.ray.get([a.start.remote(self._argv(spec), {**renv, sg_env.RESCALE_ID: n},
                                         log_file(log_dir, n))
                          for a, n in zip(actors, names, strict=True)],
                         timeout=self.start_timeout)
        except Exception:
            self.stop(Launched(launched.group_name, names), grace=0.0, free_store=False)
            return None
        return Launched(launched.group_name, launched.actors + names)

    def _actor(self, name: str):
        try:
            return self.ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:
            return None

    def alive(self, launched: Launched) -> bool:
        """Whether every actor of a (possibly earlier scheduler's) allocation exists."""
        return all(self._actor(n) is not None for n in launched.actors)

    def poll(self, launched: Launched) -> list[int | None]:
        """Each replica's exit status (None: running; LOST: actor or node gone). A replica
        whose actor does not answer within ``POLL_TIMEOUT`` s (a busy node) counts as
        running, and as lost only after ``MAX_UNANSWERED`` such polls in a row: a restart
        from the checkpoint would throw away its progress for nothing."""
        out: list[int | None] = []
        for name in launched.actors:
            actor = self._actor(name)
            if actor is None:
                self._unanswered.pop(name, None)  # (its count of missed polls goes with it)
                out.append(LOST)
                continue
            try:
                out.append(self.ray.get(actor.poll.remote(), timeout=POLL_TIMEOUT))
                self._unanswered.pop(name, None)
            except TimeoutError:  # Ray's GetTimeoutError; a dead actor raises otherwise
                missed = self._unanswered[name] = self._unanswered.get(name, 0) + 1
                log.warning("%s did not answer a poll within %g s (%d in a row)", name,
                            POLL_TIMEOUT, missed)
                out.append(LOST if missed >= MAX_UNANSWERED else None)
            except Exception:
                out.append(LOST)
            if out[-1] == LOST:  # (its count of missed polls goes with it)
                self._unanswered.pop(name, None)
        return out

    def stop(self, launched: Launched, grace: float | None = None,
             free_store: bool = True) -> list[int | None]:
        """SIGTERM every replica (all of a job's: they checkpoint and exit; some of an
        in-process job's: they leave), then free the actors, their groups and (with
        ``free_store``) the job's rescale store."""
        from ray.util import get_placement_group, remove_placement_group

        grace = self.grace if grace is None else grace
        actors = [self._actor(n) for n in launched.actors]
        refs = [a.stop.remote(grace) if a is not None else None for a in actors]
        codes: list[int | None] = []
        for ref in refs:
            try:
                codes.append(LOST if ref is None else self.ray.get(ref, timeout=grace + 30))
            except Exception:
                codes.append(LOST)
        for a in actors:
            if a is not None:
                self.ray.kill(a)
        for name in launched.actors:
            self._unanswered.pop(name, None)  # (a stopped replica's missed polls go with it)
            with contextlib.suppress(Exception):  # already gone
                remove_placement_group(get_placement_group(name))
        store = self._actor(store_name(launched)) if free_store else None
        if store is not None:
            self.ray.kill(store)
        return codes


def choose_nodes(nodes: Sequence[NodeInfo], count: int, need: Mapping[str, float],
                 gpu_resource: str, near: Sequence[str] = ()) -> list[NodeInfo] | None:
    """A node for each of ``count`` bundles of ``need`` (None: they do not fit): not-spot
    nodes first, then nodes in ``near`` or already chosen, then the fullest that fits."""
    free = {n.node_id: dict(n.free) for n in nodes}
    chosen: list[NodeInfo] = []
    for _ in range(count):
        fits = [n for n in nodes if all(free[n.node_id].get(k, 0.0) >= v - 1e-9
                                        for k, v in need.items())]
        if not fits:
            return None
        mine = set(near) | {c.node_id for c in chosen}
        best = min(fits, key=lambda n: (n.spot, n.node_id not in mine,
                                        free[n.node_id].get(gpu_resource, 0.0), n.node_id))
        for k, v in need.items():
            free[best.node_id][k] = free[best.node_id].get(k, 0.0) - v
        chosen.append(best)
    return chosen


def log_file(log_dir: Path, actor: str) -> str:
    """Replica ``<allocation>.rN``'s log: ``rank-N.log``. N is the replica's index, which is
    its rank in a checkpoint-restart job; in-process members take ranks in the order they
    reach the rescale store (a replica added by an in-process grow gets the next free N)."""
    return str(log_dir / f"rank-{actor.rsplit('.r', 1)[-1]}.log")


def planned_names(job: str, generation: int, replicas: int) -> Launched:
    """The names :meth:`RayBackend.launch` gives the ``generation``-th allocation of ``job``
    (so that what an interrupted start left can be found and stopped)."""
    group_name = f"{job}.g{generation}"
    return Launched(group_name, tuple(f"{group_name}.r{i}" for i in range(replicas)))


def store_name(launched: Launched) -> str:
    """The name of an allocation's rescale-store actor (in-process allocations only)."""
    return f"{launched.group_name}.store"

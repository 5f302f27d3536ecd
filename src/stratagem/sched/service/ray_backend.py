"""Jobs' workers on Ray: one placement group per allocation, one actor per replica.

Each actor starts the job's training script as a child process with torch.distributed's
environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` of the rank-0 actor's
node), so the replicas form one gloo (CPU) or nccl (GPU) process group over the nodes Ray
placed them on. Actors and placement groups are *detached* and named, so they outlive the
scheduler process: a restarted scheduler finds them by the names the store kept.

Stopping an allocation sends SIGTERM to every replica: Stratagem's elastic exit point saves
the job's state and exits with status 143, and the next allocation resumes from it
(checkpoint-restart). After ``grace`` seconds a replica is killed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from stratagem.errors import StratagemError
from stratagem.sched.service.jobfile import JobSpec

NAMESPACE = "stratagem"
LOST = -1000  # exit status reported for a replica whose actor or node is gone


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
        with log.open("ab") as out:
            out.write(f"--- {time.strftime('%H:%M:%S')} start rank {env['RANK']} of "
                      f"{env['WORLD_SIZE']} ---\n".encode())
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


@dataclass(frozen=True)
class Launched:
    """A started allocation: its placement group and actor names."""

    group_name: str
    actors: tuple[str, ...]


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

    # -- the cluster -----------------------------------------------------------------------
    def nodes(self, exclude: frozenset[str] = frozenset()) -> list[tuple[str, float]]:
        """(node id, accelerators) of every alive node that has some, not in ``exclude``
        (draining); preemptible nodes (a ``spot`` resource) last, so used last."""
        out = []
        for n in self.ray.nodes():
            res = n.get("Resources", {})
            amount = res.get(self.gpu_resource, 0.0)
            if n.get("Alive") and amount >= 1 and n["NodeID"] not in exclude:
                out.append((res.get("spot", 0.0) > 0, n["NodeID"], float(amount)))
        return [(node, amount) for _, node, amount in sorted(out)]

    def actor_nodes(self, launched: Launched) -> set[str]:
        """The nodes an allocation's replicas run on."""
        actors = [a for a in map(self._actor, launched.actors) if a is not None]
        return set(self.ray.get([a.node_id.remote() for a in actors], timeout=30))

    # -- one allocation --------------------------------------------------------------------
    def launch(self, spec: JobSpec, replicas: int, generation: int, env: Mapping[str, str],
               log_dir: Path) -> Launched:
        """Start ``replicas`` workers of ``spec`` in a new placement group."""
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        res = dict(spec.resources)
        group_name = f"{spec.name}.g{generation}"
        pg = placement_group([bundle(res, self.gpu_resource)] * replicas, strategy="PACK",
                             name=group_name, lifetime="detached")
        try:
            self.ray.get(pg.ready(), timeout=self.start_timeout)
        except Exception as exc:
            remove_placement_group(pg)
            raise StratagemError(f"Ray could not place {replicas} replicas of {res}: {exc}",
                                 where=spec.name, fix="check 'stratagem cluster status'; "
                                 "lower resources per replica") from exc
        names = tuple(f"{group_name}.r{i}" for i in range(replicas))
        opts = actor_options(res, self.gpu_resource)
        actors = [self._remote.options(
            name=n, namespace=NAMESPACE, lifetime="detached", max_restarts=0, **opts,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                pg, placement_group_bundle_index=i),
        ).remote() for i, n in enumerate(names)]
        try:
            addrs = self.ray.get([a.address.remote() for a in actors], timeout=self.start_timeout)
            master, port = addrs[0]
            local: dict[str, int] = {}
            starts = []
            for rank, (actor, (ip, _)) in enumerate(zip(actors, addrs, strict=True)):
                local_rank = local.get(ip, 0)
                local[ip] = local_rank + 1
                renv = {**env, "RANK": str(rank), "WORLD_SIZE": str(replicas),
                        "LOCAL_RANK": str(local_rank), "MASTER_ADDR": master,
                        "MASTER_PORT": str(port), "GROUP_RANK": "0"}
                starts.append(actor.start.remote([sys.executable, spec.script, *spec.args],
                                                 renv, str(log_dir / f"rank-{rank}.log")))
            self.ray.get(starts, timeout=self.start_timeout)
        except Exception as exc:
            self.stop(Launched(group_name, names), grace=0.0)
            raise StratagemError(f"starting the workers failed: {exc}", where=spec.name,
                                 fix="see 'stratagem logs NAME'") from exc
        return Launched(group_name, names)

    def _actor(self, name: str):
        try:
            return self.ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:
            return None

    def alive(self, launched: Launched) -> bool:
        """Whether every actor of a (possibly earlier scheduler's) allocation exists."""
        return all(self._actor(n) is not None for n in launched.actors)

    def poll(self, launched: Launched) -> list[int | None]:
        """Each replica's exit status (None: running; LOST: actor or node gone)."""
        out: list[int | None] = []
        for name in launched.actors:
            actor = self._actor(name)
            if actor is None:
                out.append(LOST)
                continue
            try:
                out.append(self.ray.get(actor.poll.remote(), timeout=30))
            except Exception:
                out.append(LOST)
        return out

    def stop(self, launched: Launched, grace: float | None = None) -> list[int | None]:
        """SIGTERM every replica (they checkpoint and exit), then free the actors and group."""
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
        with contextlib.suppress(Exception):  # already gone
            remove_placement_group(get_placement_group(launched.group_name))
        return codes

"""Resource spec: which nodes, devices and links a job may use.

The YAML format is AutoDist's (``nodes`` and ``ssh`` groups) plus one optional node field,
``workers``: how many worker processes run on the node (default: one per GPU, or one on a
CPU-only cluster). Every problem is reported as a :class:`ResourceSpecError` naming the file,
the field and the fix.
"""

from __future__ import annotations

import difflib
import ipaddress
import os
import re
import sys
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar

from stratagem.errors import ResourceSpecError
from stratagem.safeload import MAX_BYTES, load_yaml

NODE_FIELDS = ("address", "gpus", "cpus", "chief", "ssh_config", "network_bandwidth", "workers",
               "memory")
SSH_FIELDS = ("username", "port", "key_file", "python_venv", "shared_envs")
TOP_FIELDS = ("nodes", "ssh", "memory_budget")
MAX_MEMORY_BYTES = 1 << 60  # an exbibyte: a typo's ceiling, far above any machine
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]i?B|B)?\s*", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(value: Any) -> int:
    """Bytes from ``6GiB``, ``512MB``, ``1.5 GiB`` or a plain integer of bytes; raises
    ValueError saying why not (negative, zero, not a size)."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a size")
    if isinstance(value, int):
        n = value
    elif isinstance(value, str) and value.strip().startswith("-"):
        raise ValueError(f"negative size {value!r}")
    else:
        m = _SIZE.fullmatch(value) if isinstance(value, str) and len(value) < 64 else None
        if m is None:
            raise ValueError(f"{value!r} is not a size")
        n = int(float(m.group(1)) * _UNITS[(m.group(2) or "B").lower()])
    if n < 0:
        raise ValueError(f"negative size {value!r}")
    if n == 0:
        raise ValueError(f"zero size {value!r}")
    if n > MAX_MEMORY_BYTES:
        raise ValueError(f"size {value!r} is beyond any machine")
    return n
DEFAULT_BANDWIDTH_GBPS = 1.0
# Bounds: far above any real cluster, low enough that a typo cannot plan 1e23 processes.
MAX_NODES = 4096
MAX_WORKERS_PER_NODE = 1024
MAX_DEVICE_INDEX = 65535
MAX_BANDWIDTH_GBPS = 1e6
# A host name (or container name, for --remote-shell templates): dot-separated labels of
# letters, digits, '_' and '-', never starting with '-' (it would read as an ssh option).
_HOST = re.compile(r"(?!-)[A-Za-z0-9_-]{1,63}(\.(?!-)[A-Za-z0-9_-]{1,63})*\.?")
_USER = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


# Device files a GPU driver creates (NVIDIA, ROCm, WSL2): without any, torch.cuda sees none.
GPU_DEVICE_FILES = ("/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd", "/dev/dxg")


def may_have_gpus() -> bool:
    """Whether this machine may have a GPU torch can use. False only when no GPU driver's
    device file exists: then the answer is known without importing torch (seconds of
    start-up for ``stratagem run`` on a CPU machine)."""
    return any(os.path.exists(path) for path in GPU_DEVICE_FILES)


@dataclass(frozen=True)
class SSHConfig:
    """How the launcher reaches a node: AutoDist's ssh group."""

    username: str | None = None
    port: int = 22
    key_file: str | None = None
    python_venv: str | None = None
    shared_envs: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Node:
    """One machine: its address, devices, link speed and worker count."""

    address: str
    gpus: tuple[int, ...] = ()
    cpus: tuple[int, ...] = (0,)
    chief: bool = False
    ssh_config: str | None = None
    network_bandwidth: float = DEFAULT_BANDWIDTH_GBPS
    workers: int = 1
    memory: int | None = None
    """Bytes each worker of the node may use (its GPU's, or its share of the host's)."""

    @property
    def is_loopback(self) -> bool:
        return is_loopback_address(self.address)

    def worker_devices(self) -> list[str]:
        """Device strings of this node's worker replicas, e.g. ``10.0.0.1:GPU:0``."""
        if self.gpus:
            return [f"{self.address}:GPU:{g}" for g in self.gpus[: self.workers]]
        return [f"{self.address}:CPU:{i}" for i in range(self.workers)]


@dataclass(frozen=True)
class ResourceSpec:
    """A validated resource spec. Build it with :meth:`from_file`, :meth:`from_dict` or
    :meth:`local`."""

    nodes: tuple[Node, ...]
    ssh: Mapping[str, SSHConfig] = field(default_factory=dict)
    source: str = "<resource spec>"
    of_this_job: bool = False
    """Made by :meth:`of_job` (no spec given, several nodes): ranks find their node from
    torch elastic's group rank, not from an address. A flag, not a source string a spec
    file could spell."""
    JOB_SOURCE: ClassVar[str] = "<this job"  # the source of :meth:`of_job`'s specs
    memory_budget: int | None = None
    """Bytes the whole job may use, over all its workers (``memory_budget:``)."""

    # -- construction -------------------------------------------------------------------
    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> ResourceSpec:
        p = Path(path)
        if not p.is_file():
            raise ResourceSpecError(
                "file not found",
                where=str(p),
                fix="pass the path of an existing YAML resource spec, or omit it to use this "
                "machine",
            )
        if p.stat().st_size > MAX_BYTES:
            raise ResourceSpecError(f"file too large ({p.stat().st_size} bytes)", where=str(p),
                                    fix="pass a YAML resource spec (a few kB)")
        try:
            text = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ResourceSpecError(f"cannot read the file: {exc}", where=str(p),
                                    fix="pass a readable UTF-8 YAML resource spec") from None
        return cls.from_yaml(text, source=str(p))

    @classmethod
    def from_yaml(cls, text: str, source: str = "<resource spec>") -> ResourceSpec:
        return cls.from_dict(load_yaml(text, source, ResourceSpecError), source=source)

    @classmethod
    def from_dict(cls, data: Any, source: str = "<resource spec>") -> ResourceSpec:
        return _Parser(source).spec(data)

    @classmethod
    def local(cls, num_workers: int | None = None) -> ResourceSpec:
        """This machine alone: one worker per GPU, or ``num_workers`` CPU workers."""
        gpus: tuple[int, ...] = ()
        if "torch" in sys.modules or may_have_gpus():
            try:
                import torch

                if torch.cuda.is_available():
                    gpus = tuple(range(torch.cuda.device_count()))
            except ImportError:  # pragma: no cover - torch is a dependency
                pass
        node = Node(address="127.0.0.1", gpus=gpus, cpus=tuple(range(os.cpu_count() or 1)),
                    chief=True, workers=len(gpus) or 1)
        spec = cls(nodes=(node,), source="<this machine>")
        return spec if num_workers is None else spec.with_local_workers(num_workers)

    @classmethod
    def of_job(cls, world_size: int, nodes: int) -> ResourceSpec:
        """A job of ``world_size`` workers on ``nodes`` machines shaped like this one, started
        without a resource spec (``torchrun --nnodes 2 --nproc-per-node 8``): each node runs
        its share of the workers on its GPUs, one each, where it has that many, and is
        named ``node0``, ``node1``, ... in rank order (one node: :meth:`local`)."""
        if nodes <= 1:
            return cls.local(world_size)
        per_node = -(-world_size // nodes)
        this = cls.local(per_node).nodes[0]
        counts = [min(per_node, world_size - i * per_node) for i in range(nodes)]
        shaped = tuple(replace(this, address=f"node{i}", chief=i == 0, workers=count)
                       for i, count in enumerate(counts) if count > 0)
        return cls(nodes=shaped, source=f"{cls.JOB_SOURCE}: {len(shaped)} nodes like this one>",
                   of_this_job=True)

    def with_local_workers(self, workers: int) -> ResourceSpec:
        """This single-node spec running ``workers`` processes (``--nproc``); on CPU when
        the node has fewer GPUs than that, rather than two workers sharing a device."""
        check_worker_count(workers, where=f"{self.source}: --nproc")
        node = self.nodes[0]
        gpus = node.gpus if len(node.gpus) >= workers else ()
        return replace(self, nodes=(replace(node, workers=workers, gpus=gpus),))

    def subset(self, addresses: Collection[str]) -> ResourceSpec:
        """This spec with only the nodes at ``addresses`` (a ``--nnodes MIN:MAX`` job running
        on the reachable part of its spec), in file order. When the chief is left out, the
        first node kept takes its place (it hosts the rendezvous and rank 0)."""
        wanted = set(addresses)
        unknown = sorted(wanted - {n.address for n in self.nodes})
        if unknown:
            raise ResourceSpecError(f"no node with address {unknown[0]!r}", where=self.source,
                                    fix=f"use addresses of {[n.address for n in self.nodes]}")
        kept = [n for n in self.nodes if n.address in wanted]
        if not any(n.workers for n in kept):
            raise ResourceSpecError(f"none of the nodes {sorted(wanted)} runs a worker",
                                    where=self.source,
                                    fix="keep at least one node with workers")
        if not any(n.chief for n in kept):
            kept[0] = replace(kept[0], chief=True)
        return replace(self, nodes=tuple(kept))

    # -- queries ------------------------------------------------------------------------
    @property
    def chief(self) -> Node:
        return next(n for n in self.nodes if n.chief)

    @property
    def is_local(self) -> bool:
        return len(self.nodes) == 1

    @property
    def replicas(self) -> list[str]:
        """Worker device strings in rank order (chief's first, then file order)."""
        ordered = [self.chief] + [n for n in self.nodes if not n.chief]
        return [d for n in ordered for d in n.worker_devices()]

    def memory_limit(self) -> tuple[int, str] | None:
        """The bytes one worker may use, and the field that says so: the smallest of the
        nodes' ``memory`` and an even share of ``memory_budget``; None when neither is set."""
        limits = [(n.memory, f"nodes[{i}].memory") for i, n in enumerate(self.nodes)
                  if n.memory is not None and n.workers]
        if self.memory_budget is not None:
            limits.append((self.memory_budget // max(self.num_workers, 1), "memory_budget"))
        return min(limits) if limits else None

    def with_memory_of(self, other: ResourceSpec) -> ResourceSpec:
        """This spec under ``other``'s memory limits: every node's ``memory`` the smallest of
        ``other``'s per-worker limits, and its ``memory_budget``. An in-process rescale
        rebuilds the job's spec for the new world (:meth:`of_job`); the limits the user set
        must survive it, or Auto would re-plan without them."""
        node_limits = [n.memory for n in other.nodes if n.memory is not None and n.workers]
        memory = min(node_limits) if node_limits else None
        nodes = tuple(replace(n, memory=memory) for n in self.nodes)
        return replace(self, nodes=nodes, memory_budget=other.memory_budget)

    @property
    def num_workers(self) -> int:
        return sum(n.workers for n in self.nodes)

    @property
    def uses_gpus(self) -> bool:
        return any(n.gpus and n.workers for n in self.nodes)

    def node(self, address: str) -> Node:
        for n in self.nodes:
            if n.address == address:
                return n
        raise ResourceSpecError(
            f"no node with address {address!r}",
            where=self.source,
            fix=f"use one of {[n.address for n in self.nodes]}",
        )

    def gpu_for(self, address: str | None, local_rank: int) -> int | None:
        """The spec GPU index of the worker with ``local_rank`` on the node at ``address``
        (the only node when ``address`` is None and the spec is single-node); None when that
        worker runs on CPU. ``gpus: [2, 3]``: local rank 1 trains on GPU 3."""
        if address is None and not self.is_local:
            return None
        try:
            wanted = None if address is None else normalize_address(address)
        except ValueError:
            return None
        node = self.nodes[0] if wanted is None else next(
            (n for n in self.nodes if n.address == wanted), None)
        if node is None or not node.gpus or not 0 <= local_rank < min(node.workers,
                                                                       len(node.gpus)):
            return None
        return node.gpus[local_rank]

    def ssh_for(self, node: Node) -> SSHConfig:
        return self.ssh.get(node.ssh_config or "", SSHConfig())

    def to_dict(self) -> dict[str, Any]:
        nodes = []
        for n in self.nodes:
            d: dict[str, Any] = {"address": n.address, "cpus": list(n.cpus)}
            if n.gpus:
                d["gpus"] = list(n.gpus)
            if n.chief:
                d["chief"] = True
            if n.ssh_config:
                d["ssh_config"] = n.ssh_config
            d["network_bandwidth"] = n.network_bandwidth
            d["workers"] = n.workers
            if n.memory is not None:
                d["memory"] = n.memory
            nodes.append(d)
        out: dict[str, Any] = {"nodes": nodes}
        if self.memory_budget is not None:
            out["memory_budget"] = self.memory_budget
        if self.ssh:
            out["ssh"] = {
                k: {
                    "username": v.username,
                    "port": v.port,
                    "key_file": v.key_file,
                    "python_venv": v.python_venv,
                    "shared_envs": dict(v.shared_envs),
                }
                for k, v in self.ssh.items()
            }
        return out


def check_worker_count(workers: int, where: str) -> None:
    """Raise unless ``workers`` is within 1..MAX_WORKERS_PER_NODE."""
    if not 1 <= workers <= MAX_WORKERS_PER_NODE:
        raise ResourceSpecError(f"{workers} worker processes on one node", where=where,
                                fix=f"use 1 to {MAX_WORKERS_PER_NODE}")


def normalize_address(raw: str) -> str:
    """``raw`` as a canonical IP literal or a host name; raises ValueError saying why not.

    Surrounding spaces are dropped and IPs are written canonically (``::0:1`` -> ``::1``,
    IPv4-mapped ``::ffff:10.0.0.1`` -> ``10.0.0.1``), so one machine written two ways is
    seen as a duplicate. Dotted numbers that are not a
    plain IPv4 address (``010.0.0.1``: octal to some tools, decimal to others) are refused.
    """
    text = raw.strip()
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        pass
    else:  # ``::ffff:10.0.0.1`` is 10.0.0.1 reached over IPv6: one machine
        mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
        return (mapped or ip).compressed
    if text and all(part.isdigit() for part in text.rstrip(".").split(".")):
        raise ValueError(f"{raw!r} is not a valid IPv4 address (leading zeros or a number "
                         "above 255 are ambiguous)")
    if len(text) > 253 or not _HOST.fullmatch(text):
        raise ValueError(f"{raw!r} is neither an IP address nor a host name")
    return text


def is_loopback_address(address: str) -> bool:
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


class _Parser:
    """Turns the raw YAML tree into a ResourceSpec, one clear error per problem."""

    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, where: str, problem: str, fix: str) -> ResourceSpecError:
        return ResourceSpecError(problem, where=f"{self.source}: {where}", fix=fix)

    def check_keys(self, where: str, data: Mapping[str, Any], allowed: tuple[str, ...]) -> None:
        for key in data:
            if key not in allowed:
                close = difflib.get_close_matches(str(key), allowed, n=1)
                hint = f"did you mean {close[0]!r}? " if close else ""
                raise self.fail(
                    f"{where}.{key}" if where else str(key),
                    "unknown field",
                    f"{hint}allowed fields are {', '.join(allowed)}",
                )

    def typed(self, where: str, value: Any, kind: type | tuple[type, ...], what: str) -> Any:
        ok = isinstance(value, kind) and not (isinstance(value, bool) and bool not in _tuple(kind))
        if not ok:
            raise self.fail(where, f"expected {what}, got {type(value).__name__} {value!r}",
                            f"write {where.split('.')[-1]} as {what}")
        return value

    def int_list(self, where: str, value: Any) -> tuple[int, ...]:
        if isinstance(value, int) and not isinstance(value, bool):
            value = [value]
        self.typed(where, value, list, "a list of device indices, e.g. [0, 1]")
        out = []
        for i, v in enumerate(value):
            self.typed(f"{where}[{i}]", v, int, "a non-negative integer")
            if v < 0:
                raise self.fail(f"{where}[{i}]", f"negative device index {v}",
                                "device indices start at 0")
            if v > MAX_DEVICE_INDEX:
                raise self.fail(f"{where}[{i}]", f"device index {v} out of range",
                                f"device indices run from 0 to at most {MAX_DEVICE_INDEX}")
            out.append(v)
        if len(set(out)) != len(out):
            raise self.fail(where, f"duplicate device index in {out}", "list each device once")
        return tuple(out)

    def spec(self, data: Any) -> ResourceSpec:
        if data is None:
            raise self.fail("(top level)", "the file is empty",
                            "add a 'nodes:' list with at least one node")
        if not isinstance(data, dict):
            raise self.fail("(top level)", f"expected a mapping, got {type(data).__name__}",
                            "start the file with 'nodes:'")
        self.check_keys("", data, TOP_FIELDS)
        ssh = self.ssh_groups(data.get("ssh") or {})
        raw_nodes = data.get("nodes")
        if raw_nodes is None:
            raise self.fail("nodes", "missing", "add a 'nodes:' list with at least one node")
        self.typed("nodes", raw_nodes, list, "a list of nodes")
        if not raw_nodes:
            raise self.fail("nodes", "empty", "list at least one node")
        if len(raw_nodes) > MAX_NODES:
            raise self.fail("nodes", f"{len(raw_nodes)} nodes", f"list at most {MAX_NODES}")
        # `gpus: 0` (a lone index) is a GPU too, so test presence, not truthiness.
        any_gpu = any(isinstance(n, dict) and n.get("gpus") not in (None, [])
                      for n in raw_nodes)
        nodes = [self.node(f"nodes[{i}]", n, ssh, any_gpu) for i, n in enumerate(raw_nodes)]
        spec = self.cross_check(nodes, ssh)
        if data.get("memory_budget") is not None:
            spec = replace(spec, memory_budget=self.size("memory_budget",
                                                         data["memory_budget"]))
        return spec

    def size(self, where: str, value: Any) -> int:
        try:
            return parse_size(value)
        except ValueError as exc:
            raise self.fail(where, str(exc), "write a positive size such as 6GiB, 512MiB "
                            "or 8GB (or a number of bytes)") from None

    def ssh_groups(self, raw: Any) -> dict[str, SSHConfig]:
        self.typed("ssh", raw, dict, "a mapping of group name to settings")
        groups = {}
        for name, cfg in raw.items():
            where = f"ssh.{name}"
            self.typed(where, cfg, dict, "a mapping")
            self.check_keys(where, cfg, SSH_FIELDS)
            port = self.typed(f"{where}.port", cfg.get("port", 22), int, "an integer port")
            if not 0 < port < 65536:
                raise self.fail(f"{where}.port", f"port {port} out of range", "use 1-65535")
            envs = cfg.get("shared_envs") or {}
            self.typed(f"{where}.shared_envs", envs, dict, "a mapping of NAME: value")
            strs = {}
            for key in ("username", "key_file", "python_venv"):
                if cfg.get(key) is not None:
                    strs[key] = self.text(f"{where}.{key}", cfg[key])
            user = strs.get("username")
            if user is not None and not _USER.fullmatch(user):
                raise self.fail(f"{where}.username", f"invalid user name {user!r}",
                                "use letters, digits, '_', '.' and '-', not starting with "
                                "'-' or '.'")
            groups[str(name)] = SSHConfig(port=port, shared_envs=self.envs(
                f"{where}.shared_envs", envs), **strs)
        return groups

    def text(self, where: str, value: Any) -> str:
        self.typed(where, value, str, "a string")
        if "\0" in value:
            raise self.fail(where, "contains a NUL character", "remove it")
        return value

    def envs(self, where: str, raw: dict) -> dict[str, str]:
        """``shared_envs``: NAME: scalar value, as strings."""
        out = {}
        for key, value in raw.items():
            if not isinstance(key, str) or not _ENV_NAME.fullmatch(key):
                raise self.fail(f"{where}.{key}", "not an environment variable name",
                                "use letters, digits and '_', not starting with a digit")
            if not isinstance(value, (str, int, float, bool)):
                raise self.fail(f"{where}.{key}",
                                f"expected a single value, got {type(value).__name__}",
                                "write the variable's value as one string")
            out[key] = self.text(f"{where}.{key}", str(value))
        return out

    def node(self, where: str, raw: Any, ssh: dict[str, SSHConfig], any_gpu: bool) -> Node:
        self.typed(where, raw, dict, "a mapping with at least 'address'")
        self.check_keys(where, raw, NODE_FIELDS)
        if "address" not in raw:
            raise self.fail(f"{where}.address", "missing", "give each node an IP address or host")
        try:
            address = normalize_address(
                self.typed(f"{where}.address", raw["address"], str, "a host or IP string"))
        except ValueError as exc:
            raise self.fail(f"{where}.address", str(exc),
                            "write an IP address such as 10.0.0.1 or a host name such as "
                            "node1.example.com") from None
        gpus = self.int_list(f"{where}.gpus", raw.get("gpus", []))
        cpus = self.int_list(f"{where}.cpus", raw.get("cpus", [0]))
        chief = self.typed(f"{where}.chief", raw.get("chief", False), bool, "true or false")
        bw = self.typed(f"{where}.network_bandwidth",
                        raw.get("network_bandwidth", DEFAULT_BANDWIDTH_GBPS), (int, float),
                        "a number of Gbit/s")
        if not 0 < bw <= MAX_BANDWIDTH_GBPS:  # also rejects .nan and .inf
            raise self.fail(f"{where}.network_bandwidth",
                            f"must be a positive number, got {bw}",
                            f"give the link speed in Gbit/s (at most {MAX_BANDWIDTH_GBPS:g}), "
                            "e.g. 1 or 25")
        ssh_name = raw.get("ssh_config")
        if ssh_name is not None:
            self.typed(f"{where}.ssh_config", ssh_name, str, "the name of an ssh group")
            if ssh_name not in ssh:
                raise self.fail(f"{where}.ssh_config", f"no ssh group named {ssh_name!r}",
                                f"define it under 'ssh:' (known: {sorted(ssh) or 'none'})")
        default_workers = len(gpus) if gpus else (0 if any_gpu else 1)
        workers = self.typed(f"{where}.workers", raw.get("workers", default_workers), int,
                             "a non-negative integer")
        if workers < 0:
            raise self.fail(f"{where}.workers", f"negative worker count {workers}",
                            "use 0 for a server-only node")
        if workers > MAX_WORKERS_PER_NODE:
            raise self.fail(f"{where}.workers", f"{workers} workers on one node",
                            f"use at most {MAX_WORKERS_PER_NODE}")
        if gpus and workers > len(gpus):
            raise self.fail(f"{where}.workers", f"{workers} workers but {len(gpus)} GPUs",
                            "use at most one worker per GPU")
        memory = (self.size(f"{where}.memory", raw["memory"])
                  if raw.get("memory") is not None else None)
        return Node(address=address, gpus=gpus, cpus=cpus, chief=chief, ssh_config=ssh_name,
                    network_bandwidth=float(bw), workers=workers, memory=memory)

    def cross_check(self, nodes: list[Node], ssh: dict[str, SSHConfig]) -> ResourceSpec:
        seen: dict[str, int] = {}
        for i, n in enumerate(nodes):
            key = n.address.lower().rstrip(".")  # host names are case-insensitive
            if key in seen:
                raise self.fail(f"nodes[{i}].address",
                                f"duplicate address {n.address!r} (also nodes[{seen[key]}])",
                                "list each machine once; use 'gpus' or 'workers' for more "
                                "processes on it")
            seen[key] = i
        chiefs = [i for i, n in enumerate(nodes) if n.chief]
        if len(chiefs) > 1:
            raise self.fail("nodes", f"{len(chiefs)} chiefs (nodes {chiefs})",
                            "mark exactly one node 'chief: true'")
        if not chiefs:
            if len(nodes) > 1:
                raise self.fail("nodes", "no chief among several nodes",
                                "mark the node you launch from with 'chief: true'")
            nodes[0] = Node(**{**nodes[0].__dict__, "chief": True})
        loop = [n.address for n in nodes if n.is_loopback]
        if loop and len(nodes) > 1:
            raise self.fail("nodes", f"loopback address {loop[0]!r} mixed with remote nodes",
                            "use each node's network address that the other nodes can reach")
        if sum(n.workers for n in nodes) == 0:
            raise self.fail("nodes", "no node runs a worker",
                            "give at least one node GPUs or 'workers: 1'")
        return ResourceSpec(nodes=tuple(nodes), ssh=ssh, source=self.source)


def _tuple(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)

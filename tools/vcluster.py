#!/usr/bin/env python3
"""Virtual cluster: K "nodes" on one Linux machine, made of network namespaces.

Loopback hides the network (tens of Gbit/s, microsecond latency), so multi-node code paths and
their cost models cannot be tested on one box. This tool gives each node its own network
namespace with an ``eth0`` on a shared Linux bridge, and shapes every link with ``tc`` (rate and,
where the kernel has ``netem``, one-way delay). Stdlib only; needs root, ``ip`` and ``tc``.

Library::

    with VirtualCluster(2, bandwidth="1gbit", delay="0.1ms") as vc:
        vc.write_resource_spec("spec.yml")
        vc.run(1, ["python", "worker.py"]).wait()

Command line (``python tools/vcluster.py --help``)::

    up --nodes 2 [--bandwidth 1gbit] [--delay 0.1ms] [--spec out.yml]
    exec ADDRESS_OR_INDEX -- cmd...      # the launcher's "remote shell"
    run --nodes 2 [...] -- cmd...        # up, run cmd on node 0, always tear down
    status | down
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import ipaddress
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

DEFAULT_PREFIX = "sgvc"
DEFAULT_SUBNET = "10.77.0.0/24"
NODE_IFNAME = "eth0"
STATE_DIR = Path("/run/stratagem-vcluster")
SPEC_ENV = "STRATAGEM_VCLUSTER_SPEC"
REMOTE_SHELL_ENV = "STRATAGEM_REMOTE_SHELL"
# Interface variables read by torch's gloo and tensorpipe backends: bind the namespace's eth0.
IFNAME_ENV = ("GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME")
MAX_NODES = 999  # keeps "<prefix>-h<i>" within the kernel's 15-character interface names
QUEUE_SECONDS = 0.005  # tbf queue depth, in time at the configured rate
NO_NODE_EXIT = 255  # like ssh: the remote shell itself failed

_RATE_UNITS = {
    "": 1, "bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
    "kibit": 2**10, "mibit": 2**20, "gibit": 2**30, "tibit": 2**40,
    "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9, "tbps": 8e12,
}  # tc's units: "...bit" are bits/s, "...bps" are BYTES/s
_TIME_UNITS = {"s": 1, "sec": 1, "ms": 1e-3, "msec": 1e-3, "us": 1e-6, "usec": 1e-6,
               "ns": 1e-9, "nsec": 1e-9}


class VirtualClusterUnavailable(RuntimeError):
    """This machine cannot host a virtual cluster; the message says why and how to fix it."""


class VirtualClusterError(RuntimeError):
    """An ``ip``/``tc`` command failed while building or inspecting the cluster."""


# -- parsing ----------------------------------------------------------------------------------
def parse_rate(text: str) -> float:
    """``"1gbit"`` -> 1e9 bits/s (tc's units; note ``mbps`` means megaBYTES/s, as in tc)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*", text.lower())
    if not m or m.group(2) not in _RATE_UNITS or float(m.group(1)) <= 0:
        raise ValueError(f"bad bandwidth {text!r}: use tc units, e.g. '1gbit', '100mbit'")
    return float(m.group(1)) * _RATE_UNITS[m.group(2)]


def parse_delay(text: str) -> float:
    """``"0.1ms"`` -> 1e-4 seconds; a bare ``"0"`` is allowed."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-z]*)\s*", text.lower())
    if not m or (m.group(2) not in _TIME_UNITS and not (m.group(2) == "" and
                                                          float(m.group(1)) == 0)):
        raise ValueError(f"bad delay {text!r}: give a unit, e.g. '0.1ms', '100us', '5ms'")
    return float(m.group(1)) * _TIME_UNITS.get(m.group(2), 0)


def parse_cpus(text: str) -> list[list[int]]:
    """``"0,1:2-3"`` -> ``[[0, 1], [2, 3]]``: ':' separates nodes, taskset lists within."""
    nodes = []
    for part in text.split(":"):
        cpus: list[int] = []
        for item in part.split(","):
            lo, _, hi = item.strip().partition("-")
            if not lo.isdigit() or (hi and not hi.isdigit()):
                raise ValueError(f"bad cpu list {text!r}: use e.g. '0:1' or '0,1:2-3'")
            cpus.extend(range(int(lo), int(hi or lo) + 1))
        nodes.append(cpus)
    return nodes


# -- shell helpers ----------------------------------------------------------------------------
def _sh(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run a short admin command, capturing output; failures raise with the command's stderr."""
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=60)
    if check and proc.returncode != 0:
        raise VirtualClusterError(
            f"`{shlex.join(argv)}` failed (exit {proc.returncode}): {proc.stderr.strip()}")
    return proc


def _json(argv: Sequence[str]) -> list[dict[str, Any]]:
    out = _sh(argv).stdout.strip()
    return json.loads(out) if out else []


def _is_ours(name: str, prefix: str, suffix: str) -> bool:
    return re.fullmatch(re.escape(prefix) + suffix, name) is not None


def list_namespaces(prefix: str = DEFAULT_PREFIX) -> list[str]:
    """Live namespaces this tool made with ``prefix``: nodes and availability probes."""
    names = [ns["name"] for ns in _json(["ip", "-j", "netns", "list"])]
    return sorted(n for n in names if _is_ours(n, prefix, r"-(\d+|probe\d+)"))


def list_links(prefix: str = DEFAULT_PREFIX) -> list[str]:
    """Root-namespace interfaces this tool made with ``prefix``: host veth ends, then bridge."""
    names = [link["ifname"] for link in _json(["ip", "-j", "link", "show"])]
    veths = sorted(n for n in names if _is_ours(n, prefix, r"-h\d+"))
    return veths + [n for n in names if n == f"{prefix}-br"]


def _namespace_address(ns: str) -> str | None:
    for link in _json(["ip", "-n", ns, "-j", "-4", "addr", "show", "dev", NODE_IFNAME]):
        for info in link.get("addr_info", []):
            return str(info["local"])
    return None


def _terminate_namespace_pids(namespaces: Sequence[str], grace: float = 2.0) -> None:
    """SIGTERM, then SIGKILL, whatever still runs inside our namespaces (they are going away)."""
    def pids() -> list[int]:
        found = []
        for ns in namespaces:
            out = _sh(["ip", "netns", "pids", ns], check=False).stdout
            found += [int(p) for p in out.split() if p.isdigit() and int(p) != os.getpid()]
        return found

    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 1.0)):
        alive = pids()
        for pid in alive:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while alive and time.monotonic() < deadline:
            time.sleep(0.05)
            alive = pids()
        if not alive:
            return


def cleanup(prefix: str = DEFAULT_PREFIX) -> list[str]:
    """Remove every namespace, interface and state file made with ``prefix``; returns names.

    Safe to call any time (idempotent); touches only names matching the prefix patterns
    ``<prefix>-<i>``, ``<prefix>-probe<pid>``, ``<prefix>-h<i>`` and ``<prefix>-br``.
    """
    namespaces = list_namespaces(prefix)
    _terminate_namespace_pids(namespaces)
    links = list_links(prefix)
    for link in links:  # deleting a veth end deletes its peer inside the namespace too
        _sh(["ip", "link", "del", link], check=False)
    for ns in namespaces:
        _sh(["ip", "netns", "del", ns], check=False)
    with contextlib.suppress(FileNotFoundError):
        (STATE_DIR / f"{prefix}.json").unlink()
    return namespaces + links


# -- availability -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Capabilities:
    """What this machine supports; ``reason`` explains a ``False`` and names the fix."""

    ok: bool
    reason: str
    netem: bool = False


_CAPS: dict[str, Capabilities] = {}


def probe(prefix: str = DEFAULT_PREFIX) -> Capabilities:
    """Check root, binaries, namespaces, veth, bridge, tbf and netem (cached per process).

    Everything is tried inside a throw-away namespace, so the probe leaves no trace outside it.
    """
    if prefix not in _CAPS:
        _CAPS[prefix] = _probe(prefix)
    return _CAPS[prefix]


def _probe(prefix: str) -> Capabilities:
    if not sys.platform.startswith("linux"):
        return Capabilities(False, f"network namespaces need Linux (this is {sys.platform})")
    if os.geteuid() != 0:
        return Capabilities(False, "needs root to create network namespaces; run with sudo "
                                   "(or as root in a VM/privileged container)")
    for tool, pkg in (("ip", "iproute2"), ("tc", "iproute2"), ("taskset", "util-linux")):
        if shutil.which(tool) is None:
            return Capabilities(False, f"no `{tool}` binary; install it: apt-get install {pkg}")
    ns = f"{prefix}-probe{os.getpid()}"
    steps = [
        (["ip", "netns", "add", ns], "network namespaces unsupported (kernel CONFIG_NET_NS, or "
         "a container without CAP_SYS_ADMIN); use a VM or a --privileged container"),
        (["ip", "-n", ns, "link", "add", "pa", "type", "veth", "peer", "name", "pb"],
         "veth unsupported (kernel CONFIG_VETH)"),
        (["ip", "-n", ns, "link", "add", "pbr", "type", "bridge"],
         "bridges unsupported (kernel CONFIG_BRIDGE)"),
        (["tc", "-n", ns, "qdisc", "add", "dev", "pa", "root", "tbf", "rate", "1gbit",
          "burst", "64kb", "latency", "5ms"], "tc tbf unsupported (kernel CONFIG_NET_SCH_TBF)"),
    ]
    try:
        for argv, why in steps:
            proc = _sh(argv, check=False)
            if proc.returncode != 0:
                return Capabilities(False, f"{why}: {proc.stderr.strip()}")
        netem = _sh(["tc", "-n", ns, "qdisc", "add", "dev", "pb", "root", "netem", "delay",
                     "1ms"], check=False).returncode == 0
        return Capabilities(True, "ok", netem=netem)
    finally:
        _sh(["ip", "netns", "del", ns], check=False)


# -- the cluster ------------------------------------------------------------------------------
class VirtualCluster:
    """K nodes as network namespaces ``<prefix>-<i>`` on bridge ``<prefix>-br``.

    Node ``i`` has ``eth0`` with ``addresses[i]`` (node 0 is the chief). Its veth's host end is
    ``<prefix>-h<i>``. Both ends' egress are shaped: ``bandwidth`` per link and direction
    (tc units, ``None`` = unshaped) and ``delay`` per link and direction (so node-to-node
    one-way latency is twice ``delay``; needs the kernel's netem, else a warning and no delay).
    ``cpus[i]`` pins node ``i``'s commands with taskset.
    """

    def __init__(
        self,
        num_nodes: int,
        bandwidth: str | None = "1gbit",
        delay: str | None = "0.1ms",
        cpus: Sequence[Sequence[int]] | None = None,
        prefix: str = DEFAULT_PREFIX,
        subnet: str = DEFAULT_SUBNET,
    ) -> None:
        if not re.fullmatch(r"[a-z][a-z0-9]{0,9}", prefix):
            raise ValueError(f"bad prefix {prefix!r}: 1-10 lowercase letters/digits, "
                             "starting with a letter")
        net = ipaddress.ip_network(subnet)
        capacity = min(MAX_NODES, net.num_addresses - 2)
        if not 1 <= num_nodes <= capacity:
            raise ValueError(f"num_nodes={num_nodes}: need 1..{capacity} for subnet {subnet}")
        self.num_nodes = num_nodes
        self.prefix = prefix
        self.subnet = net
        self.rate_bps = parse_rate(bandwidth) if bandwidth else None
        self.delay_s = parse_delay(delay) if delay else 0.0
        self.cpus = self._check_cpus(cpus, num_nodes)
        self.addresses: list[str] = [str(net.network_address + i + 1) for i in range(num_nodes)]
        self.delay_applied = self.delay_s == 0
        self._procs: list[subprocess.Popen[Any]] = []
        self._old_sigterm: Any = None  # the SIGTERM handler while a with-block holds it

    @staticmethod
    def _check_cpus(cpus: Sequence[Sequence[int]] | None, n: int) -> list[list[int]] | None:
        if cpus is None:
            return None
        out = [list(c) for c in cpus]
        allowed = os.sched_getaffinity(0)
        if len(out) != n or any(not c or not set(c) <= allowed for c in out):
            raise ValueError(f"cpus={cpus!r}: need {n} non-empty lists of CPUs from "
                             f"{sorted(allowed)}")
        return out

    # -- availability ---------------------------------------------------------------------
    @staticmethod
    def available() -> tuple[bool, str]:
        """``(True, "ok")`` or ``(False, why and how to fix)``; for tests to skip on."""
        caps = probe()
        return caps.ok, caps.reason

    @staticmethod
    def delay_supported() -> tuple[bool, str]:
        """Whether ``delay`` can be applied (needs the kernel's netem qdisc)."""
        caps = probe()
        if not caps.ok:
            return False, caps.reason
        if not caps.netem:
            return False, ("kernel has no netem qdisc (CONFIG_NET_SCH_NETEM): delay is not "
                           "emulated; load sch_netem or use a kernel with it")
        return True, "ok"

    # -- names ----------------------------------------------------------------------------
    def index(self, address_or_index: str | int) -> int:
        """Node index of an address (``"10.77.0.2"``) or index (``1``, ``"1"``)."""
        key = str(address_or_index)
        if key.isdigit() and int(key) < self.num_nodes:
            return int(key)
        if key in self.addresses:
            return self.addresses.index(key)
        raise KeyError(f"no node {address_or_index!r}; nodes are {self.addresses}")

    def namespace(self, i: int) -> str:
        return f"{self.prefix}-{i}"

    def ifname(self, i: int) -> str:
        """Interface name inside node ``i``'s namespace (what GLOO_SOCKET_IFNAME names)."""
        self.index(i)
        return NODE_IFNAME

    def host_ifname(self, i: int) -> str:
        """Host (root namespace) end of node ``i``'s veth, a port of the bridge."""
        return f"{self.prefix}-h{self.index(i)}"

    @property
    def bridge(self) -> str:
        return f"{self.prefix}-br"

    @property
    def bandwidth_gbps(self) -> float | None:
        return None if self.rate_bps is None else self.rate_bps / 1e9

    # -- commands inside nodes ------------------------------------------------------------
    def exec_argv(self, address_or_index: str | int) -> list[str]:
        """argv prefix running a command in the node's namespace (pinned, gloo bound to eth0)."""
        i = self.index(address_or_index)
        return node_argv(self.namespace(i), self.cpus[i] if self.cpus else None)

    def run(self, address_or_index: str | int, argv: Sequence[str],
            **popen_kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside a node; returns the Popen (``down()`` ends it if still alive)."""
        proc = subprocess.Popen(self.exec_argv(address_or_index) + list(argv), **popen_kwargs)
        self._procs.append(proc)
        return proc

    # -- resource spec --------------------------------------------------------------------
    def write_resource_spec(self, path: str | os.PathLike[str], workers_per_node: int = 1) -> Path:
        """Write a Stratagem resource spec (YAML) listing the nodes; node 0 is the chief."""
        lines = [f"# Stratagem virtual cluster '{self.prefix}': {self.num_nodes} nodes, "
                 f"bandwidth {self._rate_text()}, delay {self._delay_text()} per link",
                 "nodes:"]
        for i, address in enumerate(self.addresses):
            cpus = self.cpus[i] if self.cpus else [0]
            lines.append(f"  - address: {address}")
            lines.append(f"    cpus: [{', '.join(map(str, cpus))}]")
            if i == 0:
                lines.append("    chief: true")
            if self.bandwidth_gbps is not None:
                lines.append(f"    network_bandwidth: {self.bandwidth_gbps:g}")
            lines.append(f"    workers: {workers_per_node}")
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("\n".join(lines) + "\n")
        return out

    def _rate_text(self) -> str:
        if self.rate_bps is None:
            return "unshaped"
        unit, scale = ("gbit", 1e9) if self.rate_bps >= 1e9 else ("mbit", 1e6)
        return f"{self.rate_bps / scale:g}{unit}"

    def _delay_text(self) -> str:
        text = f"{self.delay_s * 1e6:g}us"
        return text if self.delay_applied else f"{text} (NOT applied: no netem)"

    # -- lifecycle ------------------------------------------------------------------------
    def up(self) -> VirtualCluster:
        """Create the cluster (first removing leftovers with this prefix); undone on failure."""
        ok, reason = self.available()
        if not ok:
            raise VirtualClusterUnavailable(f"cannot build a virtual cluster: {reason}")
        self._check_delay()
        owner = read_state(self.prefix).get("owner_pid")
        if isinstance(owner, int) and owner != os.getpid() and _alive(owner):
            raise VirtualClusterError(
                f"virtual cluster prefix {self.prefix!r} is in use by process {owner}, which "
                "is still running; building it again would tear that cluster down. Fix: wait "
                "for it, or pick another prefix (--prefix) and subnet (--subnet)")
        cleanup(self.prefix)
        try:
            self._make_bridge()
            for i in range(self.num_nodes):
                self._make_node(i)
            self._write_state()
        except BaseException:
            self.down()
            raise
        return self

    def down(self) -> None:
        """Remove everything with this prefix and end processes started in it. Idempotent."""
        for proc in self._procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self._procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=2)
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        self._procs.clear()
        cleanup(self.prefix)

    def __enter__(self) -> VirtualCluster:
        """Build the cluster. In the main thread, where SIGTERM still has its default
        action, it raises SystemExit for the block's duration instead: a script killed
        with ``kill`` or ``timeout`` unwinds the ``with`` and tears the namespaces down
        (the default action ends the process on the spot and leaves them behind)."""
        self._old_sigterm = None
        if (threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL):
            self._old_sigterm = signal.signal(signal.SIGTERM, _exit_on_sigterm)
        try:
            return self.up()
        except BaseException:
            self._restore_sigterm()
            raise

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        try:
            self.down()
        finally:
            self._restore_sigterm()

    def _restore_sigterm(self) -> None:
        if self._old_sigterm is not None:
            signal.signal(signal.SIGTERM, self._old_sigterm)
            self._old_sigterm = None

    def _check_delay(self) -> None:
        if self.delay_s == 0:
            return
        ok, reason = self.delay_supported()
        self.delay_applied = ok
        if not ok:
            warnings.warn(f"virtual cluster delay {self.delay_s * 1e6:g}us ignored: {reason}",
                          RuntimeWarning, stacklevel=3)

    def _make_bridge(self) -> None:
        br = self.bridge
        _sh(["ip", "link", "add", br, "type", "bridge"])
        # Bridged frames skip iptables (cheaper, and host firewall rules stay out of the way).
        _sh(["ip", "link", "set", br, "type", "bridge", "nf_call_iptables", "0",
             "nf_call_ip6tables", "0", "nf_call_arptables", "0"], check=False)
        _sh(["ip", "link", "set", br, "addrgenmode", "none"], check=False)
        _sh(["ip", "link", "set", br, "up"])

    def _make_node(self, i: int) -> None:
        ns, host = self.namespace(i), self.host_ifname(i)
        ipn = ["ip", "-n", ns]
        _sh(["ip", "netns", "add", ns])
        _sh(["ip", "link", "add", host, "type", "veth", "peer", "name", NODE_IFNAME,
             "netns", ns])
        # addrgenmode none: no IPv6 link-local address, so eth0 has exactly one address
        # for gloo to pick and the links carry no IPv6 chatter.
        _sh(ipn + ["link", "set", NODE_IFNAME, "addrgenmode", "none"], check=False)
        _sh(ipn + ["addr", "add", f"{self.addresses[i]}/{self.subnet.prefixlen}",
                   "dev", NODE_IFNAME])
        _sh(ipn + ["link", "set", NODE_IFNAME, "up"])
        _sh(ipn + ["link", "set", "lo", "up"])
        _sh(["ip", "link", "set", host, "addrgenmode", "none"], check=False)
        _sh(["ip", "link", "set", host, "master", self.bridge])
        _sh(["ip", "link", "set", host, "up"])
        for argv in self.shaping_commands(["tc", "-n", ns], NODE_IFNAME):
            _sh(argv)
        for argv in self.shaping_commands(["tc"], host):
            _sh(argv)

    def shaping_commands(self, tc: list[str], dev: str) -> list[list[str]]:
        """tc commands shaping ``dev``'s egress: netem (delay) at the root, tbf (rate) below."""
        cmds: list[list[str]] = []
        parent = ["root", "handle", "1:"]
        if self.delay_s > 0 and self.delay_applied:
            in_flight = (self.rate_bps or 10e9) / 8 * self.delay_s / 1500
            limit = max(1000, math.ceil(4 * in_flight))
            cmds.append(tc + ["qdisc", "add", "dev", dev] + parent +
                        ["netem", "delay", f"{self.delay_s * 1e6:.0f}us", "limit", str(limit)])
            parent = ["parent", "1:1", "handle", "10:"]
        if self.rate_bps is not None:
            cmds.append(tc + ["qdisc", "add", "dev", dev] + parent + self._tbf_args())
        return cmds

    def _tbf_args(self) -> list[str]:
        """tbf at the link rate: a burst of >= 1 ms (and >= a 64 KiB GSO packet, so big
        segments pass unsplit) and a queue of QUEUE_SECONDS at the rate."""
        assert self.rate_bps is not None
        burst = max(64 * 1024 + 1514, math.ceil(self.rate_bps / 8 * 1e-3))
        limit = burst + math.ceil(self.rate_bps / 8 * QUEUE_SECONDS)
        return ["tbf", "rate", f"{self.rate_bps:.0f}bit", "burst", str(burst),
                "limit", str(limit)]

    def _write_state(self) -> None:
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        state = {"prefix": self.prefix, "addresses": self.addresses, "cpus": self.cpus,
                 "rate_bps": self.rate_bps, "delay_s": self.delay_s,
                 "delay_applied": self.delay_applied, "subnet": str(self.subnet),
                 "owner_pid": os.getpid()}
        (STATE_DIR / f"{self.prefix}.json").write_text(json.dumps(state, indent=1) + "\n")


def node_argv(namespace: str, cpus: Sequence[int] | None = None) -> list[str]:
    """argv prefix: enter ``namespace``, optionally pin to ``cpus``, bind gloo to eth0."""
    argv = ["ip", "netns", "exec", namespace]
    if cpus:
        argv += ["taskset", "-c", ",".join(map(str, cpus))]
    return argv + ["env"] + [f"{var}={NODE_IFNAME}" for var in IFNAME_ENV]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: existence check only
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        pass
    return True


def read_state(prefix: str = DEFAULT_PREFIX) -> dict[str, Any]:
    """The config ``up()`` recorded for ``prefix`` (empty if none)."""
    try:
        return dict(json.loads((STATE_DIR / f"{prefix}.json").read_text()))
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def find_node(address_or_index: str, prefix: str = DEFAULT_PREFIX) -> tuple[str, int]:
    """(namespace, index) of a live node, by address (looked up on the live eth0) or index."""
    live = [ns for ns in list_namespaces(prefix) if _is_ours(ns, prefix, r"-\d+")]
    if address_or_index.isdigit() and f"{prefix}-{address_or_index}" in live:
        return f"{prefix}-{address_or_index}", int(address_or_index)
    for ns in live:
        if _namespace_address(ns) == address_or_index:
            return ns, int(ns.rsplit("-", 1)[1])
    known = {ns: _namespace_address(ns) for ns in live}
    raise LookupError(f"no live virtual node {address_or_index!r} with prefix {prefix!r} "
                      f"(live: {known or 'none'}); start one with `vcluster.py up`")


def _exit_on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


# -- command line -----------------------------------------------------------------------------
class _Teardown:
    """CLI guard: tear down on exit, exceptions, SIGINT and SIGTERM; forwards signals to the
    running child instead while there is one."""

    def __init__(self, vc: VirtualCluster) -> None:
        self.vc = vc
        self.child: subprocess.Popen[Any] | None = None
        self.forwarded = 0
        self.armed = True

    def __enter__(self) -> _Teardown:
        atexit.register(self._atexit)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        if self.armed:
            self.vc.down()
        self.armed = False
        atexit.unregister(self._atexit)

    def keep(self) -> None:
        """Leave the cluster up on exit (``up`` succeeded)."""
        self.armed = False

    def _atexit(self) -> None:
        if self.armed:
            self.vc.down()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        child = self.child
        if child is None or child.poll() is not None:
            raise SystemExit(128 + signum)
        self.forwarded += 1
        if self.forwarded > 2:
            child.kill()
        elif signum != signal.SIGINT or not _child_got_terminal_sigint():
            child.send_signal(signum)


def _child_got_terminal_sigint() -> bool:
    """True if we are in the terminal's foreground group: Ctrl-C already reached the child."""
    try:
        return os.tcgetpgrp(sys.stdin.fileno()) == os.getpgrp()
    except OSError:
        return False


def _cluster_from_args(args: argparse.Namespace) -> VirtualCluster:
    return VirtualCluster(
        args.nodes,
        bandwidth=None if args.bandwidth.lower() == "none" else args.bandwidth,
        delay=None if args.delay.lower() == "none" else args.delay,
        cpus=parse_cpus(args.cpus) if args.cpus else None,
        prefix=args.prefix, subnet=args.subnet)


def _describe(vc: VirtualCluster) -> str:
    nodes = ", ".join(f"{vc.namespace(i)}={a}" for i, a in enumerate(vc.addresses))
    return (f"virtual cluster '{vc.prefix}' up: {nodes}; bandwidth {vc._rate_text()}, "
            f"delay {vc._delay_text()} per link")


def cmd_up(args: argparse.Namespace) -> int:
    vc = _cluster_from_args(args)
    with _Teardown(vc) as guard:
        vc.up()
        if args.spec:
            vc.write_resource_spec(args.spec, args.workers_per_node)
        guard.keep()
    print(_describe(vc))
    if args.spec:
        print(f"resource spec: {args.spec}")
    print(f"tear down with: {shlex.quote(sys.executable)} {shlex.quote(str(_tool_path()))} "
          f"down{_prefix_opt(args.prefix)}")
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    removed = cleanup(args.prefix)
    print(f"removed: {', '.join(removed) or 'nothing'}")
    return 0


def cmd_exec(args: argparse.Namespace) -> int:
    argv = _strip_dashes(args.cmd)
    if not argv:
        print("vcluster exec: no command given (usage: exec ADDRESS -- cmd...)", file=sys.stderr)
        return 2
    try:
        ns, i = find_node(args.node, args.prefix)
    except LookupError as exc:
        print(f"vcluster exec: {exc}", file=sys.stderr)
        return NO_NODE_EXIT
    cpus = read_state(args.prefix).get("cpus")
    full = node_argv(ns, cpus[i] if cpus and i < len(cpus) else None) + argv
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvp(full[0], full)  # same pid: exit codes, signals and stdio pass straight through


def cmd_status(args: argparse.Namespace) -> int:
    namespaces = [ns for ns in list_namespaces(args.prefix) if _is_ours(ns, args.prefix, r"-\d+")]
    if not namespaces:
        print(f"no virtual cluster with prefix {args.prefix!r}")
        return 1
    state = read_state(args.prefix)
    print(f"virtual cluster '{args.prefix}': {len(namespaces)} nodes; config {state or '?'}")
    for ns in sorted(namespaces, key=lambda n: int(n.rsplit("-", 1)[1])):
        pids = _sh(["ip", "netns", "pids", ns], check=False).stdout.split()
        print(f"  {ns}: {NODE_IFNAME} {_namespace_address(ns)}, {len(pids)} processes")
        host = f"{args.prefix}-h{ns.rsplit('-', 1)[1]}"
        for tc, dev in ((["tc", "-n", ns], NODE_IFNAME), (["tc"], host)):
            for line in _sh(tc + ["qdisc", "show", "dev", dev], check=False).stdout.splitlines():
                print(f"    {dev}: {line.strip()}")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    argv = _strip_dashes(args.cmd)
    if not argv:
        print("vcluster run: no command given (usage: run --nodes K -- cmd...)", file=sys.stderr)
        return 2
    vc = _cluster_from_args(args)
    with _Teardown(vc) as guard, tempfile.TemporaryDirectory(prefix="vcluster-") as tmp:
        vc.up()
        spec = Path(args.spec or Path(tmp) / "resource_spec.yml").absolute()
        vc.write_resource_spec(spec, args.workers_per_node)
        print(_describe(vc), file=sys.stderr)
        shell = (f"{shlex.quote(sys.executable)} {shlex.quote(str(_tool_path()))} exec"
                 f"{_prefix_opt(args.prefix)} {{address}} --")
        env = {**os.environ, SPEC_ENV: str(spec), REMOTE_SHELL_ENV: shell}
        guard.child = vc.run(0, argv, env=env)
        code = guard.child.wait()
        guard.child = None
    return code if code >= 0 else 128 - code


def _strip_dashes(cmd: list[str]) -> list[str]:
    return cmd[1:] if cmd[:1] == ["--"] else cmd


def _prefix_opt(prefix: str) -> str:
    return "" if prefix == DEFAULT_PREFIX else f" --prefix {prefix}"


def _tool_path() -> Path:
    return Path(__file__).resolve()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vcluster.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--prefix", default=DEFAULT_PREFIX, help="name prefix (default: sgvc)")

    def shape(sp: argparse.ArgumentParser) -> None:
        common(sp)
        sp.add_argument("--nodes", type=int, required=True, help="number of nodes")
        sp.add_argument("--bandwidth", default="1gbit", help="per link, tc units, or 'none'")
        sp.add_argument("--delay", default="0.1ms", help="one-way per link, or 'none'")
        sp.add_argument("--cpus", help="pin nodes to CPUs: '0:1' or '0,1:2-3'")
        sp.add_argument("--subnet", default=DEFAULT_SUBNET)
        sp.add_argument("--spec", help="write a Stratagem resource spec here")
        sp.add_argument("--workers-per-node", type=int, default=1)

    up = sub.add_parser("up", help="create the cluster and leave it up")
    shape(up)
    up.set_defaults(func=cmd_up)
    run = sub.add_parser("run", help="create, run cmd in node 0, always tear down")
    shape(run)
    run.add_argument("cmd", nargs=argparse.REMAINDER)
    run.set_defaults(func=cmd_run)
    ex = sub.add_parser("exec", help="run cmd inside a node (the launcher's remote shell)")
    common(ex)
    ex.add_argument("node", help="node address (e.g. 10.77.0.2) or index")
    ex.add_argument("cmd", nargs=argparse.REMAINDER)
    ex.set_defaults(func=cmd_exec)
    for name, func, text in (("down", cmd_down, "remove the cluster"),
                             ("status", cmd_status, "show nodes and qdiscs")):
        sp = sub.add_parser(name, help=text)
        common(sp)
        sp.set_defaults(func=func)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (VirtualClusterUnavailable, VirtualClusterError, ValueError) as exc:
        print(f"vcluster {args.command}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())


"""Is a node usable? A bounded check for ``stratagem run --nnodes MIN:MAX``.

A node is reachable when the launcher can run a command on it (ssh or the ``--remote-shell``
template, as its agent would be started) *and* from there open a TCP connection back to this
machine's probe listener, bound to the address of the spec node the launcher runs on: the
node must reach the job's network, not only the launcher's remote shell (in a virtual cluster,
``ip netns exec`` works while the node's link is down). Every probe runs with a timeout and
all nodes are probed at once, so a dead node costs at most ``timeout`` seconds, never a hang.
Nodes whose address belongs to this machine are reachable by definition.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence

from stratagem.errors import StratagemError
from stratagem.launch.netif import is_local_address
from stratagem.launch.remote_shell import remote_command, require_ssh, ssh_argv, template_argv
from stratagem.resource import Node, ResourceSpec

PROBE_TIMEOUT_S = 3.0
START_S = 5.0  # on top of the timeout: starting the remote shell and Python
# Run on the node: connect to the launcher's listener (argv: host, port, timeout).
CONNECT = ("import socket, sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), "
           "timeout=float(sys.argv[3])).close()")


class ProbeListener:
    """A TCP listener on ``address`` that accepts and closes connections (nothing is read or
    written), for the probes' connect-back; a context manager."""

    def __init__(self, address: str) -> None:
        self.address = address
        self._sock = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET)
        self._sock.bind((address, 0))
        self._sock.listen(16)
        self.port = int(self._sock.getsockname()[1])
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            conn.close()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()

    def __enter__(self) -> ProbeListener:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def probe_argv(spec: ResourceSpec, node: Node, remote_shell: str | None,
               listener: tuple[str, int] | None, timeout: float) -> list[str]:
    """The command that checks ``node`` from here: the remote shell running ``true``, or,
    with a ``listener`` (host, port), the node's Python connecting back to it."""
    ssh = spec.ssh_for(node)
    if listener is None:
        argv = ["true"]
    else:
        python = "python" if ssh.python_venv else sys.executable
        argv = [python, "-c", CONNECT, listener[0], str(listener[1]), f"{timeout:g}"]
    line = remote_command(os.getcwd(), {}, argv, ssh.python_venv)
    if remote_shell:
        return template_argv(remote_shell, node.address, line)
    require_ssh()
    argv = ssh_argv(node, ssh, line)
    argv[1:1] = ["-o", f"ConnectTimeout={max(1, int(timeout))}"]
    return argv


def probe_nodes(spec: ResourceSpec, nodes: Sequence[Node], remote_shell: str | None,
                timeout: float = PROBE_TIMEOUT_S,
                is_local: Callable[[str], bool] = is_local_address) -> dict[str, bool]:
    """Address -> reachable, for ``nodes`` of ``spec``, all probed at once within
    ``timeout`` seconds (plus the process start-up)."""
    here = next((n.address for n in spec.nodes if is_local(n.address)), None)
    result = {n.address: True for n in nodes if is_local(n.address)}
    remote = [n for n in nodes if n.address not in result]
    if not remote:
        return result
    with contextlib.ExitStack() as stack:
        listener = None
        if here is not None:
            with contextlib.suppress(OSError):
                lst = stack.enter_context(ProbeListener(here))
                listener = (lst.address, lst.port)
        procs = {}
        for node in remote:
            try:
                procs[node.address] = subprocess.Popen(
                    probe_argv(spec, node, remote_shell, listener, timeout),
                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL, start_new_session=True)
            except OSError:
                result[node.address] = False
        deadline = time.monotonic() + timeout + START_S
        for address, proc in procs.items():
            try:
                left = max(0.0, deadline - time.monotonic())
                result[address] = proc.wait(timeout=left) == 0
            except subprocess.TimeoutExpired:
                with contextlib.suppress(OSError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                result[address] = False
    return result


class NodePool:
    """The nodes a ``--nnodes MIN:MAX`` job may use: the spec file's nodes (re-read on every
    look, so a node added to the file counts), probed for reachability.

    It also damps flapping: a node the job lost must stay reachable for a while before the
    job grows back onto it -- one probe period after its first loss, doubling with every
    further loss up to a cap -- so a node whose link comes and goes does not stop and restart
    the job at every probe. A node never lost (a late one, one added to the spec) joins at
    its first answer.
    """

    def __init__(self, spec_path: str, remote_shell: str | None, min_nodes: int,
                 max_nodes: int, timeout: float = PROBE_TIMEOUT_S) -> None:
        self.spec_path = spec_path
        self.remote_shell = remote_shell
        self.min_nodes = min_nodes
        self.max_nodes = max_nodes
        self.timeout = timeout
        self.spec = ResourceSpec.from_file(spec_path)
        self.losses: dict[str, int] = {}  # address -> times the job lost it
        self.up_since: dict[str, float] = {}  # address -> start of its current answering run

    def mark_lost(self, addresses: Sequence[str]) -> None:
        """The job lost these nodes (it shrank without them)."""
        for a in addresses:
            self.losses[a] = self.losses.get(a, 0) + 1
            self.up_since.pop(a, None)

    def settle_s(self, address: str, interval: float, cap: float) -> float:
        """How long ``address`` must keep answering before the job grows onto it: 0 for a
        node never lost, else ``interval * 2**(losses - 1)``, at most ``cap``."""
        losses = self.losses.get(address, 0)
        return 0.0 if not losses else min(cap, interval * 2 ** (losses - 1))

    def settled(self, state: dict[str, bool], now: float, interval: float, cap: float
                ) -> tuple[list[str], dict[str, float]]:
        """Record a probe started at ``now`` (address -> answered); returns the answering
        nodes that have answered long enough to grow onto, and the seconds each other
        answering node still has to wait."""
        ready, waiting = [], {}
        for a, up in state.items():
            if not up:
                self.up_since.pop(a, None)
                continue
            since = self.up_since.setdefault(a, now)
            left = self.settle_s(a, interval, cap) - (now - since)
            if left <= 1e-6:
                ready.append(a)
            else:
                waiting[a] = left
        return ready, waiting

    def listed(self) -> ResourceSpec:
        """The spec file as it is now (the last good read when it is being edited)."""
        with contextlib.suppress(StratagemError):
            self.spec = ResourceSpec.from_file(self.spec_path)
        return self.spec

    def reachable(self, addresses: Sequence[str]) -> dict[str, bool]:
        """Address -> reachable now, for those of ``addresses`` the spec lists."""
        spec = self.listed()
        nodes = [n for n in spec.nodes if n.address in set(addresses)]
        return probe_nodes(spec, nodes, self.remote_shell, self.timeout)

    def choose(self, keep: Sequence[str], extra: Sequence[str]) -> tuple[str, ...]:
        """The nodes to run on: ``keep``, then ``extra`` in spec order, at most MAX."""
        order = [n.address for n in self.listed().nodes]
        chosen = [a for a in order if a in set(keep)]
        chosen += [a for a in order if a in set(extra) and a not in chosen]
        chosen = chosen[:self.max_nodes]
        return tuple(a for a in order if a in set(chosen))

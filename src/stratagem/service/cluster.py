"""``stratagem cluster up|down|status``: a local Ray head (or an existing cluster) and the
scheduler daemon, recorded in ``<dir>/cluster.json`` so that ``down`` stops exactly what
``up`` started."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from stratagem.errors import StratagemError
from stratagem.service.api import SERVICE_FILE, ServiceClient

CLUSTER_FILE = "cluster.json"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spawn(argv: list[str], log: Path,
           env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                                stdin=subprocess.DEVNULL, start_new_session=True)


def _token_env(ray_bin: str) -> dict[str, str]:
    """The environment for a local head and its scheduler: Ray's token authentication on
    (the token in ~/.ray/auth_token, made if missing) where this Ray has it and the user
    did not choose (``RAY_AUTH_MODE``); head and drivers must agree on it."""
    env = dict(os.environ)
    if "RAY_AUTH_MODE" in env:
        return env
    made = subprocess.run([ray_bin, "get-auth-token", "--generate"], capture_output=True,
                          stdin=subprocess.DEVNULL, timeout=120, check=False)
    if made.returncode == 0:  # Ray >= 2.52; older ones have no token authentication
        env["RAY_AUTH_MODE"] = "token"
    return env


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _wait_for_head(proc: subprocess.Popen[bytes], d: Path, timeout: float) -> None:
    """Until ``ray start`` reports the head started (its token and ports are then in
    place: a driver that connects earlier can fail to authenticate)."""
    deadline = time.monotonic() + timeout
    while "Ray runtime started" not in (d / "ray.log").read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            down(d)
            raise StratagemError("the local Ray head did not start:\n" + _tail(d / "ray.log"),
                                 where=str(d), fix="see ray.log there; is another Ray "
                                 "running with the same port?")
        time.sleep(0.3)


def up(directory: str | Path, address: str | None = None, num_cpus: int | None = None,
       gpus: int = 0, gpu_resource: str = "GPU", policy: str = "pollux",
       interval: float = 5.0, host: str = "127.0.0.1", token_file: str | None = None,
       node_cost: float | None = None, max_nodes: int = 16, timeout: float = 120.0) -> dict:
    """Start a local Ray head (unless ``address``) and the scheduler; the cluster record."""
    d = Path(directory).resolve()
    d.mkdir(parents=True, exist_ok=True)
    if (d / CLUSTER_FILE).exists():
        raise StratagemError("a cluster is already up here", where=str(d),
                             fix="'stratagem cluster down' first, or another --dir")
    record: dict = {"address": address, "ray_pid": None}
    env = None
    if address is None:
        env = _token_env(str(Path(sys.executable).with_name("ray")))
        port = _free_port()
        resources = {gpu_resource: gpus} if gpus and gpu_resource != "GPU" else {}
        argv = [str(Path(sys.executable).with_name("ray")), "start", "--head", "--block",
                f"--port={port}", "--include-dashboard=false", "--disable-usage-stats",
                f"--num-cpus={num_cpus or os.cpu_count() or 1}",
                f"--resources={json.dumps(resources)}"]
        if gpu_resource == "GPU":
            argv.append(f"--num-gpus={gpus}")
        ray_proc = _spawn(argv, d / "ray.log", env)
        record.update(address=f"127.0.0.1:{port}", ray_pid=ray_proc.pid)
        (d / CLUSTER_FILE).write_text(json.dumps(record))
        _wait_for_head(ray_proc, d, timeout)
    sched = [sys.executable, "-m", "stratagem.service.daemon", "--dir", str(d),
             "--address", record["address"], "--host", host, "--policy", policy,
             "--interval", str(interval), "--gpu-resource", gpu_resource]
    if node_cost is not None:
        sched += ["--node-cost", str(node_cost), "--max-nodes", str(max_nodes)]
    if token_file:
        sched += ["--token-file", str(Path(token_file).resolve())]
    (d / SERVICE_FILE).unlink(missing_ok=True)
    proc = _spawn(sched, d / "scheduler.log", env)
    record["scheduler_pid"] = proc.pid
    (d / CLUSTER_FILE).write_text(json.dumps(record))
    deadline = time.monotonic() + timeout
    while not (d / SERVICE_FILE).exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            down(d)
            raise StratagemError("the scheduler did not start:\n" + _tail(d /
                                 "scheduler.log"), where=str(d), fix="check the Ray "
                                 "address; see scheduler.log and ray.log there")
        time.sleep(0.3)
    record["address"] = _client_address(d, record["address"])
    (d / CLUSTER_FILE).write_text(json.dumps(record))
    return record


def _client_address(d: Path, started: str) -> str:
    """The Ray address as the scheduler's Ray connection reports it (what ``status`` prints
    and what a client or another node should use: a local head listens on this machine's
    address, not only on the loopback one ``up`` reached it by); ``started`` if the
    scheduler cannot say."""
    try:
        return str(ServiceClient(d).status().get("address") or started)
    except StratagemError:
        return started


def _stop(pid: int | None, timeout: float = 30.0) -> None:
    if not pid:
        return
    try:
        os.killpg(pid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        try:  # our child when started by this process: reap it
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return
        except ChildProcessError:
            pass
        time.sleep(0.2)
    os.killpg(pid, signal.SIGKILL)


def _forget_head(address: str) -> None:
    """Remove Ray's pointer to the head we stopped (what ``ray stop`` does), so that a
    later ``ray.init()`` does not try to join a cluster that is gone."""
    import tempfile

    port = address.rsplit(":", 1)[-1]
    pointer = Path(tempfile.gettempdir()) / "ray" / "ray_current_cluster"
    try:
        if pointer.read_text().strip().rsplit(":", 1)[-1] == port:
            pointer.unlink()
    except OSError:
        pass


def down(directory: str | Path) -> None:
    """Stop the scheduler and (if ``up`` started it) the local Ray head with its jobs."""
    d = Path(directory).resolve()
    try:
        record = json.loads((d / CLUSTER_FILE).read_text())
    except (OSError, ValueError):
        raise StratagemError("no cluster is up here", where=str(d),
                             fix="'stratagem cluster up', or pass the cluster's --dir") from None
    _stop(record.get("scheduler_pid"))
    if record.get("ray_pid"):
        _stop(record["ray_pid"])
        _forget_head(record["address"])
    (d / CLUSTER_FILE).unlink(missing_ok=True)
    (d / SERVICE_FILE).unlink(missing_ok=True)


def status(directory: str | Path) -> dict:
    return ServiceClient(directory).status()

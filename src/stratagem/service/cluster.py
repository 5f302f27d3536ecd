"""``stratagem cluster up|down|status``: a local Ray head (or an existing cluster) and the
scheduler daemon, recorded in ``<dir>/cluster.json`` so that ``down`` stops exactly what
``up`` started.

Each process ``up`` starts is recorded with its identity (PID, start time since boot, boot
id and command line, from ``/proc``); ``down`` signals a process group only while its
leader still has that identity, so a stale record whose PID was reused never stops someone
else's processes. ``up`` on a directory whose scheduler died (``kill -9``) while the Ray head
lives starts the scheduler alone, which re-attaches to the running jobs.

Where the time goes: the head's own start (``ray start``: GCS, raylet, agents) dominates
``up``; the scheduler's imports overlap with it (the daemon waits for the head itself). Ray's
token is written by ``up`` (no ``ray get-auth-token`` subprocess). On ``down`` Ray's head
would wait up to 30 s to drain the node (``RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S``, meant for
Ray Serve): ``up`` sets it to 0 unless the user chose, and ``down`` gives the head's
processes (the jobs' replicas among them: they checkpoint on SIGTERM) ``grace`` seconds
before it kills what is left.

Priority: Ray starts its worker processes at niceness 15, and the jobs' replicas (children
of worker actors) inherit it: on a node with any other work they would get a few percent of
a core (issue 47: starts took minutes, each worker's imports starved). ``up`` starts the
head's workers at niceness 0 (``RAY_worker_niceness``) unless the user set it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from stratagem.errors import StratagemError
from stratagem.safeload import load_json
from stratagem.service.api import SERVICE_FILE, ServiceClient
from stratagem.service.private_file import private_dir, write_private

CLUSTER_FILE = "cluster.json"
RAY_TOKEN_FILE = "ray_token"
HEAD_READY = "Ray runtime started"
DOWN_GRACE_S = 5.0  # seconds the head's processes have between SIGTERM and SIGKILL
SCHEDULER_GRACE_S = 2.0  # the same for the scheduler (at most)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- process identity ------------------------------------------------------------------------
def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def identity(pid: int) -> dict[str, Any] | None:
    """What tells this process apart from a later one with the same PID: its start time
    (clock ticks since boot), the boot id, its command line; its process group and state.
    None when there is no such process (or no ``/proc`` to ask)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, ValueError):
        return None
    fields = stat.rsplit(")", 1)[-1].split()  # after "pid (comm)": state is field 3
    return {"pid": pid, "start": int(fields[19]), "boot": _boot_id(),
            "cmdline": [a.decode(errors="replace") for a in cmdline.split(b"\0") if a],
            "pgid": int(fields[2]), "state": fields[0]}


def _record_of(pid: int, argv: list[str], wait: float = 5.0) -> dict[str, Any] | None:
    """The identity to record of a process just started with ``argv``. The parent of an
    ``execve`` can read ``/proc/PID/cmdline`` before the kernel has set the new program's
    arguments (empty, or the parent's): wait until they end with ``argv[1:]`` (a script's
    interpreter may come first)."""
    deadline = time.monotonic() + wait
    while True:
        ident = identity(pid)
        if ident is None:
            return None
        if ident["cmdline"][-len(argv) + 1:] == argv[1:] or time.monotonic() > deadline:
            return {k: ident[k] for k in ("pid", "start", "boot", "cmdline")}
        time.sleep(0.01)


def is_ours(record: dict[str, Any] | None) -> bool:
    """Whether the recorded process still runs, is the same process (start time, boot and
    command line), and still leads its process group (what ``down`` signals)."""
    if not isinstance(record, dict) or not isinstance(record.get("pid"), int):
        return False
    now = identity(record["pid"])
    return (now is not None and now["state"] != "Z" and now["pgid"] == record["pid"]
            and all(now[k] == record.get(k) for k in ("start", "boot", "cmdline")))


def _group_alive(pgid: int) -> bool:
    """Whether any process of group ``pgid`` is alive (zombies do not count)."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            ident = identity(int(entry.name))
            if ident is not None and ident["pgid"] == pgid and ident["state"] != "Z":
                return True
    return False


# -- starting ----------------------------------------------------------------------------------
def _spawn(argv: list[str], log: Path,
           env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                                stdin=subprocess.DEVNULL, start_new_session=True)


def _ray_has_tokens() -> bool:
    """Whether the installed Ray has token authentication (Ray >= 2.52), without importing
    it (an import takes seconds)."""
    spec = importlib.util.find_spec("ray")
    return bool(spec and spec.origin and (Path(spec.origin).parent / "_private" /
                                          "authentication").is_dir())


# Ray settings of a head ``up`` starts, unless the user set them (module doc): no 30 s drain
# on SIGTERM; workers (and so the jobs' replicas) at normal priority, not Ray's niceness 15.
RAY_DEFAULTS = {"RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0", "RAY_worker_niceness": "0"}


def _ray_env(d: Path) -> dict[str, str]:
    """The environment of a local head and its scheduler: Ray's token authentication on
    (the token in ``<dir>/ray_token``, mode 0600, made if missing) where this Ray has it and
    the user did not choose (``RAY_AUTH_MODE``); head and drivers must agree on it; and
    :data:`RAY_DEFAULTS` where the user did not set them."""
    env = {**RAY_DEFAULTS, **os.environ}
    if "RAY_AUTH_MODE" in env or not _ray_has_tokens():
        return env
    token = d / RAY_TOKEN_FILE
    if not token.is_file() or token.is_symlink():
        write_private(token, secrets.token_hex(32))
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token))
    return env


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _wait_for(done: Any, proc: subprocess.Popen[bytes], d: Path, timeout: float,
              what: str, log: str, fix: str, undo: Any = None) -> None:
    """Until ``done()``; when ``proc`` exits or ``timeout`` passes first, ``undo()`` (by
    default: stop all that the record names) and an error with the log's tail."""
    deadline = time.monotonic() + timeout
    while not done():
        if proc.poll() is not None or time.monotonic() > deadline:
            (undo or (lambda: down(d)))()
            raise StratagemError(f"{what} did not start:\n" + _tail(d / log), where=str(d),
                                 fix=fix)
        time.sleep(0.1)


def _read_record(d: Path) -> dict[str, Any] | None:
    try:
        raw = (d / CLUSTER_FILE).read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise StratagemError(f"cannot read {CLUSTER_FILE}: {exc.strerror}", where=str(d),
                             fix="check the directory's permissions") from None
    record = load_json(raw, str(d / CLUSTER_FILE), fix=f"remove {CLUSTER_FILE} and stop "
                       "the cluster's processes by hand")
    if not isinstance(record, dict):
        raise StratagemError("not a cluster record", where=str(d / CLUSTER_FILE),
                             fix=f"remove {CLUSTER_FILE} and stop the processes by hand")
    return record


def _start_scheduler(d: Path, record: dict[str, Any], env: dict[str, str] | None,
                     timeout: float) -> subprocess.Popen[bytes]:
    (d / SERVICE_FILE).unlink(missing_ok=True)
    proc = _spawn(record["scheduler_argv"], d / "scheduler.log", env)
    record["scheduler"] = _record_of(proc.pid, record["scheduler_argv"])
    record["scheduler_pid"] = proc.pid
    write_private(d / CLUSTER_FILE, json.dumps(record))
    return proc


def up(directory: str | Path, address: str | None = None, num_cpus: int | None = None,
       gpus: int = 0, gpu_resource: str = "GPU", policy: str = "pollux",
       interval: float = 5.0, host: str = "127.0.0.1", token_file: str | None = None,
       node_cost: float | None = None, max_nodes: int = 16, timeout: float = 120.0,
       min_runtime: float = 60.0) -> dict:
    """Start a local Ray head (unless ``address``) and the scheduler; the cluster record
    (``restarted``: true when only a dead scheduler was started again)."""
    d = private_dir(Path(directory).resolve())
    record = _read_record(d)
    if record is not None:
        if is_ours(record.get("scheduler")):
            raise StratagemError("a cluster is already up here", where=str(d),
                                 fix="'stratagem cluster down' first, or another --dir")
        head_lives = is_ours(record.get("ray")) if record.get("ray_pid") else bool(
            record.get("address"))
        if head_lives and record.get("scheduler_argv"):  # the scheduler alone died
            env = _ray_env(d) if record.get("ray_pid") else None
            proc = _start_scheduler(d, record, env, timeout)
            _wait_for(lambda: (d / SERVICE_FILE).exists(), proc, d, timeout,
                      "the scheduler", "scheduler.log", "see scheduler.log there",
                      undo=lambda: _stop(record["scheduler"], DOWN_GRACE_S))  # not the head
            return {**record, "restarted": True}
        (d / CLUSTER_FILE).unlink()  # nothing it names runs any more: a stale record
    record = {"address": address, "ray_pid": None, "ray": None}
    env = None
    ray_proc = None
    if address is None:
        env = _ray_env(d)
        port = _free_port()
        resources = {gpu_resource: gpus} if gpus and gpu_resource != "GPU" else {}
        argv = [str(Path(sys.executable).with_name("ray")), "start", "--head", "--block",
                f"--port={port}", "--include-dashboard=false", "--disable-usage-stats",
                "--include-log-monitor=false",  # workers' output goes to files: one
                # Python process less to start on the head
                f"--num-cpus={num_cpus or os.cpu_count() or 1}",
                f"--resources={json.dumps(resources)}"]
        if gpu_resource == "GPU":
            argv.append(f"--num-gpus={gpus}")
        (d / "ray.log").unlink(missing_ok=True)  # the daemon waits for the head's line
        ray_proc = _spawn(argv, d / "ray.log", env)
        record.update(address=f"127.0.0.1:{port}", ray_pid=ray_proc.pid,
                      ray=_record_of(ray_proc.pid, argv))
        write_private(d / CLUSTER_FILE, json.dumps(record))
    sched = [sys.executable, "-m", "stratagem.service.daemon", "--dir", str(d),
             "--address", record["address"], "--host", host, "--policy", policy,
             "--interval", str(interval), "--gpu-resource", gpu_resource,
             "--min-runtime", str(min_runtime)]
    if ray_proc is not None:  # it imports while the head starts, then waits for it
        sched += ["--head-log", str(d / "ray.log"), "--head-timeout", str(timeout)]
    if node_cost is not None:
        sched += ["--node-cost", str(node_cost), "--max-nodes", str(max_nodes)]
    if token_file:
        sched += ["--token-file", str(Path(token_file).resolve())]
    record["scheduler_argv"] = sched
    proc = _start_scheduler(d, record, env, timeout)
    if ray_proc is not None:
        _wait_for(lambda: HEAD_READY in (d / "ray.log").read_text(errors="replace"),
                  ray_proc, d, timeout, "the local Ray head", "ray.log",
                  "see ray.log there; is another Ray running with the same port?")
    _wait_for(lambda: (d / SERVICE_FILE).exists(), proc, d, timeout, "the scheduler",
              "scheduler.log", "check the Ray address; see scheduler.log and ray.log there")
    if ray_proc is not None:
        record["address"] = _client_address(d, record["address"])
        write_private(d / CLUSTER_FILE, json.dumps(record))
    return record


def _client_address(d: Path, started: str) -> str:
    """The address a client or another node should use for the head started here: Ray's
    own node address (the one ``status`` prints; a local head listens on this machine's
    address, not only on the loopback one ``up`` reached it by), read from the head's
    start-up lines in ``ray.log``; ``started`` where they do not say."""
    port = started.rsplit(":", 1)[-1]
    try:
        text = (d / "ray.log").read_text(errors="replace")
    except OSError:
        return started
    found = re.search(r"Local node IP:?\s*([0-9A-Fa-f:.]+)", text)
    return f"{found.group(1)}:{port}" if found else started


# -- stopping ----------------------------------------------------------------------------------
def _stop(record: dict[str, Any] | None, grace: float) -> str:
    """SIGTERM the recorded process group, SIGKILL what is left after ``grace`` seconds;
    what was done. Nothing is signalled unless the leader is still the recorded process."""
    if not record:
        return "none recorded"
    pid = record["pid"]
    if not is_ours(record):
        return "gone" if identity(pid) is None or identity(pid)["state"] == "Z" else (
            f"not stopped: PID {pid} is another process now")
    try:
        os.killpg(pid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        return "gone"
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and _group_alive(pid):
        with contextlib.suppress(ChildProcessError):  # our child (started here): reap it
            os.waitpid(pid, os.WNOHANG)
        time.sleep(0.1)
    if not _group_alive(pid):
        return "stopped"
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        return "stopped"
    deadline = time.monotonic() + 10.0
    while _group_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)
    return f"killed after {grace:g} s"


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


def down(directory: str | Path, grace: float = DOWN_GRACE_S) -> dict[str, str]:
    """Stop the scheduler and (if ``up`` started it) the local Ray head with its jobs;
    what happened to each (``stopped``, ``gone``, ``not stopped: ...``)."""
    d = Path(directory).resolve()
    record = _read_record(d)
    if record is None:
        raise StratagemError("no cluster is up here", where=str(d),
                             fix="'stratagem cluster up', or pass the cluster's --dir")
    # the scheduler saves nothing on the way out (every change is a committed transaction)
    done = {"scheduler": _stop(record.get("scheduler"), min(grace, SCHEDULER_GRACE_S))}
    if record.get("ray_pid"):
        done["ray"] = _stop(record.get("ray"), grace)
        _forget_head(record["address"])
    (d / CLUSTER_FILE).unlink(missing_ok=True)
    (d / SERVICE_FILE).unlink(missing_ok=True)
    return done


def status(directory: str | Path) -> dict:
    return ServiceClient(directory).status()

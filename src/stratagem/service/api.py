"""The control plane: a small JSON-over-HTTP API on the scheduler, and its client.

The server binds to 127.0.0.1 unless told otherwise, and every request must carry the
service's token (``Authorization: Bearer ...``), which it writes with its address to
``<cluster dir>/service.json`` (mode 0600). Binding to any other address without an explicit
token is refused. Bodies are JSON (at most 1 MiB, parsed within :mod:`stratagem.safeload`'s
bounds); job files are checked again on the server.

Bounded whatever clients do (:class:`ControlLimits`): at most ``max_connections`` open at
once (when full, the oldest is closed to make room), a client silent for ``read_timeout``
seconds mid-request gets 408 and is closed, no connection lives past ``deadline`` seconds,
and refused or broken clients are logged in one line each, at most one line per
``log_every`` seconds (the rest counted). Every request gets an HTTP answer with a reason
(400 for a malformed one); none gets a dropped connection or a traceback in the log.

Routes: ``GET /jobs`` (rows and the ``ls`` table), ``POST /jobs`` (``{"job": mapping,
"replace": bool}``: a name that already ran is refused unless ``replace``),
``DELETE /jobs/NAME``, ``GET /jobs/NAME/logs?rank=R&offset=N&after=E``, ``GET /status``,
``POST /nodes/NODE_ID/drain`` (a preemption notice: the jobs there checkpoint and move).
"""

from __future__ import annotations

import collections
import contextlib
import hmac
import json
import logging
import secrets
import shutil
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from stratagem.errors import StratagemError
from stratagem.safeload import load_json
from stratagem.service import store as st
from stratagem.service.jobfile import JobSpec, load_job_file, parse_job
from stratagem.service.private_file import write_private
from stratagem.service.scheduler import job_dirs, status_table

log = logging.getLogger("stratagem.service")
MAX_BODY = 1 << 20
LOOPBACK = ("127.0.0.1", "localhost", "::1")
SERVICE_FILE = "service.json"


@dataclass(frozen=True)
class ControlLimits:
    """Bounds of the control plane (module doc); seconds and counts."""

    max_connections: int = 32
    read_timeout: float = 5.0
    deadline: float = 30.0
    max_body: int = MAX_BODY
    log_every: float = 10.0


def job_record(job: st.JobRow, alloc: st.AllocationRow | None) -> dict[str, Any]:
    return {"name": job.name, "state": job.state, "replicas": len(alloc.replicas) if alloc
            else 0, "restarts": job.restarts, "failures": job.failures,
            "submitted": job.submitted, "started": job.started, "finished": job.finished,
            "message": job.message, "spec": job.spec.to_dict()}


class _Handler(BaseHTTPRequestHandler):
    server: ControlServer

    def setup(self) -> None:
        self.timeout = self.server.limits.read_timeout  # every read on the socket
        super().setup()

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        return

    def log_error(self, format: str, *args: Any) -> None:  # e.g. a timeout, a bad line
        self.server.note(self.client_address, format % args)

    def _send(self, code: int, body: dict[str, Any]) -> None:
        data = (json.dumps(body) + "\n").encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _route(self, method: str) -> None:
        auth = self.headers.get("Authorization", "")
        if not hmac.compare_digest(auth.encode(), f"Bearer {self.server.token}".encode()):
            self._send(401, {"error": "missing or wrong token"})
            return
        url = urllib.parse.urlsplit(self.path)
        parts = [p for p in url.path.split("/") if p]
        query = dict(urllib.parse.parse_qsl(url.query))
        try:
            body = None
            if method == "POST":
                body = self._body()
                if body is _REFUSED:
                    return
            self._send(200, self.server.handle(method, parts, query, body))
        except StratagemError as exc:
            self._send(400, {"error": exc.problem, "where": exc.where, "fix": exc.fix})
        except (ValueError, KeyError, TypeError) as exc:
            self._send(400, {"error": f"bad request: {exc}"})
        except Exception as exc:  # a bug or a broken store: an answer, never a dropped line
            log.exception("control plane: %s %s", method, self.path[:200])
            self._send(500, {"error": f"internal error: {type(exc).__name__}: {exc}"[:500],
                             "fix": "see scheduler.log in the cluster directory"})

    def _body(self) -> Any:
        """The request's JSON body, or ``_REFUSED`` once an error has been answered."""
        limit = self.server.limits.max_body
        try:
            length = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            length = -1
        if not 0 < length <= limit:
            self._send(413 if length > limit else 400,
                       {"error": f"Content-Length must be 1 to {limit} bytes"})
            return _REFUSED
        try:
            data = self.rfile.read(length)
        except TimeoutError:
            self.close_connection = True
            self.server.note(self.client_address, "body not received in time")
            self._send(408, {"error": f"the body of {length} bytes did not arrive within "
                             f"{self.server.limits.read_timeout:g} s"})
            return _REFUSED
        if len(data) < length:
            self._send(400, {"error": f"the body ended after {len(data)} of {length} bytes"})
            return _REFUSED
        return load_json(data, "request body", fix="send a JSON document (the stratagem "
                         "client does)")

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self._route("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._route("POST")

    def do_DELETE(self) -> None:  # noqa: N802
        self._route("DELETE")


_REFUSED = object()


class ControlServer(ThreadingHTTPServer):
    """Serves the API over ``directory``'s store; ``status()`` reports the cluster."""

    daemon_threads = True
    request_queue_size = 128

    def __init__(self, directory: str | Path, host: str = "127.0.0.1", port: int = 0,
                 token: str | None = None, status: Any = None, drain: Any = None,
                 limits: ControlLimits = ControlLimits()) -> None:
        if host not in LOOPBACK and not token:
            raise StratagemError(f"refusing to listen on {host} without a token",
                                 where="control plane", fix="pass a token (--token-file), "
                                 "or keep the default loopback address")
        self.limits = limits
        # open connections, oldest first -> (when each must be gone, the client's address)
        self._conns: collections.OrderedDict[socket.socket, tuple[float, Any]] = (
            collections.OrderedDict())
        self._conns_lock = threading.Lock()
        self._last_note = -float("inf")
        self.refused = 0  # clients refused or broken (for tests and the log)
        self._unlogged = 0
        super().__init__((host, port), _Handler)
        self.directory = Path(directory)
        self.store = st.Store(self.directory)
        self.token = token or secrets.token_urlsafe(24)
        self.status = status or (lambda: {})
        self.drain = drain
        write_private(self.directory / SERVICE_FILE, json.dumps(
            {"host": host, "port": self.server_address[1], "token": self.token}))
        self._thread = threading.Thread(target=self.serve_forever, daemon=True,
                                        kwargs={"poll_interval": 0.2})
        self._thread.start()

    # -- bounds ----------------------------------------------------------------------------
    def note(self, client: Any, why: str) -> None:
        """Count a refused or broken client; log it unless a line was logged recently."""
        now = time.monotonic()
        with self._conns_lock:
            self.refused += 1
            if now - self._last_note < self.limits.log_every:
                self._unlogged += 1
                return
            self._last_note, unlogged, self._unlogged = now, self._unlogged, 0
        host = client[0] if isinstance(client, tuple) and client else "?"
        more = f" ({unlogged} more not logged)" if unlogged else ""
        log.warning("control plane: client %s: %s%s", host, " ".join(why.split())[:200],
                    more)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._conns_lock:
            oldest = (next(iter(self._conns)) if len(self._conns) >=
                      self.limits.max_connections else None)
            self._conns[request] = (time.monotonic() + self.limits.deadline, client_address)
        if oldest is not None:
            self._cut(oldest)
            self.note(client_address, "connection limit reached: closed the oldest one")
        super().process_request(request, client_address)

    def _cut(self, request: socket.socket) -> None:
        """Wake the thread of ``request`` (its reads end); it then closes the socket."""
        with self._conns_lock:
            self._conns.pop(request, None)
        with contextlib.suppress(OSError):
            request.shutdown(socket.SHUT_RDWR)

    def shutdown_request(self, request: Any) -> None:
        with self._conns_lock:
            self._conns.pop(request, None)
        super().shutdown_request(request)

    def service_actions(self) -> None:  # every poll of serve_forever
        now = time.monotonic()
        with self._conns_lock:
            late = [(r, addr) for r, (end, addr) in self._conns.items() if end <= now]
        for request, addr in late:
            self._cut(request)
            self.note(addr, f"open for over {self.limits.deadline:g} s: closed")

    def handle_error(self, request: Any, client_address: Any) -> None:
        import sys

        exc = sys.exc_info()[1]
        self.note(client_address, f"{type(exc).__name__}: {exc}")

    def connections(self) -> int:
        with self._conns_lock:
            return len(self._conns)

    def close(self) -> None:
        self.shutdown()
        self.server_close()
        (self.directory / SERVICE_FILE).unlink(missing_ok=True)

    def _submit(self, spec: JobSpec, replace: bool) -> str | None:
        """Queue ``spec``; with ``replace``, a finished run of the same name is removed first:
        its rows, and the directory the service keeps for it (``jobs/NAME``: logs, and
        checkpoints unless the job file named its own ``checkpoint_dir``). The directory is
        moved aside before the new run is queued, so the new run never writes into it."""
        base = job_dirs(self.directory, spec)[1].parent
        aside = None
        if replace and base.is_dir():
            try:
                state = self.store.job(spec.name).state
            except StratagemError:
                state = None
            if state in st.FINAL:
                aside = base.with_name(f".{base.name}.replaced-{secrets.token_hex(4)}")
                base.rename(aside)
        try:
            replaced = self.store.add_job(spec, replace=replace)
        except BaseException:
            if aside is not None and not base.exists():
                aside.rename(base)
            raise
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)
        return replaced

    def handle(self, method: str, parts: list[str], query: dict[str, str],
               body: Any) -> dict[str, Any]:
        if parts == ["jobs"] and method == "GET":
            rows, allocs = self.store.jobs(), self.store.allocations()
            return {"jobs": [job_record(j, allocs.get(j.name)) for j in rows],
                    "table": status_table(rows, allocs, self.directory)}
        if parts == ["jobs"] and method == "POST":
            spec = parse_job(body["job"], where="submitted job")
            replaced = self._submit(spec, bool(body.get("replace", False)))
            return {"name": spec.name, "state": st.PENDING, "replaced": replaced}
        if len(parts) == 2 and parts[0] == "jobs" and method == "DELETE":
            return {"name": parts[1], "was": self.store.request_delete(parts[1])}
        if len(parts) == 3 and parts[0] == "jobs" and parts[2] == "logs" and method == "GET":
            job = self.store.job(parts[1])
            rank, offset = int(query.get("rank", 0)), int(query.get("offset", 0))
            path = job_dirs(self.directory, job.spec)[1] / f"rank-{rank}.log"
            text = b""
            if path.is_file():
                with path.open("rb") as f:
                    f.seek(offset)
                    text = f.read(MAX_BODY)
            events = self.store.events(job.name, int(query.get("after", 0)))
            return {"state": job.state, "log": text.decode(errors="replace"),
                    "offset": offset + len(text), "events": events}
        if parts == ["status"] and method == "GET":
            return self.status()
        if (len(parts) == 3 and parts[0] == "nodes" and parts[2] == "drain"
                and method == "POST" and self.drain is not None):
            return {"node": parts[1], "moved": self.drain(parts[1])}
        raise StratagemError(f"no route {method} /{'/'.join(parts)}", where="control plane",
                             fix="use the stratagem client")


class ServiceClient:
    """The Python API of a running cluster service (what the CLI uses)."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        path = self.directory / SERVICE_FILE
        try:
            info = json.loads(path.read_text())
        except (OSError, ValueError):
            raise StratagemError("no cluster service is running here", where=str(
                self.directory), fix="'stratagem cluster up' (or pass --dir of the "
                "cluster)") from None
        self.url = f"http://{info['host']}:{info['port']}"
        self.token = info["token"]

    def _call(self, method: str, path: str, body: Any = None) -> dict[str, Any]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method, headers={
            "Authorization": f"Bearer {self.token}", "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            try:
                info = json.loads(exc.read(MAX_BODY) or b"{}")
            except ValueError:
                info = {}
            if not isinstance(info, dict):
                info = {}
            raise StratagemError(info.get("error", str(exc)), where=info.get("where") or
                                 "cluster service", fix=info.get("fix")) from None
        except OSError as exc:
            raise StratagemError(f"cannot reach the cluster service at {self.url}: {exc}",
                                 where=str(self.directory),
                                 fix="'stratagem cluster status'; 'stratagem cluster up' "
                                 "if it is down") from None

    def submit(self, job: str | Path | JobSpec, replace: bool = False) -> str:
        """Queue a job; its name. A name that already ran is refused unless ``replace``
        (which removes that run's events, logs and service-kept checkpoints)."""
        spec = job if isinstance(job, JobSpec) else load_job_file(job)
        return self._call("POST", "/jobs", {"job": spec.to_dict(), "replace": replace})["name"]

    def jobs(self) -> list[dict[str, Any]]:
        return self._call("GET", "/jobs")["jobs"]

    def table(self) -> str:
        return self._call("GET", "/jobs")["table"]

    def logs(self, name: str, rank: int = 0, offset: int = 0,
             after: int = 0) -> dict[str, Any]:
        q = urllib.parse.urlencode({"rank": rank, "offset": offset, "after": after})
        return self._call("GET", f"/jobs/{urllib.parse.quote(name, safe='')}/logs?{q}")

    def delete(self, name: str) -> str:
        return self._call("DELETE", f"/jobs/{urllib.parse.quote(name, safe='')}")["was"]

    def status(self) -> dict[str, Any]:
        return self._call("GET", "/status")

    def drain(self, node_id: str) -> list[str]:
        """Preemption notice for a node: the jobs there checkpoint and move; their names."""
        return self._call("POST", f"/nodes/{urllib.parse.quote(node_id, safe='')}/drain",
                          {})["moved"]

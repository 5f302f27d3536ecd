"""The control plane: a small JSON-over-HTTP API on the scheduler, and its client.

The server binds to 127.0.0.1 unless told otherwise, and every request must carry the
service's token (``Authorization: Bearer ...``), which it writes with its address to
``<cluster dir>/service.json`` (mode 0600). Binding to any other address without an explicit
token is refused. Bodies are JSON (at most 1 MiB); job files are checked again on the server.

Routes: ``GET /jobs`` (rows and the ``ls`` table), ``POST /jobs`` (``{"job": mapping,
"replace": bool}``: a name that already ran is refused unless ``replace``),
``DELETE /jobs/NAME``, ``GET /jobs/NAME/logs?rank=R&offset=N&after=E``, ``GET /status``,
``POST /nodes/NODE_ID/drain`` (a preemption notice: the jobs there checkpoint and move).
"""

from __future__ import annotations

import hmac
import json
import os
import secrets
import shutil
import threading
import urllib.error
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from stratagem.errors import StratagemError
from stratagem.service import store as st
from stratagem.service.jobfile import JobSpec, load_job_file, parse_job
from stratagem.service.scheduler import job_dirs, status_table

MAX_BODY = 1 << 20
LOOPBACK = ("127.0.0.1", "localhost", "::1")
SERVICE_FILE = "service.json"


def job_record(job: st.JobRow, alloc: st.AllocationRow | None) -> dict[str, Any]:
    return {"name": job.name, "state": job.state, "replicas": len(alloc.replicas) if alloc
            else 0, "restarts": job.restarts, "failures": job.failures,
            "submitted": job.submitted, "started": job.started, "finished": job.finished,
            "message": job.message, "spec": job.spec.to_dict()}


class _Handler(BaseHTTPRequestHandler):
    server: ControlServer

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        return

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
                length = int(self.headers.get("Content-Length", "0"))
                if not 0 < length <= MAX_BODY:
                    self._send(413, {"error": f"body must be 1 to {MAX_BODY} bytes"})
                    return
                body = json.loads(self.rfile.read(length))
            self._send(200, self.server.handle(method, parts, query, body))
        except StratagemError as exc:
            self._send(400, {"error": exc.problem, "where": exc.where, "fix": exc.fix})
        except (ValueError, KeyError, TypeError) as exc:
            self._send(400, {"error": f"bad request: {exc}"})

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self._route("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._route("POST")

    def do_DELETE(self) -> None:  # noqa: N802
        self._route("DELETE")


class ControlServer(ThreadingHTTPServer):
    """Serves the API over ``directory``'s store; ``status()`` reports the cluster."""

    daemon_threads = True

    def __init__(self, directory: str | Path, host: str = "127.0.0.1", port: int = 0,
                 token: str | None = None, status: Any = None, drain: Any = None) -> None:
        if host not in LOOPBACK and not token:
            raise StratagemError(f"refusing to listen on {host} without a token",
                                 where="control plane", fix="pass a token (--token-file), "
                                 "or keep the default loopback address")
        super().__init__((host, port), _Handler)
        self.directory = Path(directory)
        self.store = st.Store(self.directory)
        self.token = token or secrets.token_urlsafe(24)
        self.status = status or (lambda: {})
        self.drain = drain
        path = self.directory / SERVICE_FILE
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"host": host, "port": self.server_address[1], "token": self.token}, f)
        self._thread = threading.Thread(target=self.serve_forever, daemon=True,
                                        kwargs={"poll_interval": 0.2})
        self._thread.start()

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
            info = json.loads(exc.read() or b"{}")
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

"""Scheduling hints: what a job learned about itself, for a cluster scheduler.

Rank 0 publishes one JSON document (schema: ``docs/reference/hints.md``) to

* a file, ``$STRATAGEM_HINTS_FILE`` or ``hints.json`` in the checkpoint directory, replaced
  atomically (write, fsync, rename) so a reader never sees half of it;
* an HTTP endpoint, when ``$STRATAGEM_HINTS_PORT`` is set (0: any free port): ``GET /hints``
  on ``$STRATAGEM_HINTS_ADDR`` (default 127.0.0.1, this machine only), served by a daemon
  thread of the standard library's ``http.server``; :meth:`HintsPublisher.close` (also run at
  interpreter exit) stops it.
"""

from __future__ import annotations

import atexit
import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from stratagem import env

ENV_HINTS_FILE = env.HINTS_FILE
ENV_HINTS_PORT = env.HINTS_PORT
ENV_HINTS_ADDR = env.HINTS_ADDR
SCHEMA_VERSION = 1


def default_hints_path() -> Path | None:
    """``$STRATAGEM_HINTS_FILE``, else ``<checkpoint dir>/hints.json``, else None."""
    value = env.hints_file()
    if value:
        return Path(value)
    root = env.checkpoint_dir()
    return root / "hints.json" if root is not None else None


def write_json_atomic(path: Path, data: Any) -> None:
    """Write ``data`` as JSON to ``path`` through a fsynced temporary file and a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with tmp.open("w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class _Handler(BaseHTTPRequestHandler):
    server: _HintsServer

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        if self.path.split("?")[0].rstrip("/") not in ("/hints", ""):
            self.send_error(404, "try GET /hints")
            return
        body = self.server.body()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        return


class _HintsServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int]) -> None:
        super().__init__(address, _Handler)
        self._body = b"{}\n"
        self._lock = threading.Lock()

    def set(self, body: bytes) -> None:
        with self._lock:
            self._body = body

    def body(self) -> bytes:
        with self._lock:
            return self._body


class HintsPublisher:
    """Publishes hint documents to a file and/or an HTTP endpoint (see the module doc).

    ``path``/``port``/``host`` default to the environment; ``port=None`` and no
    ``$STRATAGEM_HINTS_PORT``: no server. ``enabled=False`` (ranks other than 0): nothing.
    """

    def __init__(self, path: str | os.PathLike[str] | None = None, port: int | None = None,
                 host: str | None = None, *, enabled: bool = True) -> None:
        self.enabled = enabled
        self.path = Path(path) if path is not None else default_hints_path()
        if port is None:
            port = env.hints_port()
        self.host = host or env.hints_addr()
        self._server: _HintsServer | None = None
        self._thread: threading.Thread | None = None
        self.latest: dict[str, Any] | None = None
        if enabled and port is not None:
            self._start(int(port))

    def _start(self, port: int) -> None:
        self._server = _HintsServer((self.host, port))
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        kwargs={"poll_interval": 0.2},
                                        name="stratagem-hints", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    @property
    def url(self) -> str | None:
        """``http://host:port/hints`` while the server runs."""
        if self._server is None:
            return None
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}/hints"

    def publish(self, hints: dict[str, Any]) -> None:
        if not self.enabled:
            return
        hints = {**hints, "endpoint": self.url}
        self.latest = hints
        if self._server is not None:
            self._server.set((json.dumps(hints, sort_keys=True) + "\n").encode())
        if self.path is not None:
            write_json_atomic(self.path, hints)

    def close(self) -> None:
        """Stop the HTTP server (idempotent); the file stays."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

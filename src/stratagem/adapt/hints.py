"""Scheduling hints: what a job learned about itself, for a cluster scheduler.

Rank 0 publishes one JSON document (schema: ``docs/reference/hints.md``) to

* a file, ``$STRATAGEM_HINTS_FILE`` or ``hints.json`` in the checkpoint directory, replaced
  atomically (write, fsync, rename) so a reader never sees half of it;
* an HTTP endpoint, when ``$STRATAGEM_HINTS_PORT`` is set (0: any free port): ``GET /hints``
  on ``$STRATAGEM_HINTS_ADDR`` (default 127.0.0.1, this machine only), served by one daemon
  thread (:class:`_HintsServer`: bounded connections, idle timeout, no busy loop when file
  descriptors run out); :meth:`HintsPublisher.close` (also run at interpreter exit) stops it.
  ``GET /metrics`` serves the same numbers as Prometheus text (:func:`prometheus_text`).
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import json
import os
import selectors
import socket
import threading
import time
from pathlib import Path
from typing import Any

from stratagem import env
from stratagem.errors import StratagemError
from stratagem.observe.side_output import SideOutput

ENV_HINTS_FILE = env.HINTS_FILE
ENV_HINTS_PORT = env.HINTS_PORT
ENV_HINTS_ADDR = env.HINTS_ADDR
SCHEMA_VERSION = 1
MAX_CONNECTIONS = 64
IDLE_TIMEOUT_S = 5.0
MAX_REQUEST_BYTES = 8192
BACKLOG = 128
FD_BACKOFF_S = 0.5


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
    try:
        with tmp.open("w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # a full disk: no half-written temporary file keeps the space
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


class _Conn:
    """One client connection: its request bytes so far, then the response left to send."""

    __slots__ = ("sock", "inbox", "outbox", "deadline")

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock = sock
        self.inbox = b""
        self.outbox = b""
        self.deadline = deadline


class _HintsServer:
    """``GET /hints`` served by one thread from a selector loop over non-blocking sockets.

    Bounded whatever clients do: one thread in all; at most :attr:`max_connections` open
    connections (when full, the longest-idle one is closed to make room, so idle or
    half-sent requests cannot lock real clients out); each connection is closed after
    :attr:`idle_timeout` seconds or :data:`MAX_REQUEST_BYTES` of request; the listen backlog
    is :data:`BACKLOG`. When the process runs out of descriptors, ``accept`` fails: the
    loop then closes its longest-idle connection, or with none stops listening for
    :data:`FD_BACKOFF_S`, instead of spinning on a listener that stays readable.
    """

    def __init__(self, address: tuple[str, int], max_connections: int = MAX_CONNECTIONS,
                 idle_timeout: float = IDLE_TIMEOUT_S) -> None:
        self.max_connections = max_connections
        self.idle_timeout = idle_timeout
        family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self._listener = socket.create_server(address, family=family, backlog=BACKLOG)
        self._listener.setblocking(False)
        self.server_address = self._listener.getsockname()
        self._wake_r, self._wake_w = socket.socketpair()
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ)
        self._sel.register(self._wake_r, selectors.EVENT_READ)
        self._conns: dict[socket.socket, _Conn] = {}  # oldest activity first
        self._listening_again = 0.0  # monotonic time to resume accepting (0: listening)
        self._stop = False
        self._body = b"{}\n"
        self._metrics = b"\n"
        self._lock = threading.Lock()
        self.accept_errors = 0  # descriptor exhaustion seen (for tests and debugging)

    def set(self, body: bytes, metrics: bytes | None = None) -> None:
        with self._lock:
            self._body = body
            if metrics is not None:
                self._metrics = metrics

    def body(self) -> bytes:
        with self._lock:
            return self._body

    def metrics(self) -> bytes:
        with self._lock:
            return self._metrics

    # -- the loop ---------------------------------------------------------------------
    def serve_forever(self) -> None:
        while not self._stop:
            now = time.monotonic()
            if self._listening_again and now >= self._listening_again:
                self._listening_again = 0.0
                self._sel.register(self._listener, selectors.EVENT_READ)
            wait = min([c.deadline for c in self._conns.values()]
                       + [self._listening_again or now + 1.0]) - now
            for key, mask in self._sel.select(timeout=max(0.0, wait)):
                if key.fileobj is self._wake_r:
                    with contextlib.suppress(OSError):
                        self._wake_r.recv(64)
                elif key.fileobj is self._listener:
                    self._accept()
                elif key.fileobj in self._conns:
                    self._service(self._conns[key.fileobj], mask)  # type: ignore[index]
            now = time.monotonic()
            for conn in [c for c in self._conns.values() if c.deadline <= now]:
                self._drop(conn)
        for conn in list(self._conns.values()):
            self._drop(conn)

    def _accept(self) -> None:
        try:
            sock, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError, ConnectionAbortedError):
            return
        except OSError as exc:
            if exc.errno not in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                raise
            self.accept_errors += 1
            if self._conns:  # free a descriptor: the longest-idle client goes
                self._drop(next(iter(self._conns.values())))
            else:  # descriptors held elsewhere in the process: wait instead of spinning
                self._sel.unregister(self._listener)
                self._listening_again = time.monotonic() + FD_BACKOFF_S
            return
        if len(self._conns) >= self.max_connections:
            self._drop(next(iter(self._conns.values())))
        sock.setblocking(False)
        conn = _Conn(sock, time.monotonic() + self.idle_timeout)
        self._conns[sock] = conn
        self._sel.register(sock, selectors.EVENT_READ)

    def _service(self, conn: _Conn, mask: int) -> None:
        try:
            if mask & selectors.EVENT_READ and not conn.outbox:
                data = conn.sock.recv(4096)
                if not data:
                    self._drop(conn)
                    return
                conn.inbox += data
                if b"\r\n\r\n" in conn.inbox or b"\n\n" in conn.inbox:
                    conn.outbox = self._respond(conn.inbox)
                elif len(conn.inbox) > MAX_REQUEST_BYTES:
                    conn.outbox = _response(431, b"request too large\n", "text/plain")
                else:
                    return
                self._sel.modify(conn.sock, selectors.EVENT_WRITE)
            if conn.outbox:
                sent = conn.sock.send(conn.outbox)
                conn.outbox = conn.outbox[sent:]
                if not conn.outbox:
                    self._drop(conn)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(conn)

    def _respond(self, request: bytes) -> bytes:
        line = request.split(b"\n", 1)[0].decode("latin-1").split()
        method, path = (line + ["", ""])[:2]
        if method not in ("GET", "HEAD"):
            return _response(405, b"only GET /hints\n", "text/plain")
        if path.split("?")[0].rstrip("/") == "/metrics":
            return _response(200, self.metrics(), PROMETHEUS_TYPE,
                             head_only=method == "HEAD")
        if path.split("?")[0].rstrip("/") not in ("/hints", ""):
            return _response(404, b"try GET /hints or GET /metrics\n", "text/plain")
        body = self.body()
        return _response(200, body, "application/json", head_only=method == "HEAD")

    def _drop(self, conn: _Conn) -> None:
        self._conns.pop(conn.sock, None)
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(conn.sock)
        with contextlib.suppress(OSError):
            conn.sock.close()

    def connections(self) -> int:
        return len(self._conns)

    # -- stopping -------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Make :meth:`serve_forever` return (from another thread)."""
        self._stop = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    def server_close(self) -> None:
        for sock in (self._listener, self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                sock.close()
        with contextlib.suppress(OSError, ValueError):
            self._sel.close()


_REASONS = {200: "OK", 404: "Not Found", 405: "Method Not Allowed",
            431: "Request Header Fields Too Large"}


def _response(status: int, body: bytes, kind: str, head_only: bool = False) -> bytes:
    head = (f"HTTP/1.1 {status} {_REASONS[status]}\r\nContent-Type: {kind}\r\n"
            f"Content-Length: {len(body)}\r\nCache-Control: no-store\r\n"
            "Connection: close\r\n\r\n").encode()
    return head if head_only else head + body


PROMETHEUS_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def prometheus_text(hints: dict[str, Any]) -> str:
    """The numbers of a hints document as Prometheus gauges (text exposition format 0.0.4),
    for ``GET /metrics``: allocation, batch, LR factor and gain, noise scale, goodput."""
    batch = hints.get("batch") or {}
    current = batch.get("current") or {}
    goodput = hints.get("goodput") or {}
    gradient = hints.get("gradient") or {}
    allocation = hints.get("allocation") or {}
    gauges = [
        ("stratagem_replicas", "data-parallel workers", allocation.get("num_replicas")),
        ("stratagem_nodes", "nodes with workers", allocation.get("num_nodes")),
        ("stratagem_global_batch_size", "global batch size now",
         current.get("global_bsz")),
        ("stratagem_local_batch_size", "per-replica micro-batch now",
         current.get("local_bsz")),
        ("stratagem_accumulation_steps", "gradient accumulation steps now",
         current.get("accum_steps")),
        ("stratagem_lr_factor", "learning-rate multiplier of the last step",
         hints.get("lr_factor")),
        ("stratagem_gain", "AdaScale gain of the last step", hints.get("gain")),
        ("stratagem_gradient_noise_scale", "gradient noise scale in samples",
         gradient.get("noise_scale")),
        ("stratagem_goodput", "predicted goodput of the running configuration",
         goodput.get("goodput")),
        ("stratagem_efficiency", "statistical efficiency of the running configuration",
         goodput.get("efficiency")),
        ("stratagem_throughput", "predicted samples/s of the running configuration",
         goodput.get("throughput")),
        ("stratagem_epoch", "the script's epoch (0-based)", hints.get("epoch")),
        ("stratagem_hints_time_seconds", "when these numbers were published",
         hints.get("time")),
    ]
    lines = []
    for name, text, value in gauges:
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or value != value or value in (float("inf"), float("-inf")):
            continue  # unknown yet: no sample rather than a made-up one
        lines += [f"# HELP {name} {text}", f"# TYPE {name} gauge", f"{name} {float(value)!r}"]
    return "\n".join(lines) + "\n"


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
        # The file is a side output: a full disk warns once; later publishes try again
        # (each replaces the whole file atomically, so one that succeeds is complete).
        self.file_output = SideOutput(f"the hints file {self.path}")
        if enabled and port is not None:
            self._start(int(port))

    def _start(self, port: int) -> None:
        try:
            self._server = _HintsServer((self.host, port))
        except (OSError, OverflowError, ValueError) as exc:
            raise StratagemError(f"cannot serve hints on {self.host}:{port}: {exc}",
                                 where=f"{ENV_HINTS_ADDR}/{ENV_HINTS_PORT}",
                                 fix="pick a free port (or 0 for any) on an address of this "
                                     "machine") from None
        self._thread = threading.Thread(target=self._server.serve_forever,
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
            self._server.set((json.dumps(hints, sort_keys=True) + "\n").encode(),
                             prometheus_text(hints).encode())
        if self.path is not None:
            path = self.path
            self.file_output.attempt(lambda: write_json_atomic(path, hints), stop=False)

    def close(self) -> None:
        """Stop the HTTP server (idempotent); the file stays."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

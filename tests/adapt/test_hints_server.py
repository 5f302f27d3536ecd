"""The hints HTTP server stays bounded and responsive under idle, half-sent or excess
connections and when the process runs out of file descriptors (loopback only)."""

from __future__ import annotations

import errno
import json
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from stratagem.adapt.hints import ENV_HINTS_PORT, HintsPublisher, _HintsServer
from stratagem.errors import StratagemError

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def publisher(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[HintsPublisher]:
    monkeypatch.delenv(ENV_HINTS_PORT, raising=False)
    pub = HintsPublisher(tmp_path / "hints.json", port=0)
    pub.publish({"step": 7})
    yield pub
    pub.close()


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def _address(pub: HintsPublisher) -> tuple[str, int]:
    assert pub._server is not None
    return pub._server.server_address[:2]


def test_idle_half_sent_requests_hold_no_threads_and_block_no_one(
        publisher: HintsPublisher) -> None:
    threads_before = threading.active_count()
    clients = []
    try:
        for _ in range(300):  # each one a request that never finishes
            c = socket.create_connection(_address(publisher), timeout=5)
            c.sendall(b"GET /hin")
            clients.append(c)
        assert _get(publisher.url or "")["step"] == 7
        assert threading.active_count() <= threads_before
        assert publisher._server is not None
        assert publisher._server.connections() <= publisher._server.max_connections
    finally:
        for c in clients:
            c.close()


def test_idle_client_is_disconnected_after_the_timeout() -> None:
    server = _HintsServer(("127.0.0.1", 0), idle_timeout=0.2)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        with socket.create_connection(server.server_address[:2], timeout=10) as c:
            c.sendall(b"GET /hints HTTP/1.1\r\nHost: x\r\n")  # no blank line: incomplete
            assert c.recv(100) == b""  # closed by the server, not by our 10 s timeout
        with socket.create_connection(server.server_address[:2], timeout=10) as c:
            c.sendall(b"X" * 10_000)  # oversized request line: refused at once
            assert c.recv(100).startswith(b"HTTP/1.1 431")
    finally:
        server.shutdown()
        thread.join(timeout=5)
        server.server_close()
    assert not thread.is_alive()


class _Exhausted:
    """A listening socket whose accept() fails as when the process has no descriptor left."""

    def __init__(self, real: socket.socket) -> None:
        self.real = real
        self.calls = 0

    def fileno(self) -> int:
        return self.real.fileno()

    def accept(self) -> tuple[socket.socket, object]:
        self.calls += 1
        raise OSError(errno.EMFILE, "Too many open files")


def test_no_busy_loop_when_descriptors_run_out() -> None:
    server = _HintsServer(("127.0.0.1", 0))
    fake = _Exhausted(server._listener)
    server._sel.unregister(server._listener)
    server._listener = fake  # type: ignore[assignment]
    server._sel.register(fake, 1)
    pending = socket.create_connection(server.server_address[:2])  # listener stays readable
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    time.sleep(1.0)
    server.shutdown()
    thread.join(timeout=5)
    pending.close()
    server._listener = fake.real
    server.server_close()
    # a spinning loop calls accept() thousands of times a second; backing off, a few
    assert 1 <= fake.calls <= 5, fake.calls
    assert server.accept_errors == fake.calls


@pytest.mark.parametrize("value", ["abc", "70000", "-1", "80 80"])
def test_bad_hints_port_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                         value: str) -> None:
    monkeypatch.setenv(ENV_HINTS_PORT, value)
    with pytest.raises(StratagemError, match="is not a TCP port") as err:
        HintsPublisher(tmp_path / "h.json")
    assert "port number" in (err.value.fix or "")


def test_port_in_use_is_a_clear_error(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        with pytest.raises(StratagemError, match="cannot serve hints on 127.0.0.1:") as err:
            HintsPublisher(tmp_path / "h.json", port=busy.getsockname()[1])
    assert "free port" in (err.value.fix or "")

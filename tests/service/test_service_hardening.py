"""The cluster service under hostile input (no Ray): bad hints files, slow and malformed
control-plane clients, hostile job files, secret files on disk."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from test_service_scheduler import FakeBackend, make, spec

from stratagem.service import store as st
from stratagem.service.hints_reader import read_hints
from stratagem.service.scheduler import status_table

GOOD_HINTS = {"version": 1, "batch": {"base_batch_size": 64, "max_batch_size": 1024,
                                      "local_bsz_bounds": [32, 256],
                                      "gradient_accumulation": True,
                                      "current": {"global_bsz": 384}},
              "throughput_params": {"alpha_c": 0.004, "beta_c": 0.0002, "alpha_r": 0.003,
                                    "beta_r": 0.0, "alpha_n": 0.0033, "beta_n": 0.0,
                                    "gamma": 1.4},
              "gradient": {"sqr_norm": 0.12, "var": 210.0},
              "goodput": {"goodput": 4100.0}, "progress": {"progress": 2104.3}, "epoch": 3}

BAD_HINTS = [
    '{"version": 1, "batch": [1]}',  # the shape from the report
    '[1, 2]',
    '{"version": 1, "batch": {"local_bsz_bounds": "ab"}}',
    '{"version": 1, "goodput": {"goodput": NaN}}',
    '{"version": 1, "batch": {"current": {"global_bsz": "many"}}}',
    '{"version": 1, "throughput_params": {"alpha_c": 1}, "gradient": {"var": 1}}',
    '{"version": 1, "epoch": true}',
    '{"version": 1, "x": ' + "[" * 5000 + "]" * 5000 + "}",
    '{"version": 1, "batch": {',
    b'\xff\xfe{"version": 1}',
]


def ckpt(tmp: Path, name: str) -> Path:
    path = tmp / "jobs" / name / "ckpt"
    path.mkdir(parents=True, exist_ok=True)
    return path


def test_good_hints_parse_and_every_bad_shape_is_a_problem_not_an_exception(tmp_path):
    from stratagem.service.hints_reader import MAX_HINTS_BYTES

    (tmp_path / "hints.json").write_text(json.dumps(GOOD_HINTS))
    hints = read_hints(tmp_path)
    assert hints.problem is None and hints.goodput is not None
    assert (hints.global_bsz, hints.local_bsz_bounds, hints.epoch) == (384, (32, 256), 3)
    for text in BAD_HINTS:
        path = tmp_path / "hints.json"
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
        got = read_hints(tmp_path)
        assert got.problem and got.goodput is None, text[:60]
        assert len(got.problem) < 300, got.problem
    (tmp_path / "hints.json").write_bytes(b" " * (MAX_HINTS_BYTES + 1))
    assert "too large" in read_hints(tmp_path).problem
    (tmp_path / "hints.json").unlink()
    os.mkfifo(tmp_path / "hints.json")  # opening a FIFO for reading would block forever
    assert "regular file" in read_hints(tmp_path).problem
    assert read_hints(tmp_path / "absent") == read_hints(tmp_path / "absent2")
    assert read_hints(tmp_path / "absent").problem is None


def test_one_jobs_bad_hints_mark_that_job_and_the_others_are_scheduled(tmp_path):
    be = FakeBackend(gpus=2)
    s = make(tmp_path, be)
    s.store.add_job(spec("bad", high=1), now=0.0)
    s.store.add_job(spec("ok", high=1), now=1.0)
    (ckpt(tmp_path, "bad") / "hints.json").write_text('{"version": 1, "batch": [1]}')
    (ckpt(tmp_path, "ok") / "hints.json").write_text(json.dumps(GOOD_HINTS))
    for t in (2.0, 3.0, 4.0):
        s.step(now=t)
    assert s.store.job("ok").state == st.RUNNING and s.store.job("bad").state == st.RUNNING
    events = [text for _, _, text in s.store.events("bad")]
    assert sum("unusable hints.json" in e for e in events) == 1, events  # once, not per step
    assert not any("hints" in text for _, _, text in s.store.events("ok"))
    table = status_table(s.store.jobs(), s.store.allocations(), tmp_path)
    assert "warning: bad: unusable hints.json" in table and "384" in table
    assert all(len(line) <= 80 for line in table.splitlines())
    # the file is fixed: the job is told so, and the warning goes
    (ckpt(tmp_path, "bad") / "hints.json").write_text(json.dumps(GOOD_HINTS))
    s.step(now=5.0)
    assert s.store.events("bad")[-1][2] == "hints.json is usable again"
    assert "warning" not in status_table(s.store.jobs(), s.store.allocations(), tmp_path)


def test_finished_jobs_hints_are_not_read(tmp_path):
    be = FakeBackend(gpus=2)
    s = make(tmp_path, be)
    s.store.add_job(spec("gone", high=1), now=0.0)
    s.step(now=1.0)
    s.store.request_delete("gone")
    s.step(now=2.0)
    assert s.store.job("gone").state == st.DELETED
    os.mkfifo(ckpt(tmp_path, "gone") / "hints.json")  # a read would be refused, or block
    table = status_table(s.store.jobs(), s.store.allocations(), tmp_path)
    assert "gone" in table and "warning" not in table


# -- 3: job files through the bounded loader ------------------------------------------------
def job_file(tmp: Path, text: str | bytes) -> Path:
    path = tmp / "job.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


def test_hostile_job_files_are_refused_quickly_with_short_messages(tmp_path):
    from stratagem.errors import StratagemError
    from stratagem.service.jobfile import MAX_JOB_FILE_BYTES, load_job_file

    head = f"name: a\nscript: {spec('x').script}\n"
    # a small "billion laughs" (9**6 strings; more would not end before the fix)
    bomb = "args: [&a [x, x, x, x, x, x, x, x, x], " + ", ".join(
        f"&{c} [{', '.join([f'*{p}'] * 9)}]" for p, c in zip("abcde", "bcdef", strict=True))
    cases = {
        "alias": (head + bomb + "]\n", "alias"),
        "duplicate": (head + "max_replicas: 2\nmax_replicas: 1\n", "duplicate key"),
        "size": (head + "# " + "x" * MAX_JOB_FILE_BYTES + "\n", "too large"),
        "utf8": (head.encode() + b"args: [\xff\xfe]\n", "not UTF-8"),
        "deep": (head + "args: " + "[" * 100_000 + "]" * 100_000 + "\n", "nested deeper"),
        "long value": (head + "strategy: [" + "y" * 100_000 + "]\n", "field 'strategy'"),
    }
    for what, (text, needle) in cases.items():
        with pytest.raises(StratagemError) as err:
            load_job_file(job_file(tmp_path, text))
        msg = err.value.render()
        assert needle in msg and len(msg) < 600, (what, msg[:300])


# -- 2: slow and malformed clients of the control plane --------------------------------------
def raw_request(port: int, data: bytes, timeout: float = 10.0) -> bytes:
    """Send ``data`` and read until the server closes; the reply (b"" when dropped)."""
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data)
        chunks = []
        while True:
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            chunks.append(chunk)
        return b"".join(chunks)


@pytest.fixture
def bounded_service(tmp_path):
    from stratagem.service import api

    if hasattr(api, "ControlLimits"):
        server = api.ControlServer(tmp_path, limits=api.ControlLimits(
            max_connections=8, read_timeout=0.5, deadline=3.0, log_every=60.0))
    else:  # before the bounds (to see these tests fail there)
        server = api.ControlServer(tmp_path)
    yield server
    server.close()


def post(server, body: bytes, length: int | None = None) -> bytes:
    head = (f"POST /jobs HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {server.token}\r\n"
            f"Content-Length: {len(body) if length is None else length}\r\n\r\n").encode()
    return raw_request(server.server_address[1], head + body)


def test_idle_and_half_sent_clients_hold_a_bounded_number_of_threads(bounded_service):
    import socket
    import threading
    import time

    from stratagem.service.api import ServiceClient

    server, base = bounded_service, threading.active_count()
    port = server.server_address[1]
    idle = []
    try:
        for i in range(120):  # half-sent requests, never finished
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
            sock.sendall(b"GET /jobs HTTP/1.1\r\nHost: x\r\n" if i % 2 else b"GE")
            idle.append(sock)
        deadline = time.monotonic() + 15
        while threading.active_count() - base > 8 + 2:
            assert time.monotonic() < deadline, threading.active_count() - base
            time.sleep(0.05)
        # a real client still gets in while the idle ones are there
        assert ServiceClient(server.directory).jobs() == []
    finally:
        for sock in idle:
            sock.close()
    deadline = time.monotonic() + 15
    while server.connections():  # every connection ends (read timeout or deadline)
        assert time.monotonic() < deadline, server.connections()
        time.sleep(0.05)


def test_short_bodies_bad_json_and_deep_nesting_get_an_answer_with_the_reason(
        bounded_service, caplog, capfd):
    import logging

    server = bounded_service
    caplog.set_level(logging.WARNING, logger="stratagem.service")
    reply = post(server, b'{"job": 1}', length=100)  # Content-Length larger than the body
    assert reply.startswith(b"HTTP/1.0 408") and b"did not arrive" in reply, reply[:200]
    reply = post(server, b"", length=2 << 20)
    assert reply.startswith(b"HTTP/1.0 413"), reply[:200]  # over the 1 MiB cap
    reply = post(server, b"[" * 500_000 + b"]" * 500_000)
    assert reply.startswith(b"HTTP/1.0 400") and b"nested deeper" in reply, reply[:200]
    for body in (b"{nope", b"\xff\xfe", b'{"job": [1]}', b'{"jobs": {}}'):
        reply = post(server, body)
        assert reply.startswith(b"HTTP/1.0 400") and b'"error"' in reply, (body, reply)
    reply = post(server, b"{}", length="x")  # type: ignore[arg-type]
    assert reply.startswith(b"HTTP/1.0 400"), reply[:200]
    # aborted and garbage connections: no traceback, at most one line per log_every
    import socket
    import struct

    for _ in range(20):
        sock = socket.create_connection(("127.0.0.1", server.server_address[1]))
        sock.sendall(b"POST /jobs HTTP/1.1\r\nContent-Length: 10\r\n\r\n{")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()  # RST
    raw_request(server.server_address[1], b"\x16\x03\x01garbage\r\n\r\n")
    import time

    time.sleep(1.0)
    lines = [r for r in caplog.records if r.name == "stratagem.service"]
    assert len(lines) <= 1 and not any(r.exc_info for r in lines), [r.getMessage()
                                                                     for r in lines]
    assert server.refused >= 2 and "Traceback" not in capfd.readouterr().err


# -- 5: secrets on disk -----------------------------------------------------------------------
def test_service_file_and_database_are_private_and_never_written_through_a_link(tmp_path):
    from stratagem.service.api import SERVICE_FILE, ControlServer

    d = tmp_path / "c"
    d.mkdir(mode=0o755)
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (d / SERVICE_FILE).symlink_to(victim)  # planted by someone who can write there
    (d / "state.db").touch(mode=0o644)
    os.chmod(d / "state.db", 0o644)
    server = ControlServer(d)
    try:
        assert victim.read_text() == "precious"
        info = os.lstat(d / SERVICE_FILE)
        assert not (d / SERVICE_FILE).is_symlink() and info.st_mode & 0o777 == 0o600
        server.store.add_job(spec("a", env={"SECRET": "x"}))
        for name in ("state.db", "state.db-wal", "state.db-shm"):
            if (d / name).exists():
                assert (d / name).stat().st_mode & 0o777 == 0o600, name
        assert not [p for p in d.iterdir() if p.name.endswith(".tmp")]
    finally:
        server.close()
    from stratagem.service import store as st_mod

    fresh = tmp_path / "fresh"
    st_mod.Store(fresh)
    assert fresh.stat().st_mode & 0o777 == 0o700
    assert (fresh / "state.db").stat().st_mode & 0o777 == 0o600


# -- 4 and 6: `cluster down` stops only what `up` started, within its grace ------------------
def own_group(code: str):
    import subprocess
    import sys
    import time

    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True,
                            stdin=subprocess.DEVNULL)
    time.sleep(0.3)  # its command line is the interpreter's by now
    return proc


def test_down_never_signals_a_reused_pid_and_kills_what_ignores_sigterm_after_grace(
        tmp_path):
    import time

    from stratagem.service import cluster

    d = tmp_path / "c"
    d.mkdir()
    other = own_group("import time; time.sleep(60)")  # someone else's process, same PID
    stubborn = own_group("import signal, time; signal.signal(signal.SIGTERM, "
                         "signal.SIG_IGN); time.sleep(60)")
    try:
        ident = cluster.identity(other.pid)
        stale = {**ident, "start": ident["start"] - 1}  # an earlier process with that PID
        (d / "cluster.json").write_text(json.dumps({
            "address": "127.0.0.1:1", "ray_pid": other.pid, "scheduler_pid": other.pid,
            "ray": stale, "scheduler": {**stale, "cmdline": ["python", "x"]}}))
        done = cluster.down(d)
        time.sleep(0.3)
        assert other.poll() is None, "down signalled a process that up did not start"
        assert done["ray"].startswith("not stopped") and not (d / "cluster.json").exists()
        # a recorded process that is still ours and ignores SIGTERM: killed after grace
        rec = {k: v for k, v in cluster.identity(stubborn.pid).items()
               if k in ("pid", "start", "boot", "cmdline")}
        (d / "cluster.json").write_text(json.dumps({"address": None, "ray_pid": None,
                                                    "scheduler": rec}))
        assert cluster.down(d, grace=0.5) == {"scheduler": "killed after 0.5 s"}
        stubborn.wait(timeout=10)  # (down reaped it: it is this test's child)
        assert cluster.identity(stubborn.pid) is None
    finally:
        for proc in (other, stubborn):
            proc.kill()
            proc.wait()


def test_up_writes_a_private_ray_token_and_turns_the_heads_drain_wait_off(tmp_path,
                                                                        monkeypatch):
    from stratagem.service import cluster

    # ray.init() in this process (another module's fixture) sets RAY_AUTH_MODE=token in
    # os.environ, which `up` would rightly take as the user's own choice
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    monkeypatch.delenv("RAY_worker_niceness", raising=False)  # (the Ray fixtures set it)

    if not cluster._ray_has_tokens():
        pytest.skip("this Ray has no token authentication")
    d = tmp_path / "c"
    d.mkdir(mode=0o755)
    cluster.private_dir(d)
    env = cluster._ray_env(d)
    token = Path(env["RAY_AUTH_TOKEN_PATH"])
    assert token.parent == d and token.stat().st_mode & 0o777 == 0o600
    assert len(token.read_text()) == 64 and env["RAY_AUTH_MODE"] == "token"
    assert env["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"] == "0"
    assert env["RAY_worker_niceness"] == "0"  # replicas at normal priority (issue 47)
    assert d.stat().st_mode & 0o777 == 0o700
    assert cluster._ray_env(d)["RAY_AUTH_TOKEN_PATH"] == str(token)  # kept, not remade


def test_the_identity_recorded_at_spawn_is_the_programs_not_the_exec_in_progress(tmp_path):
    import sys

    from stratagem.service import cluster

    for _ in range(10):  # the race (reading /proc during execve) shows within a few spawns
        argv = [sys.executable, "-c", "import time; time.sleep(20)"]
        proc = cluster._spawn(argv, tmp_path / "log")
        try:
            record = cluster._record_of(proc.pid, argv)
            assert record["cmdline"] == argv and cluster.is_ours(record), record
        finally:
            proc.kill()
            proc.wait()

"""Peer heartbeats: a frozen peer (SIGSTOP: no crash, no closed socket, like a node whose
link went down) ends the job in seconds instead of at the process-group timeout."""

from __future__ import annotations

import os
import subprocess
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch.distributed as dist
from launch_helpers import job_processes, stratagem_cmd

from stratagem.distributed.peer_watchdog import PeerWatchdog

PG_TIMEOUT_S = 600  # without the heartbeats the survivor would block this long

FROZEN = """
import os, signal, torch
from stratagem.distributed.process_group import init_process_group
import torch.distributed as dist
init_process_group("gloo")
dist.barrier()
if dist.get_rank() == 1:
    os.kill(os.getpid(), signal.SIGSTOP)  # alive, sockets open, silent
while True:
    dist.all_reduce(torch.ones(1))
"""


def _pair(timeout: float) -> tuple[PeerWatchdog, PeerWatchdog]:
    store = dist.HashStore()
    return (PeerWatchdog(store, 0, 2, timeout, exit_process=False, beat_s=0.05),
            PeerWatchdog(store, 1, 2, timeout, exit_process=False, beat_s=0.05))


def _wait_until(predicate, seconds: float) -> bool:  # noqa: ANN001
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_a_silent_peer_is_named_lost() -> None:
    a, b = _pair(2.0)
    a.start(), b.start()
    time.sleep(0.5)
    b.stop(done=False)  # frozen: stops beating without saying it finished
    assert _wait_until(lambda: a.lost is not None, 10)
    assert a.lost is not None and a.lost.startswith("rank 1 stopped answering")
    a.stop()


def test_a_peer_that_finished_is_not_lost() -> None:
    a, b = _pair(2.0)
    a.start(), b.start()
    time.sleep(0.5)
    b.stop(done=True)
    assert not _wait_until(lambda: a.lost is not None, 4.0)
    a.stop()


def test_stop_returns_once_the_thread_has_left_the_store() -> None:
    """A store call returning while the interpreter finalizes aborts the process, so
    stop() (at exit, from destroy_process_group) waits for the thread to end."""
    a, b = _pair(2.0)
    a.start(), b.start()
    time.sleep(0.2)
    a.stop(), b.stop()
    assert [t.name for t in threading.enumerate() if t.name == "stratagem-peer-watchdog"] == []


@pytest.mark.timeout(300)
def test_frozen_worker_ends_the_job_long_before_the_collective_timeout(
        tmp_path: Path) -> None:
    script = tmp_path / "frozen.py"
    script.write_text(FROZEN)
    job_id = f"t-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "STRATAGEM_PEER_TIMEOUT_S": "3",
           "STRATAGEM_PG_TIMEOUT_S": str(PG_TIMEOUT_S), "OMP_NUM_THREADS": "1"}
    started = time.monotonic()
    proc = subprocess.run(stratagem_cmd("run", "--nproc", "2", "--job-id", job_id,
                                        "--max-restarts", "0", str(script)),
                          capture_output=True, text=True, env=env, timeout=PG_TIMEOUT_S / 2)
    took = time.monotonic() - started
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "first failure: rank 0 on node 0" in proc.stderr, proc.stderr[-3000:]
    assert "PeerLost: rank 1 stopped answering" in proc.stderr
    assert took < PG_TIMEOUT_S / 4  # it did not wait for the collective timeout
    assert not job_processes(job_id)

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


ONE_RANK = """
import torch
from stratagem.distributed.process_group import init_process_group
import torch.distributed as dist
init_process_group("gloo")
dist.barrier()
if dist.get_rank() == 0:
    dist.all_reduce(torch.ones(1))  # rank 1 never calls it: it finishes its script
print(f"rank {dist.get_rank()} done", flush=True)
"""


@pytest.mark.timeout(300)
def test_a_collective_called_on_one_rank_only_is_named(tmp_path: Path) -> None:
    """Issue 47 item 10: rank 1 finished its script normally; rank 0's all_reduce is said to
    be called on one rank only (not a wait for the pg timeout, nor rank 1 'lost')."""
    script = tmp_path / "one_rank.py"
    script.write_text(ONE_RANK)
    job_id = f"t-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "STRATAGEM_PEER_TIMEOUT_S": "2",
           "STRATAGEM_PG_TIMEOUT_S": str(PG_TIMEOUT_S), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(stratagem_cmd("run", "--nproc", "2", "--job-id", job_id,
                                        "--max-restarts", "0", str(script)),
                          capture_output=True, text=True, env=env, timeout=PG_TIMEOUT_S / 3)
    assert proc.returncode == 1, proc.stderr[-3000:]
    err = proc.stderr
    # gloo notices rank 1's closed sockets ("a remote worker crashing"), or, when they stay
    # open, the heartbeat thread finds rank 0 waiting in all_reduce: either way it is named
    first = next(line for line in err.splitlines() if "first failure" in line)
    assert "rank 1 finished its script normally" in first, err[-3000:]
    assert "called on one rank only" in first and "crash" not in first.split("(it did")[0]
    assert "PeerLost" not in err
    assert not job_processes(job_id)


def test_a_finished_peer_while_the_main_thread_waits_in_a_collective_is_named(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The heartbeat path (a finished peer whose sockets stay open: no gloo error)."""
    from stratagem.distributed import peer_watchdog

    monkeypatch.setattr(peer_watchdog, "main_thread_collective",
                        lambda peer: "all_reduce (called from train.py:9)")
    a, b = _pair(1.0)
    a.start(), b.start()
    time.sleep(0.3)
    b.stop(done=True)  # finished its script normally
    assert _wait_until(lambda: a.lost is not None, 10)
    a.stop()
    assert a.lost is not None and a.lost.startswith("this rank waits in all_reduce (called "
                                                    "from train.py:9), but rank 1 finished")
    assert "called on one rank only" in a.lost


def test_the_main_threads_collective_is_found_with_its_caller() -> None:
    from stratagem.distributed.peer_watchdog import main_thread_collective

    namespace: dict = {}
    exec(compile("def all_reduce(tensor, group=None):\n    return wait()\n",  # noqa: S102
                 "/fake/torch/distributed/distributed_c10d.py", "exec"), namespace)
    found: list = []

    def wait() -> None:  # the main thread "blocked in work.wait()"
        thread = threading.Thread(target=lambda: found.append(main_thread_collective(1)))
        thread.start()
        thread.join(10)

    namespace["wait"] = wait
    namespace["all_reduce"](None)  # called from this test file
    assert found and found[0] is not None and found[0].startswith("all_reduce (called from ")
    assert "test_peer_watchdog.py:" in found[0]
    assert main_thread_collective(1) is None  # not in a collective now

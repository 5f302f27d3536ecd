"""End-to-end local runs of ``stratagem run`` (real torchrun, gloo, 2 workers)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from _load import patience
from launch_helpers import ALLREDUCE, CRASH, KILLED, SLEEPY, job_processes, stratagem_cmd

from stratagem import cli
from stratagem.launch.local import free_port
from stratagem.launch.netif import interface_for_address

Script = Callable[[str, str], Path]
pytestmark = pytest.mark.timeout(90)


def _job_id() -> str:
    return f"t-{uuid.uuid4().hex[:8]}"


def _no_leftovers(job_id: str, within: float = 3.0) -> list[int]:
    deadline = time.monotonic() + within
    while (left := job_processes(job_id)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def test_two_workers_all_reduce(script: Script, tmp_path: Path,
                                capsys: pytest.CaptureFixture[str]) -> None:
    job = _job_id()  # in-process launcher (saves an interpreter start); output is captured
    code = cli.main(["run", "--nproc", "2", "--job-id", job, str(script("ar.py", ALLREDUCE))])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert f"job {job}: 2 workers on 1 node" in err  # the plan, printed first
    lines = sorted(line for line in out.splitlines() if "sum=" in line)
    lo = interface_for_address("127.0.0.1")
    assert lines == [f"[node 0] rank {r}/2 sum=3 node=127.0.0.1 ifname={lo}" for r in (0, 1)]
    assert f"job {job} finished" in err
    assert _no_leftovers(job) == []


def test_crashing_worker_ends_job_fast(script: Script, tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    job = _job_id()
    started = time.monotonic()
    code = cli.main(["run", "--nproc", "2", "--job-id", job, str(script("crash.py", CRASH))])
    elapsed = time.monotonic() - started
    out, err = capsys.readouterr()
    assert code == 1, err
    assert elapsed < patience(45)  # seconds, not gloo's 30-minute collective timeout
    assert "rank 0 passed the barrier" not in out
    assert "stratagem: first failure: rank 1 on node 0 (127.0.0.1): " \
           "RuntimeError: boom from rank 1" in err
    assert 'raise RuntimeError("boom from rank 1")' in err
    assert _no_leftovers(job) == []


def test_a_failure_prints_one_summary_without_torch_elastic_log_lines(
        script: Script, capsys: pytest.CaptureFixture[str]) -> None:
    job = _job_id()  # rank 1 raises; torch elastic then stops rank 0 (SIGTERM, logged)
    code = cli.main(["run", "--nproc", "2", "--job-id", job, str(script("crash.py", CRASH))])
    out, err = capsys.readouterr()
    assert code == 1, err
    assert err.count("stratagem: first failure:") == 1
    leaked = [line for line in (out + err).splitlines()
              if re.match(r"(\[node \d+\] )?[DIWE]\d{4} ", line)
              or "closing signal" in line or "forcefully exiting" in line
              or "(exitcode: " in line or "torch.distributed" in line]
    assert leaked == []
    assert _no_leftovers(job) == []


def test_torch_elastic_records_go_to_stratagem_at_debug(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import logging

    from stratagem.launch.agent import TORCH_PCONTEXT_LOGGER, route_torch_elastic_logs

    route_torch_elastic_logs()
    route_torch_elastic_logs()  # idempotent: one line per record
    torch_log = logging.getLogger(TORCH_PCONTEXT_LOGGER)
    monkeypatch.setenv("STRATAGEM_LOG_LEVEL", "INFO")
    torch_log.warning("Sending process %s closing signal %s", 4242, "SIGTERM")
    out, err = capsys.readouterr()
    assert "4242" not in out + err
    monkeypatch.setenv("STRATAGEM_LOG_LEVEL", "DEBUG")  # stratagem run -v
    torch_log.warning("Sending process %s closing signal %s", 4243, "SIGTERM")
    out, err = capsys.readouterr()
    assert out == "stratagem: torch elastic: Sending process 4243 closing signal SIGTERM\n"
    assert err == ""


def test_killed_worker_is_blamed_not_its_peer_nor_forged_records(
        script: Script, capsys: pytest.CaptureFixture[str]) -> None:
    job = _job_id()
    code = cli.main(["run", "--nproc", "2", "--job-id", job, str(script("kill.py", KILLED))])
    out, err = capsys.readouterr()
    assert code == 1, err
    assert "stratagem: first failure: rank 1 on node 0 (127.0.0.1): killed by SIGKILL" in err
    assert "forged" not in err.split("stratagem: first failure:", 1)[1]
    # the look-alike lines are shown as the worker's output, not taken as records
    assert err.count("[node 0] @@stratagem-failure@@ ") == 2
    assert _no_leftovers(job) == []


def test_sigint_stops_every_worker(script: Script, tmp_path: Path) -> None:
    sig = signal.SIGINT  # through `python -m stratagem run`, as from a terminal
    job = _job_id()
    log = tmp_path / "out.log"
    with log.open("w") as out:
        proc = subprocess.Popen(stratagem_cmd("run", "--nproc", "2", "--job-id", job,
                                              str(script("sleepy.py", SLEEPY))),
                                stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path)
        try:
            deadline = time.monotonic() + 60
            while log.read_text().count("ready rank") < 2:
                assert proc.poll() is None, log.read_text()
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.1)
            # launcher, agent, torchrun and 2 workers: all but the launcher carry the id
            assert len(job_processes(job)) >= 3
            os.kill(proc.pid, sig)
            code = proc.wait(timeout=20)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert code == 128 + sig, log.read_text()
    assert f"{sig.name} received; stopped every worker" in log.read_text()
    assert _no_leftovers(job) == []


def test_agent_stops_when_stdin_closes(script: Script, tmp_path: Path) -> None:
    """What stops a remote node when the launcher or its ssh connection goes away."""
    job = _job_id()
    log = tmp_path / "agent.log"
    argv = [sys.executable, "-m", "stratagem.launch.agent", "--watch-stdin", "--",
            "--nnodes", "1", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", job,
            "--max-restarts", "0", "-m", "stratagem.launch.worker",
            str(script("sleepy.py", SLEEPY))]
    env = {**os.environ, "STRATAGEM_JOB_ID": job, "STRATAGEM_NODE_ADDRESS": "127.0.0.1"}
    with log.open("w") as out:
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=out, stderr=out, env=env,
                                cwd=tmp_path, start_new_session=True)
        try:
            deadline = time.monotonic() + 60
            while "ready rank 0" not in log.read_text():
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.1)
            assert proc.stdin is not None
            proc.stdin.close()
            code = proc.wait(timeout=20)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    assert code == 128 + signal.SIGTERM, log.read_text()
    assert _no_leftovers(job) == []

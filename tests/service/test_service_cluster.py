"""`stratagem cluster up`, a job through the CLI, `cluster status`, `cluster down`: the real
processes (a local Ray head with fake GPUs and the scheduler daemon)."""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import pytest
from _ray_service import JOB_SCRIPT

from stratagem.cli import main
from stratagem.service.api import ServiceClient

pytestmark = pytest.mark.slow


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone too
        return f.read().split(")")[-1].split()[0] != "Z"


def test_cluster_up_submit_ls_logs_down(tmp_path, capsys, monkeypatch):
    """Also: the files are private, a scheduler killed with SIGKILL is restarted alone by
    another `up` (same Ray head, the running job taken over), and `down` stops all."""
    # as a fresh `stratagem` process: no RAY_AUTH_MODE left by ray.init() in this one
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    pytest.importorskip("ray", reason="Ray is an optional extra: pip install "
                        "'stratagem[cluster]'")
    c = tmp_path / "c"
    d = ["--dir", str(c)]
    t0 = time.monotonic()
    assert main(["cluster", "up", "--num-cpus", "2", "--gpus", "1", "--gpu-resource",
                 "fake_gpu", "--interval", "0.5", *d]) == 0
    print(f"cluster up took {time.monotonic() - t0:.1f} s", file=sys.stderr)  # not asserted
    record = json.loads((c / "cluster.json").read_text())
    up_line = capsys.readouterr().out
    try:
        assert main(["cluster", "up", *d]) == 2
        assert "already up" in capsys.readouterr().err
        assert c.stat().st_mode & 0o777 == 0o700
        for name in ("cluster.json", "service.json", "state.db", "ray_token"):
            assert (c / name).stat().st_mode & 0o777 == 0o600, name
        assert main(["cluster", "status", *d]) == 0
        out = capsys.readouterr().out
        # one Ray address, the one Ray itself reports, in up's line, status and the record
        address = out.split("Ray at ", 1)[1].split(";", 1)[0]
        assert up_line.startswith(f"cluster up: Ray at {address}, "), (up_line, out)
        assert record["address"] == address
        assert "fake_gpu=1" in out and all(len(line) <= 80 for line in out.splitlines())
        job = tmp_path / "job.yaml"
        job.write_text(f"name: one\nscript: {JOB_SCRIPT}\nargs: [--epochs, '2']\n"
                       "resources: {CPU: 1, GPU: 1}\n")
        assert main(["submit", str(job), *d]) == 0
        client = ServiceClient(c)
        deadline = time.monotonic() + 120
        while client.jobs()[0]["state"] != "running":
            assert time.monotonic() < deadline, client.jobs()
            time.sleep(0.2)
        os.kill(record["scheduler_pid"], signal.SIGKILL)  # the scheduler crashes
        deadline = time.monotonic() + 30
        while alive(record["scheduler_pid"]):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert main(["cluster", "up", *d]) == 0
        assert "scheduler restarted" in capsys.readouterr().out
        again = json.loads((c / "cluster.json").read_text())
        assert again["ray"] == record["ray"] and again["scheduler_pid"] != record[
            "scheduler_pid"]
        record = again
        client = ServiceClient(c)
        deadline = time.monotonic() + 180
        while client.jobs()[0]["state"] not in ("succeeded", "failed"):
            assert time.monotonic() < deadline, client.jobs()
            time.sleep(0.5)
        assert client.jobs()[0]["state"] == "succeeded"
        assert client.jobs()[0]["restarts"] == 0  # taken over, not restarted
        assert main(["logs", "one", "-f", *d]) == 0
        out = capsys.readouterr().out
        assert "started with 1 replicas" in out and "training on 1 replicas" in out
    finally:
        t0 = time.monotonic()
        assert main(["cluster", "down", *d]) == 0
        print(f"cluster down took {time.monotonic() - t0:.1f} s", file=sys.stderr)
    deadline = time.monotonic() + 30
    while any(alive(p) for p in (record["ray_pid"], record["scheduler_pid"])):
        assert time.monotonic() < deadline, "cluster down left processes behind"
        time.sleep(0.2)
    assert not (c / "service.json").exists()
    pointer = Path(tempfile.gettempdir()) / "ray" / "ray_current_cluster"  # as `ray stop`
    assert not pointer.exists() or not pointer.read_text().strip().endswith(
        record["address"].rsplit(":", 1)[-1]), "a later ray.init() would join a dead head"

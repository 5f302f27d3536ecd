"""`stratagem cluster up`, a job through the CLI, `cluster status`, `cluster down`: the real
processes (a local Ray head with fake GPUs and the scheduler daemon)."""

from __future__ import annotations

import json
import os
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


def test_cluster_up_submit_ls_logs_down(tmp_path, capsys):
    pytest.importorskip("ray", reason="Ray is an optional extra: pip install "
                        "'stratagem[cluster]'")
    d = ["--dir", str(tmp_path / "c")]
    assert main(["cluster", "up", "--num-cpus", "2", "--gpus", "1", "--gpu-resource",
                 "fake_gpu", "--interval", "0.5", *d]) == 0
    record = json.loads((tmp_path / "c" / "cluster.json").read_text())
    up_line = capsys.readouterr().out
    try:
        assert main(["cluster", "up", *d]) == 2
        assert "already up" in capsys.readouterr().err
        assert main(["cluster", "status", *d]) == 0
        out = capsys.readouterr().out
        # one Ray address, the one Ray itself reports, in up's line, status and the record
        address = out.split("Ray at ", 1)[1].split(";", 1)[0]
        assert up_line.startswith(f"cluster up: Ray at {address}, "), (up_line, out)
        assert record["address"] == address
        assert "fake_gpu=1" in out and all(len(line) <= 80 for line in out.splitlines())
        job = tmp_path / "job.yaml"
        job.write_text(f"name: one\nscript: {JOB_SCRIPT}\nargs: [--epochs, '1']\n"
                       "resources: {CPU: 1, GPU: 1}\n")
        assert main(["submit", str(job), *d]) == 0
        client = ServiceClient(tmp_path / "c")
        deadline = time.monotonic() + 120
        while client.jobs()[0]["state"] not in ("succeeded", "failed"):
            assert time.monotonic() < deadline, client.jobs()
            time.sleep(0.5)
        assert client.jobs()[0]["state"] == "succeeded"
        assert main(["logs", "one", "-f", *d]) == 0
        out = capsys.readouterr().out
        assert "started with 1 replicas" in out and "training on 1 replicas" in out
    finally:
        assert main(["cluster", "down", *d]) == 0
    deadline = time.monotonic() + 30
    while any(alive(p) for p in (record["ray_pid"], record["scheduler_pid"])):
        assert time.monotonic() < deadline, "cluster down left processes behind"
        time.sleep(0.2)
    assert not (tmp_path / "c" / "service.json").exists()
    pointer = Path(tempfile.gettempdir()) / "ray" / "ray_current_cluster"  # as `ray stop`
    assert not pointer.exists() or not pointer.read_text().strip().endswith(
        record["address"].rsplit(":", 1)[-1]), "a later ray.init() would join a dead head"

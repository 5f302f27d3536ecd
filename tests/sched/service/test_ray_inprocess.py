"""In-process rescale on a local Ray cluster: a job shrinks 2 -> 1 and grows back to 2
without a restart, sees every sample exactly once per epoch, and ends with the parameters
of an uninterrupted single-process run."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _ray_service import FAKE_GPU, JOB_SCRIPT

from stratagem.sched.service.jobfile import parse_job
from stratagem.sched.service.ray_backend import RayBackend, store_name
from stratagem.sched.service.scheduler import job_dirs, job_env

pytestmark = pytest.mark.slow
ARGS = ("--epochs", "4", "--step-sleep", "0.25")


def logs(directory: Path) -> str:
    return "\n".join(p.read_text() for p in sorted(directory.glob("rank-*.log")))


def wait_for(cond, timeout: float, what: str, directory: Path) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}:\n{logs(directory)}"
        time.sleep(0.1)


def test_a_job_shrinks_and_grows_in_process_and_trains_as_alone(ray_cluster, tmp_path):
    ids = tmp_path / "ids"
    ids.mkdir()
    spec = parse_job({"name": "ip", "script": str(JOB_SCRIPT), "min_replicas": 1,
                      "max_replicas": 2, "resources": {"CPU": 1, "GPU": 1},
                      "args": [*ARGS, "--ids", str(ids), "--out", str(tmp_path / "ip.json")]})
    assert spec.in_process_rescale
    ckpt, log_dir = job_dirs(tmp_path, spec)
    backend = RayBackend(FAKE_GPU, start_timeout=60.0, grace=30.0)
    env = job_env(spec, ckpt)
    launched = backend.launch(spec, 2, 0, env, log_dir, in_process=True)
    try:
        assert backend.in_process(launched)
        wait_for(lambda: "training on 2 replicas" in logs(log_dir), 90, "2 replicas", log_dir)
        launched = backend.resize(spec, launched, 1, env, log_dir)
        assert launched is not None and len(launched.actors) == 1
        wait_for(lambda: "training on 1 replicas" in logs(log_dir), 60, "1 replica", log_dir)
        launched = backend.resize(spec, launched, 2, env, log_dir)
        assert launched is not None and len(launched.actors) == 2
        wait_for(lambda: logs(log_dir).count("training on 2 replicas") == 2, 90,
                 "the joiner", log_dir)
        wait_for(lambda: all(c is not None for c in backend.poll(launched)), 120,
                 "the end", log_dir)
        assert backend.poll(launched) == [0, 0], logs(log_dir)
    finally:
        backend.stop(launched, grace=0.0)
    assert backend._actor(store_name(launched)) is None  # the store went with the job
    text = logs(log_dir)
    assert text.count("--- ") == 3, text  # two replicas started, one added: no restart
    assert "rescaled 2 -> 1 workers" in text and "rescaled 1 -> 2 workers" in text, text
    # every sample exactly once per epoch, whatever the world size at each step
    seen: dict[int, list[int]] = {}
    worlds = set()
    for f in ids.glob("ids-*.jsonl"):
        for line in f.read_text().splitlines():
            rec = json.loads(line)
            seen.setdefault(rec["epoch"], []).extend(rec["ids"])
            worlds.add(rec["world"])
    assert worlds == {1, 2}
    assert sorted(seen) == [0, 1, 2, 3]
    for epoch, got in seen.items():
        assert sorted(got) == list(range(1024)), f"epoch {epoch}: a sample lost or repeated"
    # the same parameters as one process training alone at the same global batch
    alone = tmp_path / "alone.json"
    subprocess.run([sys.executable, str(JOB_SCRIPT), "--epochs", "4", "--out", str(alone)],
                   check=True, capture_output=True, timeout=120)
    want, got = (json.loads(p.read_text()) for p in (alone, tmp_path / "ip.json"))
    assert len(got["params"]) == len(want["params"]) == 420
    assert max(abs(a - b) for a, b in zip(got["params"], want["params"], strict=True)) < 1e-4
    assert got["accuracy"] == pytest.approx(want["accuracy"], abs=0.005)

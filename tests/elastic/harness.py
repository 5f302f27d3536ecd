"""Run the elastic job under torchrun, stop it mid-step with SIGTERM, read what it logged."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

JOB = Path(__file__).with_name("elastic_job.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Run:
    returncode: int
    log: str


def torchrun(nproc: int, out: Path, ckpt: Path, *, stop_at: int | None = None,
             elastic_nnodes: bool = False, timeout: float = 90.0,
             args: tuple[str, ...] = ()) -> Run:
    """Run the job with ``nproc`` workers. With ``stop_at``, wait until every rank signals
    (file ``ready-<rank>``) that it is inside that step, then SIGTERM torchrun itself.
    ``elastic_nnodes`` launches as an elastic job (``--nnodes 1:2``, c10d rendezvous)."""
    for stale in out.glob("ready-*"):
        stale.unlink()
    if elastic_nnodes:
        launch = ["--nnodes", "1:2", "--rdzv-backend", "c10d",
                  "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", "elastic-test",
                  "--rdzv-conf", "last_call_timeout=1,join_timeout=60"]
    else:
        launch = ["--standalone"]
    cmd = [sys.executable, "-m", "torch.distributed.run", *launch,
           "--nproc-per-node", str(nproc), "--monitor-interval", "0.05", str(JOB),
           "--out", str(out)]
    if stop_at is not None:
        cmd += ["--stop-at", str(stop_at)]
    cmd += list(args)
    env = {**os.environ, "STRATAGEM_CHECKPOINT_DIR": str(ckpt), "OMP_NUM_THREADS": "1",
           "PYTHONUNBUFFERED": "1"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    log_path = out / f"torchrun-{nproc}-{stop_at}.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            deadline = time.monotonic() + timeout
            if stop_at is not None:
                ready = [out / f"ready-{r}" for r in range(nproc)]
                while not all(p.exists() for p in ready):
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise AssertionError(f"job did not reach step {stop_at}:\n"
                                             + log_path.read_text()[-4000:])
                    time.sleep(0.01)
                proc.send_signal(signal.SIGTERM)
            proc.wait(max(1.0, deadline - time.monotonic()))
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return Run(proc.returncode, log_path.read_text())


def logged_steps(out: Path) -> dict[int, list[dict]]:
    """step -> the records of every rank that trained it (each line: step, epoch, rank,
    world, ids)."""
    steps: dict[int, list[dict]] = {}
    for f in sorted(out.glob("ids-*.jsonl")):
        for line in f.read_text().splitlines():
            rec = json.loads(line)
            steps.setdefault(rec["step"], []).append(rec)
    return steps

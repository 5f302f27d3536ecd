"""SIGTERM to ``stratagem run`` while the script's DataLoader has worker processes: the
training processes save the job state and the next run resumes from it (issue 48 item 2).

torch elastic stopped each worker by signalling its whole process group, so the DataLoader's
worker processes died with the training process, which then failed (``DataLoader worker
... is killed by signal``) before its SIGTERM save: the job started over at epoch 0.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from adaptdl_harness import SCRIPT, SCRIPTS, logs, steps
from test_cifar_style import EPOCHS, STEPS_PER_EPOCH, check_every_sample_once

from stratagem import checkpoint

pytestmark = pytest.mark.timeout(150)


def _run(ckpt: Path, out: Path, log: Path, extra: list[str]) -> subprocess.Popen:
    from adaptdl_harness import base_env

    env = {k: v for k, v in base_env(ckpt).items() if k != "ADAPTDL_CHECKPOINT_PATH"}
    env["STRATAGEM_CHECKPOINT_DIR"] = str(ckpt)  # what the job used
    cmd = [sys.executable, "-m", "stratagem", "run", "--nproc", "2", str(SCRIPT),
           "--out", str(out), "--workers", "2", *extra]
    return subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            cwd=SCRIPTS)


def test_sigterm_to_the_launcher_saves_with_loader_workers_and_resumes(
        tmp_path: Path) -> None:
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    log = tmp_path / "run1.log"
    proc = _run(ckpt, out, log, ["--stop-at", "3"])  # inside epoch 0's loader loop
    try:
        ready = [out / f"ready-{r}" for r in range(2)]
        deadline = time.monotonic() + 90
        while not all(p.exists() and p.read_text() for p in ready):
            assert proc.poll() is None, logs(log)[-3000:]
            assert time.monotonic() < deadline, logs(log)[-3000:]
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)  # the launcher only, as a user or scheduler does
        time.sleep(1.0)  # the stop reaches the workers (and their loaders) while parked
        (out / "go").touch()
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for f in [*out.glob("ready-*"), out / "go"]:
            f.unlink(missing_ok=True)
    text = logs(log)
    assert code == 128 + signal.SIGTERM, text[-3000:]
    saved = checkpoint.CheckpointDir(ckpt).checkpoints()
    assert saved, text[-3000:]
    assert not [p for p in ckpt.iterdir() if ".tmp" in p.name]
    assert f"the job state was saved to {saved[-1]}" in text, text[-3000:]
    assert max(steps(out)) == 3  # stopped after the parked step

    log = tmp_path / "run2.log"
    proc = _run(ckpt, out, log, [])
    try:
        code = proc.wait(timeout=100)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert code == 0, logs(log)[-3000:]
    check_every_sample_once(out)  # resumed at step 4 of epoch 0: nothing lost or repeated
    assert sorted(steps(out)) == list(range(1, EPOCHS * STEPS_PER_EPOCH + 1))
    assert os.path.isdir(ckpt)

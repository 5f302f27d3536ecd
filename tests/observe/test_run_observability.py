"""`stratagem run` with two workers: the metrics file of a known run, per-rank log files
with the chief's output on the console, and one traceback when a rank crashes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from stratagem.observe import read_metrics

SCRIPT = Path(__file__).with_name("train_two.py")


def _run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in __import__("os").environ.items()
           if not k.startswith(("STRATAGEM_", "ADAPTDL_"))}
    env["STRATAGEM_PROGRESS"] = "plain"
    return subprocess.run([sys.executable, "-m", "stratagem", "run", "--nproc", "2",
                           "--run-dir", str(tmp_path / "run"), *args], cwd=tmp_path,
                          capture_output=True, text=True, timeout=180, env=env)


def test_two_workers_metrics_and_log_files(tmp_path: Path) -> None:
    proc = _run(tmp_path, "--log-dir", "logs", str(SCRIPT))
    assert proc.returncode == 0, proc.stderr
    # metrics: 64 samples in global batches of 16 -> 4 steps per epoch, 2 epochs
    records = read_metrics(tmp_path / "run")
    assert [r["step"] for r in records] == list(range(1, 9))
    assert [r["epoch"] for r in records] == [0] * 4 + [1] * 4
    assert all(r["batch_size"] == 16 and r["replicas"] == 2 for r in records)
    assert all(r["rank"] == 0.0 for r in records)  # rank 0's reported values
    assert all(isinstance(r["loss"], float) for r in records)
    # one all-reduce of 20 bytes per step: 2 (N-1)/N x 20 = 20 bytes on the wire (N = 2)
    assert [r["allreduce_bytes"] for r in records] == [20.0] * 8
    # logs: each rank's own files; the console shows rank 0's output only
    logs = tmp_path / "logs"
    for rank in (0, 1):
        assert f"rank {rank} says hi" in (logs / f"rank{rank}.stdout.log").read_text()
        assert f"rank {rank} warns" in (logs / f"rank{rank}.stderr.log").read_text()
    console = proc.stdout + proc.stderr
    assert "rank 0 says hi" in console and "rank 0 warns" in console
    assert "rank 1" not in console
    assert "epoch 1 step 4/4" in (logs / "rank0.stdout.log").read_text()


@pytest.mark.parametrize("log_dir", [False, True])
def test_crash_prints_one_traceback(tmp_path: Path, log_dir: bool) -> None:
    args = ("--log-dir", "logs") if log_dir else ()
    proc = _run(tmp_path, *args, str(SCRIPT), "crash")
    console = proc.stdout + proc.stderr
    assert proc.returncode == 1, console
    assert console.count("Traceback (most recent call last)") == 1, console
    assert console.count("ValueError: rank one broke") == 2  # summary line + traceback
    assert "first failure: rank 1" in console
    if log_dir:
        assert "ValueError: rank one broke" in (tmp_path / "logs" / "rank1.stderr.log"
                                                ).read_text()

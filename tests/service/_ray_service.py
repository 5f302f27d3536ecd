"""Shared names of the cluster-service tests."""

from pathlib import Path

JOB_SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "cluster" / "classify.py"
CRASH_SCRIPT = Path(__file__).with_name("_crash_job.py")  # exits 3 at once
FAKE_GPU = "fake_gpu"

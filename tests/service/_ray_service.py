"""Shared names of the cluster-service tests."""

from pathlib import Path

JOB_SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "cluster" / "classify.py"
FAKE_GPU = "fake_gpu"

"""Shared names of the cluster-service tests."""

from pathlib import Path

JOB_SCRIPT = Path(__file__).with_name("classify_job.py")
FAKE_GPU = "fake_gpu"

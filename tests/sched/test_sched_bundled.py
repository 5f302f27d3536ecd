"""The Pollux data ships with the package: in the wheel, small, with its attribution."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from stratagem.sched.simulator.bundled import POLLUX_DIR, pollux_workloads, resolve_workload

REPO = Path(__file__).resolve().parents[2]


def test_the_bundled_data_is_complete_small_and_attributed():
    assert pollux_workloads() == [f"workload-{i}" for i in range(1, 9)]
    apps = sorted(p.name for p in (POLLUX_DIR / "profiles").iterdir())
    assert apps == ["bert", "cifar10", "deepspeech2", "imagenet", "ncf", "yolov3"]
    size = sum(p.stat().st_size for p in POLLUX_DIR.rglob("*") if p.is_file())
    assert size < 1_000_000  # bytes: it travels in every wheel
    readme = (POLLUX_DIR / "README.md").read_text()
    assert "Apache License, Version 2.0" in readme and "github.com/petuum/adaptdl" in readme
    assert resolve_workload("pollux:workload-3") == \
        POLLUX_DIR / "workloads-realistic" / "workload-3.csv"
    assert resolve_workload("pollux:").is_dir()
    assert resolve_workload("my.csv") == Path("my.csv")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_an_installed_wheel_carries_the_data(tmp_path):
    src = tmp_path / "src"
    shutil.copy(REPO / "pyproject.toml", src.parent / "pyproject.toml")
    shutil.copy(REPO / "README.md", src.parent / "README.md")
    shutil.copytree(REPO / "src", src,
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    out = tmp_path / "wheel"
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                           "--no-build-isolation", "--no-index", "-q", "-w", str(out),
                           str(tmp_path)], capture_output=True, text=True, timeout=110)
    if proc.returncode != 0 and "No module named" in proc.stderr:
        pytest.skip(f"cannot build a wheel here: {proc.stderr.strip()[-200:]}")
    assert proc.returncode == 0, proc.stderr
    (wheel,) = out.glob("stratagem-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = [str(p.relative_to(REPO / "src")) for p in POLLUX_DIR.rglob("*") if p.is_file()]
    assert len(expected) == 61
    assert [n for n in expected if n not in names] == []

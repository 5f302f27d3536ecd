"""The README's example script on a GPU, unchanged: alone (``python train_mlp.py``) and as two
nodes of one GPU each (``torchrun --nnodes 2`` without a resource spec, the nodes sharing
the one GPU lent), against the same script alone on the CPU. AutoDist places the model on
the GPU and ``ad.data_loader`` hands out its batches there. Skipped without CUDA."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _jobs import job_free_env, torchrun_agent
from _spawn import free_port

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "train_mlp.py"
ARGS = ["--epochs", "2"]


def alone(tmp_path: Path, gpu: bool) -> dict[str, torch.Tensor]:
    ck = tmp_path / ("gpu" if gpu else "cpu")
    run = subprocess.run([sys.executable, str(SCRIPT), *ARGS, "--save", str(ck)],
                         env=job_free_env(gpu), capture_output=True, text=True, timeout=120,
                         cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    return torch.load(ck / "model.pt", weights_only=True, map_location="cpu")


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=1e-3, atol=1e-4, msg=k)


def test_the_example_alone_on_the_gpu(tmp_path: Path) -> None:
    assert_same(alone(tmp_path, gpu=True), alone(tmp_path, gpu=False))


def test_the_example_on_two_gpu_nodes_under_plain_torchrun(tmp_path: Path) -> None:
    port, ck = free_port(), tmp_path / "two"
    agents = [subprocess.Popen([*torchrun_agent(2, node, port, "example"), str(SCRIPT), *ARGS,
                                "--save", str(ck)], env=job_free_env(gpu=True), cwd=tmp_path,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
              for node in (0, 1)]
    outs = [a.communicate(timeout=180)[0] for a in agents]
    assert [a.returncode for a in agents] == [0, 0], "\n".join(outs)[-4000:]
    assert "2 replicas" in "\n".join(outs)
    got = torch.load(ck / "model.pt", weights_only=True, map_location="cpu")
    assert_same(got, alone(tmp_path, gpu=False))

"""The README's example script on a GPU, unchanged: alone (``python train_mlp.py``) and as two
nodes of one GPU each (``torchrun --nnodes 2`` without a resource spec, the nodes sharing
the one GPU lent), against the same script alone on the CPU. AutoDist places the model on
the GPU and ``ad.data_loader`` hands out its batches there. Skipped without CUDA."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "adaptdl"))
from adaptdl_harness import SHARE_ONE_GPU, free_port  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "train_mlp.py"
ARGS = ["--epochs", "2"]


def env(gpu: bool) -> dict[str, str]:
    out = {k: v for k, v in os.environ.items()
           if not k.startswith(("STRATAGEM_", "ADAPTDL_")) and k not in
           ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")}
    out.update(OMP_NUM_THREADS="1", NVIDIA_TF32_OVERRIDE="0")
    if gpu:
        out["PYTHONPATH"] = os.pathsep.join([str(SHARE_ONE_GPU), out.get("PYTHONPATH", "")])
    else:
        out["CUDA_VISIBLE_DEVICES"] = ""
    return out


def alone(tmp_path: Path, gpu: bool) -> dict[str, torch.Tensor]:
    ck = tmp_path / ("gpu" if gpu else "cpu")
    run = subprocess.run([sys.executable, str(SCRIPT), *ARGS, "--save", str(ck)], env=env(gpu),
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
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
    agents = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node",
         "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id",
         "example", "--rdzv-conf", f"is_host={int(node == 0)}", "--max-restarts", "0",
         str(SCRIPT), *ARGS, "--save", str(ck)], env=env(gpu=True), cwd=tmp_path,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for node in (0, 1)]
    outs = [a.communicate(timeout=180)[0] for a in agents]
    assert [a.returncode for a in agents] == [0, 0], "\n".join(outs)[-4000:]
    assert "2 replicas" in "\n".join(outs)
    got = torch.load(ck / "model.pt", weights_only=True, map_location="cpu")
    assert_same(got, alone(tmp_path, gpu=False))

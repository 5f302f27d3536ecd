"""Environments and command lines for tests that start jobs the way users do: the parent's
environment without its job variables, torch elastic agents of a multi-node job on this
machine, and ranks sharing the one GPU a test machine may have."""

from __future__ import annotations

import os
import sys
from pathlib import Path

SHARE_ONE_GPU = Path(__file__).resolve().parent / "gpu" / "share_one_gpu"
JOB_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                 "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


def job_free_env(gpu: bool = False) -> dict[str, str]:
    """The parent's environment without job variables (torch elastic's, ``STRATAGEM_*``,
    ``ADAPTDL_*``), one thread per process, on the CPU (no GPU visible) unless ``gpu``:
    then the ranks share the machine's one GPU (``gpu/share_one_gpu``), with TF32 off so
    that float32 rounds close to a CPU reference."""
    env = {k: v for k, v in os.environ.items() if k not in JOB_VARIABLES
           and not k.startswith(("STRATAGEM_", "ADAPTDL_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if gpu:
        env["PYTHONPATH"] = os.pathsep.join(
            [str(SHARE_ONE_GPU), *filter(None, [env.get("PYTHONPATH")])])
        env["NVIDIA_TF32_OVERRIDE"] = "0"
    else:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def torchrun_agent(nnodes: int, node: int, port: int, run_id: str) -> list[str]:
    """The command of agent ``node`` of ``torchrun --nnodes N --nproc-per-node 1`` on this
    machine (c10d rendezvous on ``port``, hosted by agent 0), to which the script and its
    arguments are appended."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes),
            "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
            f"127.0.0.1:{port}", "--rdzv-id", run_id, "--rdzv-conf",
            f"is_host={int(node == 0)}", "--max-restarts", "0", "--monitor-interval", "0.05"]


def share_one_gpu(rank: int) -> None:
    """In a spawned rank: NCCL takes it for a host of its own, on loopback sockets (NCCL
    refuses two ranks of one host on one device), and its device is ``cuda:0``."""
    import torch

    os.environ.update(NCCL_HOSTID=f"stratagem-test-{rank}", NCCL_SOCKET_IFNAME="lo",
                      NCCL_IB_DISABLE="1")
    torch.cuda.set_device(0)

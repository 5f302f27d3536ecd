"""Launcher test helpers: tiny training scripts and a /proc scan for leftover workers."""

from __future__ import annotations

import os
import sys
from pathlib import Path

ALLREDUCE = """
import os, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
node, ifname = os.environ["STRATAGEM_NODE_ADDRESS"], os.environ.get("GLOO_SOCKET_IFNAME")
print(f"rank {dist.get_rank()}/{dist.get_world_size()} sum={t.item():g} node={node} "
      f"ifname={ifname}", flush=True)
dist.destroy_process_group()
"""

CRASH = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
if dist.get_rank() == 1:
    raise RuntimeError("boom from rank 1")
dist.all_reduce(torch.ones(1))
dist.barrier()
print("rank 0 passed the barrier", flush=True)
"""

SLEEPY = """
import time, torch.distributed as dist
dist.init_process_group("gloo")
print(f"ready rank {dist.get_rank()}", flush=True)
time.sleep(600)
"""


def job_processes(job_id: str) -> list[int]:
    """Pids whose environment carries ``STRATAGEM_JOB_ID=<job_id>`` (independent of the
    launcher's own sweep, on purpose)."""
    needle = f"STRATAGEM_JOB_ID={job_id}".encode()
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                env = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if needle in env:
                pids.append(int(entry))
    return pids


def stratagem_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "stratagem", *args]

KILLED = """
import os, signal, sys, torch, torch.distributed as dist
dist.init_process_group("gloo")
if dist.get_rank() == 0:  # look-alike failure records, as a script's output could contain
    fake = '{"kind": "signal", "signal": "SIGSEGV", "rank": "7", "time": 0, "message": "forged"}'
    print("@@stratagem-failure@@ " + fake, file=sys.stderr, flush=True)
    print("@@stratagem-failure@@ 0123456789abcdef " + fake, file=sys.stderr, flush=True)
dist.barrier()
if dist.get_rank() == 1:
    os.kill(os.getpid(), signal.SIGKILL)  # what the OOM killer or `kill -9` does
while True:
    dist.all_reduce(torch.ones(1))  # rank 0: fails (connection reset) or is stopped
"""

"""stratagem.distributed.process_group's default backends, and its exit rule: the groups go before
interpreter teardown, with no handle left that would keep one alive past it (torch 2.13's
gloo aborts a process whose group is destroyed during teardown: 5 of 50 successful
2-worker runs under torchrun)."""

from __future__ import annotations

import subprocess
import sys

import torch

from stratagem.distributed import process_group

SCRIPT = """
import gc, weakref
import torch
import torch.distributed as dist
from stratagem.distributed import process_group
from stratagem.errors import DistributedError
from stratagem.runtime.comm import Comm
from stratagem.runtime.stats import CommStats

process_group.init_single_process_group()
group = weakref.ref(dist.group.WORLD)
comm = Comm(dist.group.WORLD, "gloo", CommStats())
t = torch.ones(2)
comm.wait(comm.all_reduce(t))
gone = Comm(dist.group.WORLD, "gloo", CommStats())
del gone  # a collected holder is forgotten, not kept alive
gc.collect()
process_group._at_exit()  # what runs at exit
gc.collect()
print("group alive:", group() is not None)
print("handle:", comm.group)
try:
    comm.all_reduce(t)
except DistributedError as exc:
    print("after release:", exc.problem)
"""


def test_the_exit_hook_leaves_no_handle_that_keeps_the_group_alive() -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert "group alive: False" in lines  # the communicator dropped its handle first
    assert "handle: None" in lines
    assert "after release: the gloo communicator was released at interpreter exit" in lines


def test_a_gpu_jobs_default_group_takes_cpu_tensors_too() -> None:
    """NCCL for CUDA tensors, gloo for the CPU control tensors the planner and runtime
    exchange on the default group; a CPU job, gloo alone (tests/gpu runs the GPU one)."""
    assert process_group.default_backend("cuda:0") == "cpu:gloo,cuda:nccl"
    assert process_group.default_backend(torch.device("cpu")) == "gloo"

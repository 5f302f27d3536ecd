"""What each worker process gets from ``stratagem run``: the worker count of ``--nproc``
over a single-node spec, its spec GPU and the network interfaces (no GPU needed)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from stratagem import cli
from stratagem.autodist import AutoDist
from stratagem.errors import LaunchError
from stratagem.launch.env import job_env, nproc_override
from stratagem.launch.netif import interface_for_address
from stratagem.resource import Node, ResourceSpec

Script = Callable[[str, str], Path]
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
pytestmark = pytest.mark.timeout(120)

COUNT = """
import stratagem as sg
ad = sg.AutoDist(verbose=False)
print(f"rank {ad.rank} world {ad.world_size} spec {ad.resource_spec.num_workers} "
      f"device {ad.rank_devices[ad.rank]}", flush=True)
"""

DEVICE = """
import os
from types import SimpleNamespace
import torch
from stratagem.autodist import AutoDist
from stratagem.resource import ResourceSpec

chosen = []
torch.cuda.is_available = lambda: True  # no GPU here: see which one would be used
torch.cuda.set_device = chosen.append
spec = ResourceSpec.from_file(os.environ["STRATAGEM_RESOURCE_SPEC"])
device = AutoDist._pick_device(SimpleNamespace(resource_spec=spec,
                                               local_rank=int(os.environ["LOCAL_RANK"])))
env = " ".join(f"{k}={os.environ.get(k)}" for k in
               ("CUDA_DEVICE_ORDER", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"))
print(f"local_rank {os.environ['LOCAL_RANK']} device {device} set {chosen} {env}", flush=True)
"""


def test_nproc_overrides_a_single_node_spec_in_every_worker(
        script: Script, capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(["run", "--resource-spec", str(EXAMPLES / "specs" / "local.yml"),
                     "--nproc", "3", str(script("count.py", COUNT))])
    out, err = capsys.readouterr()
    assert code == 0, err
    lines = sorted(line for line in out.splitlines() if "world" in line)
    assert lines == [f"[node 0] rank {r} world 3 spec 3 device 127.0.0.1:CPU:{r}"
                     for r in range(3)], err


def test_each_worker_uses_its_spec_gpu_and_the_node_interface(
        script: Script, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = tmp_path / "gpus.yml"
    spec.write_text("nodes:\n  - address: 127.0.0.1\n    gpus: [2, 3]\n")
    code = cli.main(["run", "--resource-spec", str(spec), str(script("dev.py", DEVICE))])
    out, err = capsys.readouterr()
    assert code == 0, err
    lo = interface_for_address("127.0.0.1")
    lines = sorted(line for line in out.splitlines() if "local_rank" in line)
    assert lines == [f"[node 0] local_rank {r} device cuda:{g} set [{g}] "
                     f"CUDA_DEVICE_ORDER=PCI_BUS_ID GLOO_SOCKET_IFNAME={lo} "
                     f"NCCL_SOCKET_IFNAME={lo}" for r, g in ((0, 2), (1, 3))], err


def test_pick_device_without_a_known_node_falls_back_to_the_local_rank(
        monkeypatch: pytest.MonkeyPatch) -> None:
    spec = ResourceSpec.from_dict({"nodes": [
        {"address": "10.0.0.1", "gpus": [2, 3], "chief": True},
        {"address": "10.0.0.2", "gpus": [4]}]})
    chosen: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setenv("STRATAGEM_NODE_ADDRESS", "10.0.0.2")
    assert AutoDist._pick_device(SimpleNamespace(resource_spec=spec, local_rank=0)) == \
        torch.device("cuda", 4)
    monkeypatch.delenv("STRATAGEM_NODE_ADDRESS")  # plain torchrun, no address
    assert AutoDist._pick_device(SimpleNamespace(resource_spec=spec, local_rank=1)) == \
        torch.device("cuda", 1)
    assert chosen == [4, 1]


def test_job_env_carries_the_nproc_override_and_device_order() -> None:
    node = Node(address="127.0.0.1", workers=3)
    env = job_env("j", node, "/spec.yml", None, inherited={}, nproc=3)
    assert env["STRATAGEM_NPROC"] == "3" and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert "STRATAGEM_NPROC" not in job_env("j", node, None, None, inherited={}, nproc=3)
    kept = job_env("j", node, None, None, inherited={"CUDA_DEVICE_ORDER": "FASTEST_FIRST"})
    assert kept["CUDA_DEVICE_ORDER"] == "FASTEST_FIRST"
    assert nproc_override({"STRATAGEM_NPROC": "3"}) == 3
    assert nproc_override({}) is None
    for bad in ("0", "x", "1e23", "99999"):
        with pytest.raises(LaunchError, match="is not a worker count"):
            nproc_override({"STRATAGEM_NPROC": bad})


NODES = """
from types import SimpleNamespace
import torch
import stratagem as sg
from stratagem import env
from stratagem.autodist import AutoDist
from stratagem.resource import ResourceSpec

ad = sg.AutoDist(verbose=False)
torch.cuda.is_available = lambda: True  # nodes of one GPU each: which would it use?
torch.cuda.device_count = lambda: 1
torch.cuda.set_device = lambda index: None
spec = ResourceSpec.of_job(ad.world_size, env.job_nodes(ad.world_size))
gpu = AutoDist._pick_device(SimpleNamespace(resource_spec=spec, local_rank=ad.local_rank))
print(f"rank {ad.rank} nodes {len(ad.resource_spec.nodes)} {ad.device} "
      f"devices {','.join(ad.rank_devices)} with-gpus {gpu} {','.join(spec.replicas)}",
      flush=True)
"""


def test_plain_torchrun_over_two_nodes_without_a_spec(script: Script, tmp_path: Path) -> None:
    """``torchrun --nnodes 2`` with no resource spec (two agents here, each a node of one
    worker): each rank sees a job of two nodes shaped like this machine, tells its node
    by torch elastic's group rank, and on nodes of one GPU would train on ``cuda:0``, not
    fall back to the CPU as "this machine with two workers" did."""
    import subprocess

    from _jobs import job_free_env, torchrun_agent
    from _spawn import free_port

    path = script("nodes.py", NODES)
    port = free_port()
    agents = [subprocess.Popen([*torchrun_agent(2, node, port, "two-nodes"), str(path)],
                               env=job_free_env(), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)  # CPU workers, GPUs faked
              for node in (0, 1)]
    outs = [a.communicate(timeout=100)[0] for a in agents]
    assert [a.returncode for a in agents] == [0, 0], "\n".join(outs)[-4000:]
    lines = sorted(line for out in outs for line in out.splitlines() if line.startswith("rank"))
    assert lines == [f"rank {r} nodes 2 cpu devices node0:CPU:0,node1:CPU:0 with-gpus "
                     f"cuda:0 node0:GPU:0,node1:GPU:0" for r in (0, 1)], "\n".join(outs)

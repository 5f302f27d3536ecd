"""A 2-node job through ``stratagem run --resource-spec`` on the virtual cluster
(tools/vcluster.py: one network namespace per node; needs root)."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from _vcluster import cluster_fixture, launcher_env
from launch_helpers import ALLREDUCE, KILLED, job_processes
from vcluster import VirtualCluster

pytestmark = [pytest.mark.vcluster, pytest.mark.timeout(120)]

cluster = cluster_fixture(2, tag="sgl", subnet="10.81.0.0/24")


def test_two_nodes_through_remote_shell(cluster: VirtualCluster, tmp_path: Path) -> None:
    spec = cluster.write_resource_spec(tmp_path / "spec.yml")
    train = tmp_path / "ar.py"
    train.write_text(ALLREDUCE)
    job = f"vc-{uuid.uuid4().hex[:8]}"
    env = launcher_env(cluster)
    # the launcher runs on the chief (node 0), as it would on a real cluster
    proc = cluster.run(0, [sys.executable, "-m", "stratagem", "run", "--resource-spec",
                           str(spec), "--job-id", job, str(train)],
                       env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       text=True)
    out, err = proc.communicate(timeout=100)
    assert proc.returncode == 0, err
    a0, a1 = cluster.addresses
    assert f"rendezvous c10d at {a0}:" in err
    assert f"node 0  {a0}  chief" in err and "local, rendezvous host" in err
    assert f"node 1  {a1}" in err and "remote shell" in err
    lines = sorted(line for line in out.splitlines() if "sum=" in line)
    # torch elastic orders group ranks by node address: the chief (.1) gets rank 0
    assert lines == [f"[node 0] rank 0/2 sum=3 node={a0} ifname=eth0",
                     f"[node 1] rank 1/2 sum=3 node={a1} ifname=eth0"]
    assert job_processes(job) == []


def test_killed_worker_on_the_remote_node_is_blamed(cluster: VirtualCluster,
                                                    tmp_path: Path) -> None:
    """The failure record crosses the remote shell with its key; forged lines do not."""
    spec = cluster.write_resource_spec(tmp_path / "spec.yml")
    train = tmp_path / "kill.py"
    train.write_text(KILLED)
    job = f"vc-{uuid.uuid4().hex[:8]}"
    proc = cluster.run(0, [sys.executable, "-m", "stratagem", "run", "--resource-spec",
                           str(spec), "--job-id", job, str(train)],
                       env=launcher_env(cluster), cwd=tmp_path, stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True)
    _, err = proc.communicate(timeout=100)
    assert proc.returncode == 1, err
    a1 = cluster.addresses[1]  # rank 1 (ranks follow node addresses) kills itself
    assert f"stratagem: first failure: rank 1 on node 1 ({a1}): killed by SIGKILL" in err
    assert "forged" not in err.split("stratagem: first failure:", 1)[1]
    assert job_processes(job) == []

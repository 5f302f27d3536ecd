"""Dedicated servers through the real launcher: ``stratagem run`` on a 3-node virtual
cluster (two worker nodes, one ``workers: 0`` server node; tools/vcluster.py, needs root)."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
from _vcluster import cluster_fixture, launcher_env
from ps_common import reference
from vcluster import VirtualCluster

pytestmark = [pytest.mark.vcluster, pytest.mark.timeout(180)]

cluster = cluster_fixture(3, tag="sgp", subnet="10.82.0.0/24")


def test_server_node_serves_and_job_matches_single_process(cluster: VirtualCluster,
                                                            tmp_path: Path) -> None:
    a0, a1, a2 = cluster.addresses
    spec = tmp_path / "spec.yml"
    spec.write_text(f"nodes:\n  - {{address: {a0}, chief: true, workers: 1}}\n"
                    f"  - {{address: {a1}, workers: 1}}\n  - {{address: {a2}, workers: 0}}\n")
    out = tmp_path / "out"
    out.mkdir()
    env = launcher_env(cluster, PS_BUILDER="PartitionedPS")
    env.pop("PS_SPEC", None)
    script = Path(__file__).with_name("ps_script.py")
    proc = cluster.run(0, [sys.executable, "-m", "stratagem", "run", "--resource-spec",
                           str(spec), "--job-id", f"vc-{uuid.uuid4().hex[:8]}", str(script),
                           str(out)],
                       env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       text=True)
    stdout, err = proc.communicate(timeout=160)
    assert proc.returncode == 0, err[-4000:]
    assert f"node 2  {a2}" in err and "PS server" in err
    want = reference("adagrad")
    for r in range(2):
        res = torch.load(out / f"worker{r}.pt", weights_only=False)
        assert (res["rank"], res["world"]) == (r, 2)
        assert f"{a2}:PS:0" in res["plan"]
        for k, v in want.items():
            torch.testing.assert_close(res["state"][k], v, rtol=1e-5, atol=1e-9, msg=k)

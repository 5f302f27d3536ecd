"""Pacing on a real shaped network: a 4-node virtual cluster at 1 Gbit/s (tools/vcluster.py,
needs root), PS with one owner on node 0 and a 4 MB dense bucket pushed by three workers.

Sent together, the three pushes overflow the queue in front of node 0 (its host-side
veth's tbf drops packets); paced (runtime/ps/pacing.py), one at a time, they do not. The
test counts those drops in both runs, and checks that pacing changes no value: the owner
sums the same buffers in the same order either way."""

from __future__ import annotations

import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
from _vcluster import cluster_fixture, launcher_env
from vcluster import VirtualCluster

from stratagem import env

pytestmark = [pytest.mark.vcluster, pytest.mark.timeout(240)]

cluster = cluster_fixture(4, tag="sgpc", subnet="10.84.0.0/24", bandwidth="1gbit")
SCRIPT = Path(__file__).with_name("ps_pacing_script.py")


def _drops_into(cluster: VirtualCluster, node: int) -> int:
    """Packets dropped so far by the shaping on the link into ``node`` (host side)."""
    text = subprocess.run(["tc", "-s", "qdisc", "show", "dev", cluster.host_ifname(node)],
                          capture_output=True, text=True, check=True).stdout
    return sum(int(n) for n in re.findall(r"dropped (\d+)", text))


def _train(cluster: VirtualCluster, tmp: Path, pace_bytes: str) -> tuple[list[dict], int]:
    out = tmp / f"pace{pace_bytes}"
    out.mkdir()
    spec = cluster.write_resource_spec(tmp / "spec.yml")
    before = _drops_into(cluster, 0)
    proc = cluster.run(0, [sys.executable, "-m", "stratagem", "run", "-q", "--resource-spec",
                           str(spec), "--job-id", f"pace-{uuid.uuid4().hex[:8]}", str(SCRIPT),
                           str(out)],
                       env=launcher_env(cluster, **{env.PS_PACE_BYTES: pace_bytes}), cwd=tmp,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, err = proc.communicate(timeout=200)
    assert proc.returncode == 0, err[-4000:]
    results = [torch.load(out / f"worker{r}.pt", weights_only=False) for r in range(4)]
    return results, _drops_into(cluster, 0) - before


def test_paced_pushes_overflow_no_queue_and_train_the_same(cluster: VirtualCluster,
                                                           tmp_path: Path) -> None:
    paced, paced_drops = _train(cluster, tmp_path, str(2**20))
    together, together_drops = _train(cluster, tmp_path, "0")
    assert paced[0]["paced"] == 3 * 10, paced[0]["plan"]  # the owner: 3 senders x 10 steps
    assert [r["paced"] for r in paced[1:]] == [0, 0, 0]
    assert all(r["paced"] == 0 for r in together)
    for a, b in zip(paced, together, strict=True):
        for k in a["state"]:
            assert torch.equal(a["state"][k], b["state"][k]), k
    assert together_drops > 0, "three pushes sent together dropped nothing: no incast here"
    assert paced_drops * 10 <= together_drops, (paced_drops, together_drops)

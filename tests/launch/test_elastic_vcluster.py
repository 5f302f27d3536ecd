"""``stratagem run --nnodes 1:2`` on a 2-node virtual cluster: node 1's link goes down in
the middle of training, the job continues on node 0 alone from the checkpoint; the link
comes back, the job grows to two nodes again; it completes with every sample of an
undisturbed run trained exactly once relative to the checkpoints (bench/chaos_job.py's
accounting) and ends where single-process training ends. The strategy is PartitionedPS, so
the owners of the parameter shards are re-sharded from the checkpoint at each new world size
(all-reduce jobs restore onto other sizes in tests/elastic). On a 3-node cluster whose last
node is a dedicated parameter server, that node's link goes down: the job shrinks to its
two worker nodes within seconds. Needs root (tools/vcluster.py)."""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from _vcluster import cluster_fixture, launcher_env
from launch_helpers import job_processes
from vcluster import VirtualCluster

pytestmark = [pytest.mark.vcluster, pytest.mark.slow, pytest.mark.timeout(180)]

BENCH = Path(__file__).resolve().parents[2] / "bench"
cluster = cluster_fixture(2, tag="sgn", subnet="10.91.0.0/24")
cluster3 = cluster_fixture(3, tag="sgv", subnet="10.94.0.0/24")


def _chaos():  # noqa: ANN202 - bench/chaos.py: the step log reader and the accounting
    sys.path.insert(0, str(BENCH))
    try:
        import chaos
    finally:
        sys.path.remove(str(BENCH))
    return chaos


def _steps(logs: Path) -> list[dict]:
    return _chaos().read_steps(logs)


def _wait_for(predicate, proc: subprocess.Popen, timeout: float) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None, "the job ended early"
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@contextlib.contextmanager
def _link_down_after_four_steps(proc: subprocess.Popen, logs: Path, link: str
                                ) -> Iterator[None]:
    """Take ``link`` down once rank 0 trained four steps; on the way out, bring it up and
    kill the job if it still runs."""
    try:
        _wait_for(lambda: sum(r["attempt"] == 0 and r["rank"] == 0
                              for r in _steps(logs)) >= 4, proc, 90)
        subprocess.run(["ip", "link", "set", link, "down"], check=True)
        yield
    finally:
        subprocess.run(["ip", "link", "set", link, "up"], check=False)
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def _check_every_sample_once(steps: list[dict], logs: Path) -> None:
    """No sample lost or trained twice relative to the checkpoints, and the final parameters
    are single-process training's."""
    chaos = _chaos()
    result = chaos.sample_accounting(steps)
    assert (result["samples_lost"], result["samples_repeated"]) == (0, 0), result
    assert result["batches_match_reference"] and result["replayed_steps_differ"] == 0
    got = torch.load(logs / "final.pt", map_location="cpu", weights_only=True)["model"]
    for name, value in chaos.chaos_job.reference()["model"].items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6)


def _launch(cluster: VirtualCluster, tmp: Path, nnodes: str, *options: str,
            server_last: bool = False) -> tuple[subprocess.Popen, str]:
    spec = cluster.write_resource_spec(tmp / "spec.yml")
    if server_last:  # the last node is a dedicated parameter server
        text = spec.read_text()
        cut = text.rindex("workers: 1")
        spec.write_text(text[:cut] + "workers: 0" + text[cut + len("workers: 1"):])
    logs = tmp / "logs"
    logs.mkdir(exist_ok=True)
    job = f"el-{uuid.uuid4().hex[:8]}"
    env = launcher_env(cluster, STRATAGEM_PEER_TIMEOUT_S="3", OMP_NUM_THREADS="1")
    for var in ("STRATAGEM_CHECKPOINT_DIR", "ADAPTDL_CHECKPOINT_PATH"):
        env.pop(var, None)
    proc = cluster.run(0, [sys.executable, "-m", "stratagem", "run", "--resource-spec",
                           str(spec), "--nnodes", nnodes, "--node-probe-seconds", "1",
                           "--job-id", job, "--checkpoint-dir", str(tmp / "ckpt"),
                           "--checkpoint-steps", "3", "--restart-backoff", "0.2",
                           "--run-dir", str(tmp / "run"), *options, str(BENCH / "chaos_job.py"),
                           "--out", str(logs), "--step-sleep", "0.12"],
                       env=env, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True)
    return proc, job


def test_lost_link_shrinks_the_job_and_its_return_grows_it(cluster: VirtualCluster,
                                                           tmp_path: Path) -> None:
    proc, job = _launch(cluster, tmp_path, "1:2", "--strategy", "PartitionedPS")
    logs = tmp_path / "logs"
    link = cluster.host_ifname(1)
    with _link_down_after_four_steps(proc, logs, link):
        down = time.time()
        _wait_for(lambda: sum(r["attempt"] == 1 and r["rank"] == 0
                              for r in _steps(logs)) >= 2, proc, 90)
        subprocess.run(["ip", "link", "set", link, "up"], check=True)
        up = time.time()
        out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out[-4000:]
    a1 = cluster.addresses[1]
    assert f"shrink 1: node {a1} lost" in out and "restarting on 1 of 2 nodes" in out, out
    assert f"grow 1: node {a1} reachable" in out, out
    assert "(0 restarts, 1 shrink, 1 grow)" in out, out
    steps = _steps(logs)
    # world sizes per attempt: 2 nodes, the survivor, 2 again
    sizes = {a: len({r["rank"] for r in steps if r["attempt"] == a}) for a in (0, 1, 2)}
    assert sizes == {0: 2, 1: 1, 2: 2}, sizes
    _check_every_sample_once(steps, logs)
    first = {a: min(r["time"] for r in steps if r["attempt"] == a) for a in (1, 2)}
    print(f"link down -> training on 1 node: {first[1] - down:.1f} s; "
          f"link up -> training on 2 nodes: {first[2] - up:.1f} s")
    assert job_processes(job) == []


def test_lost_server_node_is_detected_in_seconds_and_the_workers_go_on(
        cluster3: VirtualCluster, tmp_path: Path) -> None:
    """A dedicated parameter server's node loses its link: the workers' heartbeats (over
    every process of the job, servers included) name it within STRATAGEM_PEER_TIMEOUT_S
    instead of waiting out the collective timeout, the job shrinks to the two worker nodes,
    their owners are re-sharded from the checkpoint, and it ends where single-process
    training ends with every sample trained exactly once."""
    proc, job = _launch(cluster3, tmp_path, "2:3", "--strategy", "PartitionedPS",
                        server_last=True)
    logs = tmp_path / "logs"
    link = cluster3.host_ifname(2)
    with _link_down_after_four_steps(proc, logs, link):
        out, _ = proc.communicate(timeout=150)
    assert proc.returncode == 0, out[-4000:]
    server = cluster3.addresses[2]
    assert "PS server    remote shell" in out, out  # the spec's last node served
    silent = re.search(r"PeerLost: rank 2 stopped answering: no heartbeat for (\d+) s", out)
    assert silent and int(silent.group(1)) < 30, out  # seconds, not the 300 s timeout
    assert f"shrink 1: node {server} lost" in out and "restarting on 2 of 3 nodes" in out, out
    steps = _steps(logs)
    assert {a: len({r["rank"] for r in steps if r["attempt"] == a}) for a in (0, 1)} == \
        {0: 2, 1: 2}
    _check_every_sample_once(steps, logs)
    assert job_processes(job) == []


def test_fewer_reachable_nodes_than_min_is_a_clear_error(cluster: VirtualCluster,
                                                         tmp_path: Path) -> None:
    subprocess.run(["ip", "link", "set", cluster.host_ifname(1), "down"], check=True)
    proc, job = _launch(cluster, tmp_path, "2")
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode != 0
    assert (f"only 1 of the 2 nodes of {tmp_path / 'spec.yml'} are reachable, --nnodes "
            f"needs at least 2; unreachable: {cluster.addresses[1]}") in out, out
    assert "lower MIN" in out and "Traceback" not in out
    assert job_processes(job) == []

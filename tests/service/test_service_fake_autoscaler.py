"""Autoscaling against Ray's fake multi-node autoscaler: a job that needs accelerators on a
cluster with none makes the scheduler request nodes; the autoscaler starts them (fake nodes:
raylets on this machine) and the job is placed on them; withdrawing the request lets the
idle nodes go.

The head is started here as ``ray.cluster_utils.AutoscalingCluster`` would, but without its
``ray stop --force`` (which would stop every Ray on this shared machine) and with our own
config (this Ray wheel ships without the provider's example.yaml); only the processes
started here are stopped afterwards.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from _ray_service import FAKE_GPU, JOB_SCRIPT

from stratagem.service import store as st

DRIVER = Path(__file__).with_name("_autoscale_driver.py")

pytestmark = pytest.mark.slow
NODE_TYPE = {"resources": {"CPU": 1, FAKE_GPU: 2, "object_store_memory": 80 * 1024 * 1024},
             "node_config": {}, "min_workers": 0, "max_workers": 2}


def descendants(pid: int) -> list[int]:
    """``pid``'s descendant processes (from /proc), children first."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def node_ip() -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:  # no packet is sent
        s.connect(("192.0.2.1", 9))
        return s.getsockname()[0]


@pytest.fixture(scope="module")
def autoscaling_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    pytest.importorskip("ray", reason="Ray is an optional extra")
    d = tmp_path_factory.mktemp("fake-autoscaler")
    port = free_port()
    config = {
        "cluster_name": "stratagem-test", "max_workers": 2, "upscaling_speed": 2.0,
        "idle_timeout_minutes": 0.05, "head_node_type": "ray.head.default",
        "provider": {"type": "fake_multinode", "use_node_id_as_ip": True,
                     "disable_node_updaters": True, "disable_launch_config_check": True,
                     "gcs_address": f"{node_ip()}:{port}"},
        "available_node_types": {"ray.head.default": {"resources": {"CPU": 1},
                                                      "node_config": {}, "max_workers": 0},
                                 "gpu_node": NODE_TYPE},
        "auth": {}, "docker": {}, "file_mounts": {}, "cluster_synced_files": [],
        "initialization_commands": [], "setup_commands": [], "head_setup_commands": [],
        "worker_setup_commands": [], "head_start_ray_commands": [],
        "worker_start_ray_commands": [], "file_mounts_sync_continuously": False,
        "rsync_exclude": [], "rsync_filter": []}
    (d / "autoscaler.json").write_text(json.dumps(config))
    ray_bin = str(Path(sys.executable).with_name("ray"))
    # token authentication on both ends (head and this driver), as 'stratagem cluster up'
    made = subprocess.run([ray_bin, "get-auth-token", "--generate"], capture_output=True,
                          stdin=subprocess.DEVNULL, timeout=120, check=False)
    env = {**os.environ, "RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1",
           "RAY_USAGE_STATS_ENABLED": "0", "PYTHONPATH": os.pathsep.join(sys.path)}
    if made.returncode == 0 and "RAY_AUTH_MODE" not in env:
        env["RAY_AUTH_MODE"] = "token"
    pointer = Path(tempfile.gettempdir()) / "ray" / "ray_current_cluster"
    saved = pointer.read_text() if pointer.is_file() else None
    log = (d / "head.log").open("wb")
    head = subprocess.Popen(
        [ray_bin, "start", "--head", "--block",
         f"--port={port}", "--num-cpus=1", "--include-dashboard=false",
         "--disable-usage-stats", f"--autoscaling-config={d / 'autoscaler.json'}"],
        env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while "Ray runtime started" not in (d / "head.log").read_text(errors="replace"):
            assert head.poll() is None and time.monotonic() < deadline, \
                (d / "head.log").read_text()
            time.sleep(0.3)
        yield f"{node_ip()}:{port}", env
    finally:
        started = descendants(head.pid)
        os.killpg(head.pid, signal.SIGTERM)
        try:  # `ray start --block` can take 30 s to stop its processes on SIGTERM
            head.wait(timeout=5)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait()
        time.sleep(1)
        for pid in started:  # fake nodes that left the head's process group
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if saved is None:
            pointer.unlink(missing_ok=True)
        else:
            pointer.write_text(saved)


def test_the_scheduler_asks_the_autoscaler_for_nodes_and_places_the_job_on_them(
        autoscaling_cluster, tmp_path):
    address, env = autoscaling_cluster
    # the driver runs in its own process: Ray fixes its authentication mode per process
    done = subprocess.run([sys.executable, str(DRIVER), address, str(tmp_path), FAKE_GPU,
                           str(JOB_SCRIPT)], env=env, capture_output=True, text=True,
                          timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["before"] == 0  # no node with accelerators at first
    assert seen["target"] == 2  # 4 replicas of 1 accelerator on 2-accelerator nodes
    assert seen["up"] == [2.0, 2.0]  # two fake nodes came up, with 2 accelerators each
    assert seen["job_state"] == st.RUNNING and seen["job_on_new_nodes"]
    assert seen["after_withdraw"] == 0  # the idle nodes were let go

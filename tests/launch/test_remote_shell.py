"""Multi-node planning: ssh commands from a spec, remote-shell templates, rendezvous host."""

from __future__ import annotations

import shlex
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from stratagem.errors import LaunchError
from stratagem.launch import JobOptions, multinode, plan_job
from stratagem.launch.remote_shell import (
    activate_command,
    remote_command,
    ssh_argv,
    template_argv,
)
from stratagem.resource import Node, SSHConfig

SPEC = """
nodes:
  - address: 10.0.0.1
    chief: true
    workers: 2
    cpus: [0, 1, 2, 3]
  - address: 10.0.0.2
    workers: 1
    ssh_config: gpu
  - address: 10.0.0.3
    workers: 0
ssh:
  gpu:
    username: alice
    port: 2222
    key_file: ~/.ssh/id_sg
    python_venv: source /opt/venv/bin/activate
    shared_envs:
      LD_LIBRARY_PATH: /opt/lib
"""


@pytest.fixture
def plan_for(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[..., object]:
    """Plan a job for SPEC, pretending this machine is node 10.0.0.1 (no real ssh)."""
    spec = tmp_path / "spec.yml"
    spec.write_text(SPEC)
    train = tmp_path / "train.py"
    train.write_text("")
    monkeypatch.setattr(multinode, "is_local_address", lambda a: a == "10.0.0.1")
    monkeypatch.setattr(multinode, "free_port", lambda host: 41000)
    monkeypatch.setattr("stratagem.launch.remote_shell.shutil.which", lambda n: "/usr/bin/ssh")
    monkeypatch.delenv("STRATAGEM_REMOTE_SHELL", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.chdir(tmp_path)

    def plan(**kw: object):  # type: ignore[no-untyped-def]
        opts = JobOptions(script="train.py", script_args=("--lr", "0.1"),
                          resource_spec=str(spec), job_id="job7", **kw)  # type: ignore[arg-type]
        return plan_job(opts)

    return plan


def _opt(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_plan_local_chief_and_ssh_worker(plan_for: Callable[..., object],
                                         tmp_path: Path) -> None:
    plan = plan_for()
    assert plan.endpoint == "10.0.0.1:41000"
    chief, remote, server = plan.agents
    assert [a.index for a in plan.agents] == [0, 1, 2] and plan.skipped == ()
    # node 2 (workers: 0) runs one dedicated parameter-server process
    exports, agent = server.argv[-1].split(" && exec ")
    assert "STRATAGEM_ROLE=server" in exports and "STRATAGEM_NODE_ADDRESS=10.0.0.3" in exports
    assert _opt(shlex.split(agent), "--nproc-per-node") == "1"
    assert "STRATAGEM_ROLE" not in chief.env
    # the chief: a local agent hosting the rendezvous
    assert chief.via == "local" and chief.is_host
    argv = list(chief.argv)
    assert argv[:3] == [sys.executable, "-m", "stratagem.launch.agent"]
    assert _opt(argv, "--nnodes") == "3" and _opt(argv, "--nproc-per-node") == "2"
    assert _opt(argv, "--rdzv-conf") == "is_host=1" and _opt(argv, "--local-addr") == "10.0.0.1"
    assert _opt(argv, "--rdzv-endpoint") == "10.0.0.1:41000" and _opt(argv, "--rdzv-id") == "job7"
    assert chief.env["STRATAGEM_NODE_ADDRESS"] == "10.0.0.1"
    assert chief.env["STRATAGEM_JOB_ID"] == "job7"
    assert chief.env["STRATAGEM_RESOURCE_SPEC"] == str(tmp_path / "spec.yml")
    assert chief.env["OMP_NUM_THREADS"] == "2"  # 4 cpus, 2 workers
    # node 1: ssh with the group's user, port and key, then one remote shell line
    assert remote.via == "ssh" and not remote.is_host
    ssh = list(remote.argv)
    assert ssh[:8] == ["ssh", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=accept-new",
                       "-p", "2222", "-i"]
    assert ssh[8].endswith("/.ssh/id_sg") and not ssh[8].startswith("~")
    assert ssh[9:11] == ["--", "alice@10.0.0.2"] and len(ssh) == 12  # -- ends options
    line = ssh[11]
    assert line.startswith(f"cd {shlex.quote(str(tmp_path))} && . /opt/venv/bin/activate && ")
    exports, agent = line.split(" && exec ")
    assert "STRATAGEM_NODE_ADDRESS=10.0.0.2" in exports and "STRATAGEM_JOB_ID=job7" in exports
    assert "LD_LIBRARY_PATH=/opt/lib" in exports and "PYTHONUNBUFFERED=1" in exports
    words = shlex.split(agent)
    assert words[:4] == ["python", "-m", "stratagem.launch.agent", "--watch-stdin"]
    assert _opt(words, "--rdzv-conf") == "is_host=0" and _opt(words, "--local-addr") == "10.0.0.2"
    assert _opt(words, "--nproc-per-node") == "1"
    assert words[-6:] == ["-m", "--", "stratagem.launch.worker", "train.py", "--lr", "0.1"]


def test_plan_describe_names_every_node(plan_for: Callable[..., object]) -> None:
    text = plan_for().describe()
    assert "job job7: 3 workers on 3 nodes" in text and "10.0.0.1:41000" in text
    assert "node 0  10.0.0.1  chief" in text and "rendezvous host" in text
    assert "node 1  10.0.0.2" in text and "ssh" in text
    assert "node 2  10.0.0.3" in text and "PS server" in text


def test_remote_shell_template_and_strategy(plan_for: Callable[..., object],
                                            tmp_path: Path) -> None:
    plan = plan_for(remote_shell="python /x/vcluster.py exec {address} --",
                    strategy="AllReduce", rdzv_port=5000)
    assert plan.endpoint == "10.0.0.1:5000"
    remote = plan.agents[1]
    assert remote.via == "remote shell"
    assert list(remote.argv[:7]) == ["python", "/x/vcluster.py", "exec", "10.0.0.2", "--",
                                     "/bin/sh", "-c"]
    assert "STRATAGEM_STRATEGY=AllReduce" in remote.argv[7]
    assert plan.agents[0].env["STRATAGEM_STRATEGY"] == "AllReduce"


def test_chief_without_workers_hands_rendezvous_to_first_worker_node(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = tmp_path / "spec.yml"
    spec.write_text("nodes:\n  - {address: 10.0.0.1, chief: true, workers: 0}\n"
                    "  - {address: 10.0.0.2, workers: 1}\n  - {address: 10.0.0.3, workers: 1}\n")
    (tmp_path / "t.py").write_text("")
    monkeypatch.setattr(multinode, "is_local_address", lambda a: False)
    plan = plan_job(JobOptions(script=str(tmp_path / "t.py"), resource_spec=str(spec),
                               remote_shell="ssh {address}"))
    assert plan.endpoint == "10.0.0.2:29400"
    assert [a.is_host for a in plan.agents] == [False, True, False]
    assert [a.node.address for a in plan.agents] == ["10.0.0.1", "10.0.0.2", "10.0.0.3"]
    # a template starting with ssh gets the remote line as one argument
    assert plan.agents[1].argv[:2] == ("ssh", "10.0.0.2") and len(plan.agents[1].argv) == 3


@pytest.mark.parametrize(("venv", "line"), [
    ("source /v/bin/activate", ". /v/bin/activate"),
    ("/v", ". /v/bin/activate"),
    ("/v/bin/activate", ". /v/bin/activate"),
    ("~/venvs/sg", '. "$HOME"/venvs/sg/bin/activate'),
    ("conda activate sg", "conda activate sg"),
])
def test_activate_command(venv: str, line: str) -> None:
    assert activate_command(venv) == line


def test_remote_command_quotes() -> None:
    line = remote_command("/my dir", {"A": "x y"}, ["python", "-c", "print('hi')"])
    assert line == "cd '/my dir' && export 'A=x y' && exec python -c 'print('\"'\"'hi'\"'\"')'"
    assert template_argv("ip netns exec ns-{address}", "n1", "true") == \
        ["ip", "netns", "exec", "ns-n1", "/bin/sh", "-c", "true"]


@pytest.mark.parametrize("address", ["-V", "-oProxyCommand=sh -c id", "a;id", " 10.0.0.1"])
def test_addresses_that_are_not_hosts_never_reach_a_command_line(address: str) -> None:
    with pytest.raises(LaunchError, match="is not a host name or IP address"):
        template_argv("ssh {address}", address, "true")
    with pytest.raises(LaunchError, match="is not a host name or IP address"):
        ssh_argv(Node(address=address), SSHConfig(), "true")

"""Interface lookup for GLOO_SOCKET_IFNAME, the agent-side env set-up, worker error files."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from stratagem.launch import agent, netif, worker
from stratagem.launch.env import apply_node_env


def test_loopback_interface() -> None:
    lo = netif.interface_for_address("127.0.0.1")
    assert lo is not None
    assert netif.local_ipv4_addresses()["127.0.0.1"] == lo
    assert netif.interface_for_address("localhost") == lo
    assert netif.interface_for_address("127.0.0.42") == lo  # all of 127/8 is loopback
    assert netif.is_local_address("127.0.0.1")


def test_foreign_address_has_no_interface() -> None:
    assert netif.interface_for_address("192.0.2.123") is None  # TEST-NET-1, never ours
    assert netif.interface_for_address("no-such-host.invalid") is None
    assert not netif.is_local_address("192.0.2.123")


def test_apply_node_env_sets_gloo_and_nccl_ifname_once(
        capsys: pytest.CaptureFixture[str]) -> None:
    lo = netif.interface_for_address("127.0.0.1")
    env = {"STRATAGEM_NODE_ADDRESS": "127.0.0.1"}
    assert apply_node_env(env) == lo
    assert env["GLOO_SOCKET_IFNAME"] == env["NCCL_SOCKET_IFNAME"] == lo
    kept = {"STRATAGEM_NODE_ADDRESS": "127.0.0.1", "GLOO_SOCKET_IFNAME": "eth9"}
    assert apply_node_env(kept) == lo  # each is set only where the user has not
    assert kept["GLOO_SOCKET_IFNAME"] == "eth9" and kept["NCCL_SOCKET_IFNAME"] == lo
    both = {"STRATAGEM_NODE_ADDRESS": "127.0.0.1", "GLOO_SOCKET_IFNAME": "eth9",
            "NCCL_SOCKET_IFNAME": "ib0"}
    assert apply_node_env(both) is None and both["NCCL_SOCKET_IFNAME"] == "ib0"
    assert apply_node_env({}) is None
    unknown = {"STRATAGEM_NODE_ADDRESS": "192.0.2.123"}
    assert apply_node_env(unknown) is None and "GLOO_SOCKET_IFNAME" not in unknown
    assert "NCCL_SOCKET_IFNAME" not in unknown
    assert "no local interface has address 192.0.2.123" in capsys.readouterr().err


def test_worker_writes_error_file_and_agent_reads_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    train = tmp_path / "train.py"
    train.write_text("import sys\nassert sys.argv[1:] == ['--x']\nraise ValueError('bad lr')\n")
    err_file = tmp_path / "logs" / "run" / "attempt_0" / "1" / "error.json"
    err_file.parent.mkdir(parents=True)
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(err_file))
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)
    with pytest.raises(SystemExit) as exc:
        worker.main([str(train), "--x"])
    assert exc.value.code == 1
    # The traceback is in the error file only: the launcher prints it, once (issue 16).
    assert "bad lr" not in capsys.readouterr().err
    data = json.loads(err_file.read_text())
    callstack = data["message"]["extraInfo"]["py_callstack"]
    assert "ValueError: bad lr" in callstack and "runpy" not in callstack  # user frames only
    assert data["message"]["message"] == "ValueError: bad lr"
    assert int(data["message"]["extraInfo"]["timestamp"]) > 0  # torch elastic's format
    (tmp_path / "agent-error.json").write_text(err_file.read_text())  # torchrun's copy
    records = agent.read_failures(str(tmp_path))
    assert len(records) == 1 and records[0]["rank"] == "3"
    assert records[0]["message"] == "ValueError: bad lr" and "train.py" in records[0]["traceback"]

"""Tests for tools/vcluster.py: naming, shaping config, teardown, reachability, CLI exec/run.

Tests that build namespaces are marked ``vcluster`` and skip (with the reason) where the
machine cannot host one. They inspect ``ip``/``tc`` state, never wall-clock rates.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import vcluster
from vcluster import VirtualCluster, VirtualClusterUnavailable

PREFIX = f"sgt{os.getpid() % 100000}"  # unique per run: parallel sessions do not collide
SUBNET = "10.79.0.0/24"
TOOL = [sys.executable, str(Path(vcluster.__file__).resolve())]
vc_mark = pytest.mark.vcluster

# A tiny TCP server/client run inside the nodes: the server accepts once and answers "pong";
# the client tries each host:port and reports "ok" or the error name.
SERVER = """
import socket, sys
s = socket.socket(); s.bind(("0.0.0.0", 0)); s.listen(4)
print(s.getsockname()[1], flush=True)
s.settimeout(20)
c, _ = s.accept(); c.sendall(b"pong"); c.close()
"""
CLIENT = """
import json, socket, sys
out = {}
for target in sys.argv[1:]:
    host, port = target.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=3) as c:
            out[target] = c.recv(4).decode()
    except OSError as e:
        out[target] = type(e).__name__
print(json.dumps(out))
"""


def cluster(n: int = 2, **kw: object) -> VirtualCluster:
    kw.setdefault("delay", None)  # no "delay not applied" warning on kernels without netem
    return VirtualCluster(n, prefix=PREFIX, subnet=SUBNET, **kw)  # type: ignore[arg-type]


def live_names() -> set[str]:
    """Every namespace and interface carrying the test prefix, read straight from the kernel."""
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    names = {line.split()[0] for line in ns.splitlines() if line.strip()}
    names |= {line.split(":")[1].strip().split("@")[0] for line in links.splitlines()}
    return {n for n in names if n.startswith(f"{PREFIX}-")}


def tc_show(argv: list[str]) -> str:
    return subprocess.run(argv, capture_output=True, text=True, check=True).stdout


@pytest.fixture(autouse=True)
def _no_leftovers():
    yield
    if vcluster.VirtualCluster.available()[0]:  # else nothing was built (and root may lack `ip`)
        vcluster.cleanup(PREFIX)


# -- no root needed ---------------------------------------------------------------------------
def test_parse_units() -> None:
    assert vcluster.parse_rate("1gbit") == 1e9
    assert vcluster.parse_rate("250Mbit") == 250e6
    assert vcluster.parse_rate("10mbps") == 80e6  # tc: bps = bytes/s
    assert vcluster.parse_delay("0.1ms") == pytest.approx(1e-4)
    assert vcluster.parse_delay("250us") == pytest.approx(2.5e-4)
    assert vcluster.parse_cpus("0,1:2-3") == [[0, 1], [2, 3]]
    for bad in ("fast", "1gb", "-1gbit"):
        with pytest.raises(ValueError):
            vcluster.parse_rate(bad)
    with pytest.raises(ValueError):
        vcluster.parse_delay("5")


def test_names_and_exec_argv() -> None:
    vc = VirtualCluster(3, cpus=[[0], [0], [0]])
    assert vc.addresses == ["10.77.0.1", "10.77.0.2", "10.77.0.3"]
    assert vc.index("10.77.0.2") == 1 and vc.index("2") == 2
    assert vc.ifname(1) == "eth0" and vc.host_ifname(1) == "sgvc-h1"
    assert vc.exec_argv("10.77.0.2") == [
        "ip", "netns", "exec", "sgvc-1", "taskset", "-c", "0",
        "env", "GLOO_SOCKET_IFNAME=eth0", "TP_SOCKET_IFNAME=eth0"]
    with pytest.raises(KeyError):
        vc.index("10.77.0.9")
    with pytest.raises(ValueError):
        VirtualCluster(2, prefix="bad-prefix")


def test_resource_spec(tmp_path: Path) -> None:
    path = VirtualCluster(2, bandwidth="2.5gbit").write_resource_spec(tmp_path / "s.yml", 2)
    text = path.read_text()
    assert "address: 10.77.0.1" in text and "chief: true" in text
    assert text.count("network_bandwidth: 2.5") == 2 and text.count("workers: 2") == 2
    resource = pytest.importorskip("stratagem.resource")
    spec = resource.ResourceSpec.from_file(path)
    assert [n.address for n in spec.nodes] == ["10.77.0.1", "10.77.0.2"]
    assert spec.chief.address == "10.77.0.1" and spec.num_workers == 4


def test_unavailable_without_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vcluster, "_CAPS", {})
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    ok, reason = VirtualCluster.available()
    assert not ok and "root" in reason and "sudo" in reason
    with pytest.raises(VirtualClusterUnavailable, match="root"):
        cluster().up()


# -- needs namespaces -------------------------------------------------------------------------
@vc_mark
def test_up_down_leaves_nothing(need_vcluster: None) -> None:
    with cluster(3) as vc:
        expected = {f"{PREFIX}-{i}" for i in range(3)} | {f"{PREFIX}-h{i}" for i in range(3)}
        assert live_names() == expected | {f"{PREFIX}-br"}
        assert json.loads((vcluster.STATE_DIR / f"{PREFIX}.json").read_text())["addresses"] \
            == vc.addresses
    assert live_names() == set()
    vc.down()  # idempotent
    assert not (vcluster.STATE_DIR / f"{PREFIX}.json").exists()


@vc_mark
def test_teardown_on_exception(need_vcluster: None) -> None:
    with pytest.raises(RuntimeError, match="boom"), cluster() as vc:
        sleeper = vc.run(1, ["sleep", "60"])
        raise RuntimeError("boom")
    assert live_names() == set()
    assert sleeper.poll() is not None  # processes started in the nodes are ended too


@vc_mark
def test_nodes_reach_each_other_not_loopback(need_vcluster: None) -> None:
    with cluster(bandwidth=None, delay=None) as vc:
        server = vc.run(1, [sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True)
        port = server.stdout.readline().strip()
        targets = [f"127.0.0.1:{port}", f"{vc.addresses[1]}:{port}"]
        out = subprocess.run(vc.exec_argv(0) + [sys.executable, "-c", CLIENT, *targets],
                             capture_output=True, text=True, timeout=20, check=True).stdout
        result = json.loads(out)
        assert result[f"{vc.addresses[1]}:{port}"] == "pong"
        assert result[f"127.0.0.1:{port}"] == "ConnectionRefusedError"  # node 1's loopback
        assert server.wait(timeout=10) == 0


@vc_mark
def test_qdiscs_carry_rate_and_delay(need_vcluster: None) -> None:
    delay_ok, _ = VirtualCluster.delay_supported()
    with pytest.warns(RuntimeWarning) if not delay_ok else contextlib.nullcontext(), \
            cluster(bandwidth="500mbit", delay="2ms") as vc:
        assert vc.delay_applied == delay_ok
        for i in range(2):
            for text in (tc_show(["tc", "-n", vc.namespace(i), "qdisc", "show", "dev", "eth0"]),
                         tc_show(["tc", "qdisc", "show", "dev", vc.host_ifname(i)])):
                assert "qdisc tbf" in text and "rate 500Mbit" in text
                assert ("netem" in text and "delay 2ms" in text) == delay_ok


@vc_mark
def test_unshaped_has_no_qdisc(need_vcluster: None) -> None:
    with cluster(bandwidth=None, delay=None) as vc:
        text = tc_show(["tc", "qdisc", "show", "dev", vc.host_ifname(0)])
        assert "tbf" not in text and "netem" not in text


@vc_mark
def test_up_cleans_stale_leftovers(need_vcluster: None) -> None:
    crashed = cluster(3)
    crashed.up()  # never torn down: a crashed run
    subprocess.run(["ip", "netns", "add", f"{PREFIX}-7"], check=True)
    bystander = f"{PREFIX}x-1"  # another prefix: must survive
    subprocess.run(["ip", "netns", "add", bystander], check=True)
    try:
        with cluster(2):
            assert live_names() == {f"{PREFIX}-0", f"{PREFIX}-1", f"{PREFIX}-h0",
                                    f"{PREFIX}-h1", f"{PREFIX}-br"}
        assert bystander in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                           text=True).stdout
    finally:
        subprocess.run(["ip", "netns", "del", bystander], check=False)


@vc_mark
def test_up_refuses_a_prefix_a_live_process_holds(need_vcluster: None) -> None:
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    held = cluster(2)
    try:
        held.up()
        state = vcluster.STATE_DIR / f"{PREFIX}.json"
        data = json.loads(state.read_text())
        state.write_text(json.dumps({**data, "owner_pid": holder.pid}))
        with pytest.raises(vcluster.VirtualClusterError, match="in use by process"):
            cluster(2).up()
        assert f"{PREFIX}-1" in live_names()  # the holder's cluster is intact
        holder.kill()
        holder.wait()
        with cluster(2):  # a dead holder's cluster is a leftover: cleaned and rebuilt
            assert f"{PREFIX}-1" in live_names()
    finally:
        holder.kill()
        held.down()


@vc_mark
def test_cli_exec_by_address(need_vcluster: None) -> None:
    with cluster() as vc:
        addr = vc.addresses[1]
        exec_ = TOOL + ["exec", "--prefix", PREFIX]
        out = subprocess.run(exec_ + [addr, "--", "sh", "-c",
                                      "ip -4 -o addr show dev eth0; cat; exit 3"],
                             input="from-stdin", capture_output=True, text=True, timeout=20)
        assert out.returncode == 3
        assert addr in out.stdout and "from-stdin" in out.stdout
        missing = subprocess.run(exec_ + ["10.79.0.99", "--", "true"], capture_output=True,
                                 text=True, timeout=20)
        assert missing.returncode == vcluster.NO_NODE_EXIT and "no live" in missing.stderr


@vc_mark
def test_cli_run_sets_spec_and_remote_shell(need_vcluster: None) -> None:
    # What the launcher does: fill {address} in the remote shell and append the command.
    script = """
import os, shlex, subprocess, sys
print(open(os.environ["STRATAGEM_VCLUSTER_SPEC"]).read())
shell = shlex.split(os.environ["STRATAGEM_REMOTE_SHELL"].format(address="10.79.0.2"))
subprocess.run(shell + ["ip", "-4", "-o", "addr", "show", "dev", "eth0"], check=True)
sys.exit(5)
"""
    out = subprocess.run(TOOL + ["run", "--nodes", "2", "--prefix", PREFIX, "--subnet", SUBNET,
                                 "--", sys.executable, "-c", script],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 5, out.stderr
    assert "chief: true" in out.stdout and "inet 10.79.0.2/24" in out.stdout
    assert live_names() == set()


@vc_mark
def test_cli_run_tears_down_on_sigterm(need_vcluster: None) -> None:
    proc = subprocess.Popen(TOOL + ["run", "--nodes", "2", "--prefix", PREFIX, "--subnet",
                                    SUBNET, "--", "sleep", "60"],
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 20
    while f"{PREFIX}-br" not in live_names() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)  # let it start the command
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=20) == 128 + signal.SIGTERM
    assert live_names() == set()


LIBRARY_USER = """
import sys, time
sys.path.insert(0, {tools!r})
from vcluster import VirtualCluster
with VirtualCluster(2, delay=None, prefix={prefix!r}, subnet={subnet!r}) as vc:
    vc.run(1, ["sleep", "60"])
    print("up", flush=True)
    time.sleep(60)
"""


@vc_mark
def test_with_block_tears_down_on_sigterm(need_vcluster: None) -> None:
    """A script using the cluster as a context manager (the benchmarks do), killed with
    SIGTERM (``kill``, ``timeout``), leaves no namespace behind."""
    script = LIBRARY_USER.format(tools=str(Path(vcluster.__file__).resolve().parent),
                                 prefix=PREFIX, subnet=SUBNET)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "up"
        assert f"{PREFIX}-br" in live_names()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
    assert live_names() == set()


def test_with_block_restores_the_sigterm_handler(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside the block SIGTERM raises SystemExit; outside it has its old action again,
    after the block and when building fails. (No namespaces: up and down are stubbed.)"""
    seen = []
    monkeypatch.setattr(VirtualCluster, "down", lambda self: None)
    old = signal.signal(signal.SIGTERM, signal.SIG_DFL)  # as in a plain script
    try:
        monkeypatch.setattr(VirtualCluster, "up", lambda self: self)
        with cluster():
            seen.append(signal.getsignal(signal.SIGTERM))
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL

        def fail(self: VirtualCluster) -> VirtualCluster:
            seen.append(signal.getsignal(signal.SIGTERM))
            raise VirtualClusterUnavailable("no namespaces here")

        monkeypatch.setattr(VirtualCluster, "up", fail)
        with pytest.raises(VirtualClusterUnavailable), cluster():
            pass
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        # a handler the caller installed is left alone
        def mine(signum: int, frame: object) -> None:
            pass

        signal.signal(signal.SIGTERM, mine)
        monkeypatch.setattr(VirtualCluster, "up", lambda self: self)
        with cluster():
            seen.append(signal.getsignal(signal.SIGTERM))
    finally:
        signal.signal(signal.SIGTERM, old)
    assert seen[:2] == [vcluster._exit_on_sigterm] * 2
    assert seen[2] is mine

"""The default launch path, ssh, against a real OpenSSH server: a 2-node virtual cluster
(tools/vcluster.py; needs root) whose second node runs ``sshd`` with key authentication,
reached through the resource spec's ssh group (no ``--remote-shell``).

Skips, with the reason, without root, ``ip`` or OpenSSH's server (Debian:
``apt-get install openssh-server``; .ci/run installs it where it can)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from _vcluster import cluster_fixture
from vcluster import VirtualCluster

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "examples" / "train_mlp.py"
PORT = 2222
SSHD = shutil.which("sshd") or "/usr/sbin/sshd"

pytestmark = [pytest.mark.vcluster, pytest.mark.slow, pytest.mark.timeout(300)]

cluster = cluster_fixture(2, tag="sgssh", subnet="10.95.0.0/24")


@pytest.fixture
def openssh(need_vcluster: None) -> tuple[str, str]:
    """Paths of sshd and ssh-keygen, or a skip saying how to get them."""
    keygen = shutil.which("ssh-keygen")
    if not os.access(SSHD, os.X_OK) or keygen is None or shutil.which("ssh") is None:
        pytest.skip("OpenSSH server or client not installed (Debian: apt-get install "
                    "openssh-server)")
    return SSHD, keygen


def _keys(tmp: Path, keygen: str) -> tuple[Path, Path]:
    """A host key and a client key pair, made here; the client's public key authorized."""
    host, client = tmp / "host_ed25519", tmp / "client_ed25519"
    for key in (host, client):
        subprocess.run([keygen, "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True,
                       timeout=30)
    auth = tmp / "authorized_keys"
    auth.write_text(Path(f"{client}.pub").read_text())
    auth.chmod(0o600)
    return host, client


def _start_sshd(cluster: VirtualCluster, node: int, tmp: Path, sshd: str, host_key: Path
                ) -> subprocess.Popen[bytes]:
    """sshd in ``node``'s namespace on PORT: public keys from tmp only, no passwords."""
    config = tmp / "sshd_config"
    config.write_text("\n".join([
        f"ListenAddress {cluster.addresses[node]}", f"Port {PORT}", f"HostKey {host_key}",
        f"AuthorizedKeysFile {tmp / 'authorized_keys'}", "PubkeyAuthentication yes",
        "PasswordAuthentication no", "KbdInteractiveAuthentication no",
        "PermitRootLogin prohibit-password", "StrictModes no", "UsePAM no",
        f"PidFile {tmp / 'sshd.pid'}", ""]))
    Path("/run/sshd").mkdir(exist_ok=True)  # Debian's privilege-separation directory
    log = (tmp / "sshd.log").open("wb")
    proc = cluster.run(node, [sshd, "-D", "-e", "-f", str(config)], stdout=log,
                       stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while True:  # listening (checked from the chief, as the launcher will connect)
        probe = cluster.run(0, [sys.executable, "-c", "import socket, sys; socket."
                                "create_connection((sys.argv[1], int(sys.argv[2])), 2).close()",
                                cluster.addresses[node], str(PORT)],
                            stderr=subprocess.DEVNULL)
        if probe.wait(timeout=20) == 0:
            return proc
        assert proc.poll() is None, (tmp / "sshd.log").read_text()
        assert time.monotonic() < deadline, "sshd did not start listening"
        time.sleep(0.2)


def _spec(cluster: VirtualCluster, tmp: Path, client_key: Path) -> Path:
    a0, a1 = cluster.addresses
    spec = tmp / "spec.yml"
    spec.write_text(f"""nodes:
  - address: {a0}
    cpus: [0]
    chief: true
  - address: {a1}
    cpus: [0]
    ssh_config: lab
ssh:
  lab:
    port: {PORT}
    key_file: {client_key}
""")
    return spec


def _launcher_env(tmp: Path) -> dict[str, str]:
    """This environment, ssh first on PATH as a wrapper that keeps the host keys it learns
    in tmp (ssh reads ~/.ssh of the passwd entry, not $HOME: the real one must not collect
    a fresh key per run); nothing else changes the launcher's own ssh command line."""
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    wrapper = bin_dir / "ssh"
    wrapper.write_text(f'#!/bin/sh\nexec {shutil.which("ssh")} -o UserKnownHostsFile='
                       f'{tmp / "known_hosts"} -o GlobalKnownHostsFile=/dev/null "$@"\n')
    wrapper.chmod(0o755)
    env = {k: v for k, v in os.environ.items()
           if k not in ("STRATAGEM_REMOTE_SHELL", "GLOO_SOCKET_IFNAME", "RANK", "WORLD_SIZE")}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    return env


def _run(cluster: VirtualCluster, argv: list[str], env: dict[str, str], tmp: Path,
         name: str, timeout: float) -> tuple[int | None, str]:
    """``argv`` on the chief, output to ``tmp/name``; (exit status or None if it was killed
    at ``timeout``, its output)."""
    log = tmp / name
    with log.open("wb") as out:
        proc = cluster.run(0, argv, env=env, cwd=tmp, stdout=out, stderr=subprocess.STDOUT)
        try:
            code: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
            code = None
    return code, log.read_text(errors="replace")


def test_two_nodes_over_ssh_match_one_process_and_a_dead_sshd_is_named(
        cluster: VirtualCluster, openssh: tuple[str, str], tmp_path: Path) -> None:
    sshd, keygen = openssh
    host_key, client_key = _keys(tmp_path, keygen)
    server = _start_sshd(cluster, 1, tmp_path, sshd, host_key)
    spec, env = _spec(cluster, tmp_path, client_key), _launcher_env(tmp_path)
    dist_ckpt, single_ckpt = tmp_path / "dist", tmp_path / "single"
    run = [sys.executable, "-m", "stratagem", "run", "--resource-spec", str(spec)]
    code, out = _run(cluster, [*run, str(DEMO), "--epochs", "1", "--save", str(dist_ckpt)],
                     env, tmp_path, "job.log", 150)
    assert code == 0, out + (tmp_path / "sshd.log").read_text()
    a0, a1 = cluster.addresses
    assert f"node 1  {a1}" in out and "2 replicas" in out
    assert "Accepted publickey" in (tmp_path / "sshd.log").read_text()  # really over ssh

    single = subprocess.run([sys.executable, str(DEMO), "--epochs", "1", "--save",
                             str(single_ckpt)], cwd=tmp_path, capture_output=True, text=True,
                            timeout=150, env=env)
    assert single.returncode == 0, single.stderr
    a = torch.load(dist_ckpt / "model.pt", weights_only=True)
    b = torch.load(single_ckpt / "model.pt", weights_only=True)
    assert a.keys() == b.keys()
    for name in a:  # float32 sums in another order: agreement to ~1e-6
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-6, msg=name)

    server.terminate()
    server.wait(timeout=10)
    started = time.monotonic()
    code, out = _run(cluster, [*run, "--max-restarts", "0", str(DEMO), "--epochs", "1"],
                     env, tmp_path, "dead.log", 120)
    assert code not in (0, None), out
    assert time.monotonic() - started < 90  # seconds: an error, not a hang
    summary = out[out.index("first failure:"):]
    assert f"node 1 ({a1})" in summary and "could not reach the node" in summary, out
    assert "Connection refused" in summary and "Traceback" not in out, out

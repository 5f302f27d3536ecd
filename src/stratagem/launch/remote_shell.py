"""Commands that start an agent on another node: ssh from the spec, or a user template.

The remote side runs one POSIX shell line: cd to the launcher's working directory, activate
the node's ``python_venv``, export the job's variables, exec the agent.
"""

from __future__ import annotations

import os
import shlex
import shutil
from collections.abc import Mapping, Sequence

from stratagem import env
from stratagem.errors import LaunchError
from stratagem.resource import Node, SSHConfig, normalize_address

REMOTE_SHELL_ENV = env.REMOTE_SHELL


def activate_command(python_venv: str) -> str:
    """Shell line activating a venv given as a directory, an ``activate`` path, or a command
    (AutoDist style: ``source /path/bin/activate``)."""
    text = python_venv.strip()
    if text.startswith("source "):
        return ". " + text[len("source "):].strip()
    if text.startswith(". ") or " " in text:
        return text
    path = text if text.endswith("/activate") else text.rstrip("/") + "/bin/activate"
    if path.startswith("~/"):
        return '. "$HOME"/' + shlex.quote(path[2:])
    return ". " + shlex.quote(path)


def remote_command(cwd: str, env: Mapping[str, str], argv: Sequence[str],
                   python_venv: str | None = None) -> str:
    """One shell line: ``cd CWD && [activate &&] export K=V... && exec ARGV``."""
    parts = [f"cd {shlex.quote(cwd)}"]
    if python_venv:
        parts.append(activate_command(python_venv))
    if env:
        parts.append("export " + " ".join(shlex.quote(f"{k}={v}") for k, v in env.items()))
    parts.append("exec " + shlex.join(argv))
    return " && ".join(parts)


def ssh_argv(node: Node, ssh: SSHConfig, command: str) -> list[str]:
    """``ssh`` invocation running ``command`` on ``node`` with its spec ssh group.

    ``--`` ends ssh's options, so the destination can never be read as one (the spec
    parser already refuses addresses and user names that start with ``-``).
    """
    address = _checked_address(node.address)
    argv = ["ssh", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=accept-new",
            "-p", str(ssh.port)]
    if ssh.key_file:
        argv += ["-i", os.path.expanduser(ssh.key_file)]
    argv += ["--", f"{ssh.username}@{address}" if ssh.username else address, command]
    return argv


def _checked_address(address: str) -> str:
    """``address`` if it is a host name or IP literal (never an option), else LaunchError."""
    try:
        if normalize_address(address) == address:
            return address
    except ValueError:
        pass
    raise LaunchError(f"node address {address!r} is not a host name or IP address",
                      fix="load the resource spec with ResourceSpec.from_file, which "
                          "checks addresses")


def template_argv(template: str, address: str, command: str) -> list[str]:
    """argv from a ``--remote-shell`` template with ``{address}`` substituted.

    The template is a command prefix that runs its trailing argv on the node (``ip netns exec``,
    ``docker exec``, ``vcluster.py exec {address} --``): the remote line is appended as
    ``/bin/sh -c LINE``. A template starting with ``ssh`` gets the line as one argument.
    """
    try:
        words = shlex.split(template)
    except ValueError as exc:
        raise LaunchError(f"cannot parse the remote shell template {template!r}: {exc}",
                          where="--remote-shell", fix="quote it like a shell command") from None
    if not any("{address}" in w for w in words):
        raise LaunchError(f"the remote shell template {template!r} has no {{address}}",
                          where="--remote-shell",
                          fix="put {address} where the node's address goes, e.g. "
                              "'ssh -p 2222 {address}'")
    address = _checked_address(address)
    words = [w.replace("{address}", address) for w in words]
    if os.path.basename(words[0]) == "ssh":
        return [*words, command]
    return [*words, "/bin/sh", "-c", command]


def require_ssh() -> str:
    """Path of the ssh client, or a LaunchError saying how to get one."""
    path = shutil.which("ssh")
    if path is None:
        raise LaunchError(
            "the resource spec has remote nodes but no `ssh` client is installed",
            fix="install OpenSSH (e.g. `apt-get install openssh-client`), or pass "
                f"--remote-shell TEMPLATE (or set {REMOTE_SHELL_ENV})")
    return path

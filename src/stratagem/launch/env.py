"""The environment contract between the launcher, the per-node agents and the workers.

This module *writes* the variables; their names, meanings and accessors are defined in
:mod:`stratagem.env` (the one place that reads them). Every worker sees, besides torch
elastic's RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/...:

``STRATAGEM_RESOURCE_SPEC``  absolute path of the resource spec (unset: this machine alone)
``STRATAGEM_STRATEGY``       builder name or strategy file path from ``--strategy`` (or unset)
``STRATAGEM_NODE_ADDRESS``   this node's address from the spec (127.0.0.1 without a spec)
``STRATAGEM_JOB_ID``         the job id; also torch elastic's rendezvous id
``STRATAGEM_ROLE``           ``server`` on nodes with ``workers: 0`` (dedicated parameter
                             servers, one process each); unset on worker nodes
``STRATAGEM_NPROC``          ``--nproc`` given with a single-node spec: the worker count that
                             replaces the spec's ``workers`` (read by :func:`nproc_override`)
``STRATAGEM_NODES``          with ``--nnodes MIN:MAX``: the addresses of the spec's nodes this
                             attempt runs on (read by :func:`active_nodes`)
``CUDA_DEVICE_ORDER``        ``PCI_BUS_ID`` unless already set, so a spec's ``gpus: [2, 3]``
                             are the GPUs ``nvidia-smi`` numbers 2 and 3; local rank ``i``
                             trains on ``cuda:{gpus[i]}``

On each node the agent calls :func:`apply_node_env` before starting torchrun: it sets
``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME`` to the interface owning
``STRATAGEM_NODE_ADDRESS``, each unless already set.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Mapping, MutableMapping
from pathlib import Path

from stratagem import env
from stratagem.errors import LaunchError
from stratagem.launch.netif import interface_for_address
from stratagem.resource import MAX_WORKERS_PER_NODE, Node

ENV_SPEC = env.RESOURCE_SPEC
ENV_STRATEGY = env.STRATEGY
ENV_NODE_ADDRESS = env.NODE_ADDRESS
ENV_JOB_ID = env.JOB_ID
ENV_ROLE = env.ROLE
ENV_NPROC = env.NPROC
ENV_NODES = env.NODES
GLOO_IFNAME = "GLOO_SOCKET_IFNAME"
NCCL_IFNAME = "NCCL_SOCKET_IFNAME"


def job_env(job_id: str, node: Node, spec_path: str | None, strategy: str | None,
            inherited: Mapping[str, str] | None = None,
            nproc: int | None = None) -> dict[str, str]:
    """Variables the launcher hands to ``node``'s agent (on top of the shared_envs).

    ``OMP_NUM_THREADS`` defaults to the node's CPUs divided among its workers, unless
    ``inherited`` (the launcher's environment) already sets it. ``nproc``: the ``--nproc``
    that overrides the spec's worker count (single-node specs).
    """
    inherited = os.environ if inherited is None else inherited
    out = {ENV_JOB_ID: job_id, ENV_NODE_ADDRESS: node.address, "PYTHONUNBUFFERED": "1",
           "CUDA_DEVICE_ORDER": inherited.get("CUDA_DEVICE_ORDER", "PCI_BUS_ID")}
    if spec_path:
        out[ENV_SPEC] = spec_path
        if nproc is not None:
            out[ENV_NPROC] = str(nproc)
    if strategy:
        out[ENV_STRATEGY] = strategy
    if "OMP_NUM_THREADS" in inherited:
        out["OMP_NUM_THREADS"] = inherited["OMP_NUM_THREADS"]
    else:
        out["OMP_NUM_THREADS"] = str(max(1, len(node.cpus) // max(1, node.workers)))
    return out


def observe_env(job_id: str, run_dir: str | None, log_dir: str | None,
                log_level: str | None, inherited: Mapping[str, str] | None = None,
                tensorboard: str | None = None) -> dict[str, str]:
    """Where the workers record metrics and logs (absolute paths), and their log level.

    Without ``--run-dir`` the job records into ``$TMPDIR/stratagem-runs/JOB_ID`` unless the
    launcher's environment already names a run or checkpoint directory (then that one)."""
    inherited = os.environ if inherited is None else inherited
    out: dict[str, str] = {}
    if run_dir:
        out[env.RUN_DIR] = str(Path(run_dir).resolve())
    elif not (inherited.get(env.RUN_DIR) or inherited.get(env.CHECKPOINT_DIR)
              or inherited.get(env.ADAPTDL_CHECKPOINT_PATH)):
        out[env.RUN_DIR] = str(Path(tempfile.gettempdir()) / "stratagem-runs" / job_id)
    if log_dir:
        out[env.LOG_DIR] = str(Path(log_dir).resolve())
    if log_level:
        out[env.LOG_LEVEL] = log_level
    if tensorboard:
        out[env.TENSORBOARD_DIR] = str(Path(tensorboard).resolve())
    return out


def checkpoint_env(checkpoint_dir: str | None, steps: int | None, seconds: float | None,
                   restart: int, *, sync: bool = False,
                   stop_grace: float | None = None) -> dict[str, str]:
    """The workers' checkpoint settings (``--checkpoint-dir/-steps/-seconds/-sync``,
    absolute path) and how many times the job was restarted before this attempt."""
    out = {env.RESTART_COUNT: str(restart)}
    if sync:
        out[env.CHECKPOINT_ASYNC] = "0"
    if checkpoint_dir:
        out[env.CHECKPOINT_DIR] = str(Path(checkpoint_dir).resolve())
    if steps:
        out[env.CHECKPOINT_STEPS] = str(steps)
    if seconds:
        out[env.CHECKPOINT_SECONDS] = repr(float(seconds))
    if stop_grace:
        out[env.STOP_GRACE] = repr(float(stop_grace))
    return out


def nproc_override(environ: Mapping[str, str] | None = None) -> int | None:
    """``STRATAGEM_NPROC``: the worker count ``stratagem run --nproc`` gave a single-node
    spec, so every worker applies the launcher's override to the spec it loads."""
    value = (env.nproc() if environ is None else environ.get(ENV_NPROC)) or ""
    if value == "":
        return None
    if not value.isdigit() or not 1 <= int(value) <= MAX_WORKERS_PER_NODE:
        raise LaunchError(f"{ENV_NPROC}={value!r} is not a worker count", where=ENV_NPROC,
                          fix=f"unset it, or give 1 to {MAX_WORKERS_PER_NODE}")
    return int(value)


def active_nodes(environ: Mapping[str, str] | None = None) -> list[str] | None:
    """``STRATAGEM_NODES``: the spec nodes this attempt of a ``--nnodes MIN:MAX`` job runs
    on (None: every node of the spec), so every worker keeps only those of its spec."""
    value = (env.nodes() if environ is None else environ.get(ENV_NODES)) or ""
    names = [a for a in value.split(",") if a]
    return names or None


def apply_node_env(environ: MutableMapping[str, str] | None = None) -> str | None:
    """Agent-side set-up: bind gloo and NCCL to the interface owning this node's address.

    When ``STRATAGEM_NODE_ADDRESS`` is set and a local interface owns the address, sets
    ``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME`` to it, each unless already set (a
    user's or the spec's ``shared_envs`` choice wins); returns the interface (or None).
    """
    environ = os.environ if environ is None else environ
    address = environ.get(ENV_NODE_ADDRESS)
    wanted = [name for name in (GLOO_IFNAME, NCCL_IFNAME) if not environ.get(name)]
    if not address or not wanted:
        return None
    ifname = interface_for_address(address)
    if ifname is None:
        print(f"stratagem: warning: no local interface has address {address} "
              f"({ENV_NODE_ADDRESS}); gloo and NCCL will pick an interface themselves",
              file=sys.stderr)
        return None
    for name in wanted:
        environ[name] = ifname
    return ifname

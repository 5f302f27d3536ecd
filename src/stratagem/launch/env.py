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

On each node the agent calls :func:`apply_node_env` before starting torchrun: it sets
``GLOO_SOCKET_IFNAME`` to the interface owning ``STRATAGEM_NODE_ADDRESS`` unless already set.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, MutableMapping

from stratagem import env
from stratagem.launch.netif import interface_for_address
from stratagem.resource import Node

ENV_SPEC = env.RESOURCE_SPEC
ENV_STRATEGY = env.STRATEGY
ENV_NODE_ADDRESS = env.NODE_ADDRESS
ENV_JOB_ID = env.JOB_ID
ENV_ROLE = env.ROLE
GLOO_IFNAME = "GLOO_SOCKET_IFNAME"


def job_env(job_id: str, node: Node, spec_path: str | None, strategy: str | None,
            inherited: Mapping[str, str] | None = None) -> dict[str, str]:
    """Variables the launcher hands to ``node``'s agent (on top of the shared_envs).

    ``OMP_NUM_THREADS`` defaults to the node's CPUs divided among its workers, unless
    ``inherited`` (the launcher's environment) already sets it.
    """
    inherited = os.environ if inherited is None else inherited
    out = {ENV_JOB_ID: job_id, ENV_NODE_ADDRESS: node.address, "PYTHONUNBUFFERED": "1"}
    if spec_path:
        out[ENV_SPEC] = spec_path
    if strategy:
        out[ENV_STRATEGY] = strategy
    if "OMP_NUM_THREADS" in inherited:
        out["OMP_NUM_THREADS"] = inherited["OMP_NUM_THREADS"]
    else:
        out["OMP_NUM_THREADS"] = str(max(1, len(node.cpus) // max(1, node.workers)))
    return out


def apply_node_env(environ: MutableMapping[str, str] | None = None) -> str | None:
    """Agent-side set-up: bind gloo to the interface owning this node's spec address.

    Sets ``GLOO_SOCKET_IFNAME`` when ``STRATAGEM_NODE_ADDRESS`` is set, ``GLOO_SOCKET_IFNAME``
    is not, and a local interface owns the address; returns the interface chosen (or None).
    """
    environ = os.environ if environ is None else environ
    address = environ.get(ENV_NODE_ADDRESS)
    if not address or environ.get(GLOO_IFNAME):
        return None
    ifname = interface_for_address(address)
    if ifname is None:
        print(f"stratagem: warning: no local interface has address {address} "
              f"({ENV_NODE_ADDRESS}); gloo will pick an interface itself", file=sys.stderr)
        return None
    environ[GLOO_IFNAME] = ifname
    return ifname

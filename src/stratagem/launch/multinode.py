"""Multi-node launch: one torchrun agent per node, joined by c10d rendezvous.

A node with ``workers: 0`` is a dedicated parameter server: its agent starts one process
with ``STRATAGEM_ROLE=server`` (see docs/concepts/parameter-server.md), which serves the
workers, or exits at once if the strategy sends nothing to servers.

Nodes whose address belongs to this machine start their agent directly; the others through
the remote shell (``--remote-shell`` / ``STRATAGEM_REMOTE_SHELL``, else ssh from the spec).
The chief hosts the rendezvous store (``is_host=1``, explicit: in network namespaces every node
has the same host name, so torch's host-name matching cannot tell), unless it runs no workers;
then the first node with workers does.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Collection

from stratagem.launch.env import ENV_NODES, ENV_ROLE, checkpoint_env, job_env, observe_env
from stratagem.launch.job import (
    DEFAULT_RDZV_PORT,
    AgentLaunch,
    JobOptions,
    LaunchPlan,
    agent_argv,
    torchrun_args,
)
from stratagem.launch.local import free_port
from stratagem.launch.netif import is_local_address
from stratagem.launch.remote_shell import (
    remote_command,
    require_ssh,
    ssh_argv,
    template_argv,
)
from stratagem.resource import ResourceSpec


def plan_multinode(opts: JobOptions, spec: ResourceSpec, job_id: str, spec_path: str | None,
                   strategy: str | None, remote_shell: str | None = None,
                   restart: int = 0, active: Collection[str] | None = None) -> LaunchPlan:
    """One agent per node: ``workers`` processes, or one server process for ``workers: 0``.
    ``active``: the addresses of the nodes to start (``--nnodes MIN:MAX``; None: all); the
    others are listed in the plan as unused, and the workers learn the set from
    ``STRATAGEM_NODES``."""
    used = spec if active is None else spec.subset(active)
    keep = {n.address for n in used.nodes}
    started = [(i, n) for i, n in enumerate(spec.nodes) if n.address in keep]
    unused = tuple((i, n) for i, n in enumerate(spec.nodes) if n.address not in keep)
    working = [n for _, n in started if n.workers > 0]
    host = used.chief.address if used.chief.workers > 0 else working[0].address
    host_is_here = is_local_address(host)
    port = opts.rdzv_port or (free_port(host) if host_is_here else DEFAULT_RDZV_PORT)
    endpoint = f"{host}:{port}"
    cwd = os.getcwd()
    agents = []
    for i, node in started:
        is_host = node.address == host
        ssh = spec.ssh_for(node)
        torchrun = torchrun_args(nnodes=len(started), nproc=node.workers or 1,
                                 endpoint=endpoint, job_id=job_id, local_addr=node.address,
                                 is_host=is_host)
        env = {**job_env(job_id, node, spec_path, strategy), **ssh.shared_envs,
               **observe_env(job_id, opts.run_dir, opts.log_dir, opts.log_level,
                             tensorboard=opts.tensorboard),
               **checkpoint_env(opts.checkpoint_dir, opts.checkpoint_steps,
                                opts.checkpoint_seconds, restart, sync=opts.checkpoint_sync,
                                stop_grace=opts.stop_grace)}
        if active is not None:
            env[ENV_NODES] = ",".join(sorted(keep))
        if node.workers == 0:
            env[ENV_ROLE] = "server"
        here = host_is_here if is_host else is_local_address(node.address)
        if here:
            argv = agent_argv(sys.executable, torchrun, opts.script, opts.script_args)
            agents.append(AgentLaunch(i, node, tuple(argv), {**os.environ, **env}, "local",
                                      is_host))
            continue
        python = "python" if ssh.python_venv else sys.executable
        line = remote_command(cwd, env, agent_argv(python, torchrun, opts.script,
                                                   opts.script_args), ssh.python_venv)
        if remote_shell:
            argv, via = template_argv(remote_shell, node.address, line), "remote shell"
        else:
            require_ssh()
            argv, via = ssh_argv(node, ssh, line), "ssh"
        agents.append(AgentLaunch(i, node, tuple(argv), dict(os.environ), via, is_host))
    return LaunchPlan(job_id=job_id, endpoint=endpoint, agents=tuple(agents),
                      spec_source=spec.source, unused=unused)

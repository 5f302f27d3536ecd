"""Single-node launch: one torchrun agent on this machine, rendezvous on loopback."""

from __future__ import annotations

import os
import socket
import sys

from stratagem.launch.env import checkpoint_env, job_env, observe_env
from stratagem.launch.job import AgentLaunch, JobOptions, LaunchPlan, agent_argv, torchrun_args
from stratagem.resource import ResourceSpec


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (bind to port 0, ask, release)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def plan_local(opts: JobOptions, spec: ResourceSpec, job_id: str, spec_path: str | None,
               strategy: str | None, restart: int = 0) -> LaunchPlan:
    """All of ``spec``'s (single) node's workers as local processes under one torchrun."""
    node = spec.nodes[0]
    endpoint = f"127.0.0.1:{opts.rdzv_port or free_port()}"
    torchrun = torchrun_args(nnodes=1, nproc=node.workers, endpoint=endpoint, job_id=job_id,
                             local_addr="127.0.0.1", is_host=True)
    env = job_env(job_id, node, spec_path, strategy, nproc=opts.nproc)
    env.update(spec.ssh_for(node).shared_envs)
    env.update(observe_env(job_id, opts.run_dir, opts.log_dir, opts.log_level,
                           tensorboard=opts.tensorboard))
    env.update(checkpoint_env(opts.checkpoint_dir, opts.checkpoint_steps,
                              opts.checkpoint_seconds, restart, sync=opts.checkpoint_sync,
                              stop_grace=opts.stop_grace))
    agent = AgentLaunch(
        index=0, node=node,
        argv=tuple(agent_argv(sys.executable, torchrun, opts.script, opts.script_args)),
        env={**os.environ, **env}, via="local", is_host=True)
    return LaunchPlan(job_id=job_id, endpoint=endpoint, agents=(agent,),
                      spec_source=spec.source)

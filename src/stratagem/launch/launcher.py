"""``stratagem run``: check the options, plan the launch, print the plan, supervise it."""

from __future__ import annotations

import os
import re
import secrets
import sys
from dataclasses import replace
from pathlib import Path

from stratagem import env
from stratagem.errors import LaunchError
from stratagem.launch.job import DEFAULT_MAX_RESTARTS, JobOptions, LaunchPlan, RestartPolicy
from stratagem.launch.local import plan_local
from stratagem.launch.multinode import plan_multinode
from stratagem.launch.probe import NodePool
from stratagem.resource import MAX_WORKERS_PER_NODE, ResourceSpec

# A job id names temporary directories and goes on every node's command line.
JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
MAX_RESTARTS = 10_000


def new_job_id() -> str:
    return f"sg-{secrets.token_hex(4)}"


def resolve_strategy(value: str | None) -> str | None:
    """What the workers get as ``--strategy``: a strategy file's absolute path or a
    builder name, checked here (:func:`stratagem.strategy.resolve_builder`) so that a bad
    one fails once in the launcher, not in every worker."""
    if not value:
        return None
    # Imported here: the strategy builders import torch, which the launcher needs only to
    # check a --strategy (seconds of start-up on every plain `stratagem run` otherwise).
    from stratagem.strategy.resolve import is_strategy_path, resolve_builder

    resolve_builder(value)
    return str(Path(value).resolve()) if is_strategy_path(value) else value


def check_options(opts: JobOptions) -> None:
    if opts.nproc is not None and not 1 <= opts.nproc <= MAX_WORKERS_PER_NODE:
        raise LaunchError(f"--nproc must be 1 to {MAX_WORKERS_PER_NODE}, got {opts.nproc}",
                          where="--nproc",
                          fix="pass the number of worker processes, e.g. --nproc 2")
    if opts.rdzv_port is not None and not 0 < opts.rdzv_port < 65536:
        raise LaunchError(f"--rdzv-port {opts.rdzv_port} out of range", where="--rdzv-port",
                          fix="use a free TCP port between 1 and 65535")
    if opts.job_id is not None and not JOB_ID.fullmatch(opts.job_id):
        raise LaunchError(f"invalid job id {opts.job_id!r}", where="--job-id",
                          fix="use 1-64 letters, digits, '_', '.' or '-', starting with a "
                              "letter or digit")
    if opts.max_restarts is not None and not 0 <= opts.max_restarts <= MAX_RESTARTS:
        raise LaunchError(f"--max-restarts must be 0 to {MAX_RESTARTS}, got "
                          f"{opts.max_restarts}", where="--max-restarts",
                          fix="pass how many times a failed job may be restarted (0: never)")
    if not 0 <= opts.restart_backoff <= 3600:
        raise LaunchError(f"--restart-backoff must be 0 to 3600 s, got {opts.restart_backoff}",
                          where="--restart-backoff", fix="e.g. --restart-backoff 1")
    if opts.checkpoint_steps is not None and opts.checkpoint_steps < 0:
        raise LaunchError(f"--checkpoint-steps must be >= 0, got {opts.checkpoint_steps}",
                          where="--checkpoint-steps", fix="e.g. --checkpoint-steps 100 (0: off)")
    if opts.checkpoint_seconds is not None and not 0 <= opts.checkpoint_seconds <= 1e9:
        raise LaunchError(f"--checkpoint-seconds must be 0 to 1e9, got "
                          f"{opts.checkpoint_seconds}", where="--checkpoint-seconds",
                          fix="e.g. --checkpoint-seconds 60 (0: off)")
    if opts.checkpoint_dir is not None and not str(opts.checkpoint_dir).strip():
        raise LaunchError(f"--checkpoint-dir {str(opts.checkpoint_dir)!r} is blank",
                          where="--checkpoint-dir", fix="pass a directory")
    env.validate()  # STRATAGEM_* numbers the workers would choke on (nan, -1, ...)
    if ((opts.checkpoint_steps or opts.checkpoint_seconds) and not opts.checkpoint_dir
            and env.checkpoint_dir() is None):
        raise LaunchError("periodic checkpoints need a checkpoint directory",
                          where="--checkpoint-steps/--checkpoint-seconds",
                          fix=f"pass --checkpoint-dir DIR (or set {env.CHECKPOINT_DIR})")
    if opts.stop_grace is not None and not 0 < opts.stop_grace <= env.MAX_STOP_GRACE_S:
        raise LaunchError(f"--stop-grace must be above 0 and at most "
                          f"{env.MAX_STOP_GRACE_S:g} s, got {opts.stop_grace}",
                          where="--stop-grace",
                          fix="e.g. --stop-grace 120, or leave it out: twice the job's last "
                              "save plus a margin, at least 30 s")
    if not 0 < opts.node_probe_seconds <= 3600:
        raise LaunchError(f"--node-probe-seconds must be above 0 and at most 3600, got "
                          f"{opts.node_probe_seconds}", where="--node-probe-seconds",
                          fix="e.g. --node-probe-seconds 10")
    if not Path(opts.script).is_file():
        raise LaunchError(f"training script {opts.script!r} not found",
                          fix=f"check the path (relative to {os.getcwd()})")


NNODES = re.compile(r"(\d{1,6})(?::(\d{1,6}))?")


def parse_nnodes(text: str, listed: int, source: str) -> tuple[int, int]:
    """``--nnodes MIN:MAX`` (or ``N``, meaning N:N) checked against the ``listed`` nodes of
    the spec: 1 <= MIN <= MAX <= listed."""
    found = NNODES.fullmatch(text.strip())
    if found is None:
        raise LaunchError(f"--nnodes {text!r} is not MIN:MAX", where="--nnodes",
                          fix="e.g. --nnodes 2:4 (at least 2 nodes, at most 4) or --nnodes 3")
    low = int(found.group(1))
    high = int(found.group(2) or low)
    if not 1 <= low <= high:
        raise LaunchError(f"--nnodes {text}: need 1 <= MIN <= MAX", where="--nnodes",
                          fix="e.g. --nnodes 1:3")
    if high > listed:
        raise LaunchError(f"--nnodes {text}: MAX is {high} but {source} lists {listed} "
                          f"node{'s' * (listed != 1)}", where="--nnodes",
                          fix=f"lower MAX to {listed}, or add nodes to the spec")
    return low, high


def plan_job(opts: JobOptions, restart: int = 0,
             nodes: tuple[str, ...] | None = None) -> LaunchPlan:
    """Validate ``opts`` and turn them into a LaunchPlan (raises StratagemError subclasses).
    ``restart``: how many times the job was restarted before (the workers' environment);
    ``nodes``: the addresses of the spec nodes to run on (``--nnodes``; None: all)."""
    check_options(opts)
    spec_path = str(Path(opts.resource_spec).resolve()) if opts.resource_spec else None
    spec = ResourceSpec.from_file(spec_path) if spec_path else ResourceSpec.local(opts.nproc)
    strategy = resolve_strategy(opts.strategy)
    job_id = opts.job_id or new_job_id()
    if opts.nnodes is not None:
        if not spec_path:
            raise LaunchError("--nnodes needs a resource spec listing the nodes",
                              where="--nnodes",
                              fix="pass --resource-spec FILE with up to MAX nodes")
        parse_nnodes(opts.nnodes, len(spec.nodes), spec.source)
    if spec.is_local:  # --nnodes on a one-node spec: that node or nothing
        if opts.nproc is not None and spec_path:  # the workers apply it too (STRATAGEM_NPROC)
            spec = spec.with_local_workers(opts.nproc)
        return plan_local(opts, spec, job_id, spec_path, strategy, restart=restart)
    if opts.nproc is not None:
        raise LaunchError("--nproc only applies to single-node runs", where="--nproc",
                          fix=f"set 'workers' per node in {spec.source} instead")
    shell = opts.remote_shell or env.remote_shell()
    return plan_multinode(opts, spec, job_id, spec_path, strategy, remote_shell=shell,
                          restart=restart, active=nodes)


def restart_policy(opts: JobOptions) -> RestartPolicy:
    """``--max-restarts`` (default: DEFAULT_MAX_RESTARTS when the job has a checkpoint
    directory to resume from, else 0) and the backoff."""
    where = opts.checkpoint_dir or env.checkpoint_dir()
    limit = opts.max_restarts
    if limit is None:
        limit = DEFAULT_MAX_RESTARTS if where else 0
    low = high = None
    if opts.nnodes is not None and opts.resource_spec:
        spec = ResourceSpec.from_file(opts.resource_spec)
        low, high = parse_nnodes(opts.nnodes, len(spec.nodes), spec.source)
    return RestartPolicy(max_restarts=limit, backoff_s=opts.restart_backoff,
                         checkpoint_dir=str(Path(where).resolve()) if where else None,
                         min_nodes=low, max_nodes=high,
                         probe_interval_s=opts.node_probe_seconds,
                         stop_grace_s=opts.stop_grace or env.stop_grace())


def first_nodes(pool: NodePool) -> tuple[str, ...]:
    """The nodes a ``--nnodes MIN:MAX`` job starts on: the first MAX reachable ones of its
    spec; a LaunchError naming the unreachable ones when fewer than MIN are."""
    listed = [n.address for n in pool.listed().nodes]
    state = pool.reachable(listed)
    up = [a for a in listed if state.get(a)]
    if len(up) < pool.min_nodes:
        down = [a for a in listed if not state.get(a)]
        raise LaunchError(
            f"only {len(up)} of the {len(listed)} nodes of {pool.spec.source} are reachable, "
            f"--nnodes needs at least {pool.min_nodes}; unreachable: {', '.join(down)}",
            where="--nnodes",
            fix="bring those nodes back (check their network and that the remote shell "
                "reaches them), or lower MIN")
    return pool.choose(up, ())


def run_job(opts: JobOptions) -> int:
    """Plan, print the plan, and run the job; returns the launcher's exit code."""
    from stratagem.launch.supervisor import Supervisor

    plan = plan_job(opts)
    opts = replace(opts, job_id=plan.job_id)  # a restart keeps the job id
    policy = restart_policy(opts)
    pool = None
    if policy.min_nodes is not None and policy.max_nodes is not None and opts.resource_spec:
        pool = NodePool(str(Path(opts.resource_spec).resolve()),
                        opts.remote_shell or env.remote_shell(), policy.min_nodes,
                        policy.max_nodes)
        if not opts.dry_run:
            plan = plan_job(opts, nodes=first_nodes(pool))
    sup = Supervisor(plan, policy=policy, pool=pool,
                     replan=lambda n, nodes=None: plan_job(opts, restart=n, nodes=nodes))
    sup.say(plan.describe())
    where = plan.agents[0].env.get(env.RUN_DIR) if plan.agents else None
    if where:
        sup.say(f"metrics: {where}/metrics.jsonl (plots: stratagem report {where})")
    if pool is not None:
        sup.say(f"nodes: {len(plan.agents)} of {len(pool.spec.nodes)} listed, --nnodes "
                f"{policy.min_nodes}:{policy.max_nodes}; a lost node shrinks the job, a "
                f"returning one grows it (probed every {policy.probe_interval_s:g} s)")
    if policy.max_restarts:
        sup.say(f"restarts: up to {policy.max_restarts}, from the newest checkpoint in "
                f"{policy.checkpoint_dir}" if policy.checkpoint_dir else
                f"restarts: up to {policy.max_restarts}, from the start (no checkpoint "
                "directory)")
    if opts.dry_run:
        for agent in plan.agents:
            print(f"node {agent.index}: {agent.command_line()}")
        return 0
    sys.stdout.flush()
    return sup.run()

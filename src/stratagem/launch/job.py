"""Plain data for one launch: the user's options and the per-node agent commands."""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field

from stratagem.resource import Node

AGENT_MODULE = "stratagem.launch.agent"
WORKER_MODULE = "stratagem.launch.worker"
DEFAULT_RDZV_PORT = 29400  # torch elastic's c10d default, used when the host is remote
DEFAULT_NODE_PROBE_S = 10.0  # --nnodes MIN:MAX below MAX: probe the missing nodes this often
DEFAULT_MAX_RESTARTS = 3  # for a job with a checkpoint directory (it resumes, not restarts)


@dataclass(frozen=True)
class JobOptions:
    """What ``stratagem run`` was asked to do (already parsed, not yet checked)."""

    script: str
    script_args: tuple[str, ...] = ()
    resource_spec: str | None = None
    nproc: int | None = None
    strategy: str | None = None
    remote_shell: str | None = None
    rdzv_port: int | None = None
    job_id: str | None = None
    dry_run: bool = False
    run_dir: str | None = None  # metrics file (default: a per-job directory under $TMPDIR)
    log_dir: str | None = None  # per-rank stdout/stderr files
    log_level: str | None = None  # the workers' STRATAGEM_LOG_LEVEL
    tensorboard: str | None = None  # TensorBoard scalars directory
    max_restarts: int | None = None  # None: DEFAULT_MAX_RESTARTS with a checkpoint dir, else 0
    restart_backoff: float = 1.0  # seconds before the first restart (doubled while no progress)
    checkpoint_dir: str | None = None  # the workers' STRATAGEM_CHECKPOINT_DIR
    checkpoint_steps: int | None = None  # the workers' STRATAGEM_CHECKPOINT_STEPS
    checkpoint_seconds: float | None = None  # the workers' STRATAGEM_CHECKPOINT_SECONDS
    checkpoint_sync: bool = False  # periodic saves synchronous (STRATAGEM_CHECKPOINT_ASYNC=0)
    stop_grace: float | None = None  # STRATAGEM_STOP_GRACE_S (None: from the last save)
    nnodes: str | None = None  # "MIN:MAX" (or "N"): how many of the spec's nodes to run on
    node_probe_seconds: float = DEFAULT_NODE_PROBE_S  # below MAX: how often to look for nodes


@dataclass(frozen=True)
class RestartPolicy:
    """When a failed job is started again (``stratagem run --max-restarts``)."""

    max_restarts: int = 0  # 0: the first failure ends the job
    backoff_s: float = 1.0  # wait before the first restart; doubled while no progress
    max_backoff_s: float = 30.0
    checkpoint_dir: str | None = None  # where progress shows (a newer checkpoint)
    min_nodes: int | None = None  # --nnodes MIN:MAX: fewer reachable nodes end the job
    max_nodes: int | None = None  # ... and never more than MAX are started
    probe_interval_s: float = DEFAULT_NODE_PROBE_S  # below MAX: look for nodes this often
    stop_grace_s: float | None = None  # a stop waits this long (None: launch.grace decides)


@dataclass(frozen=True)
class AgentLaunch:
    """How one node's torch elastic agent is started from the launcher's machine."""

    index: int  # position of the node in the spec (the ``[node i]`` prefix)
    node: Node
    argv: tuple[str, ...]  # run here: the agent itself, or a remote shell that starts it
    env: Mapping[str, str]  # environment of the local process
    via: str  # "local", "ssh" or "remote shell"
    is_host: bool  # hosts the c10d rendezvous store

    def command_line(self) -> str:
        return shlex.join(self.argv)


@dataclass(frozen=True)
class LaunchPlan:
    """Everything needed to start a job: printed before starting, testable on its own."""

    job_id: str
    endpoint: str
    agents: tuple[AgentLaunch, ...]
    skipped: tuple[tuple[int, Node], ...] = field(default=())  # nodes with no workers
    unused: tuple[tuple[int, Node], ...] = field(default=())  # --nnodes: spec nodes not used
    spec_source: str = "<this machine>"

    @property
    def addresses(self) -> tuple[str, ...]:
        """The addresses of the nodes this plan starts, in spec order."""
        return tuple(a.node.address for a in self.agents)

    @property
    def num_workers(self) -> int:
        return sum(a.node.workers for a in self.agents)

    def describe(self) -> str:
        nodes = len(self.agents)
        lines = [
            f"job {self.job_id}: {self.num_workers} worker{'s' * (self.num_workers != 1)} on "
            f"{nodes} node{'s' * (nodes != 1)} ({self.spec_source}); "
            f"rendezvous c10d at {self.endpoint}"
        ]
        rows = [(a.index, a.node, f"{a.node.workers} worker{'s' * (a.node.workers != 1)}"
                 if a.node.workers else "PS server",
                 a.via + (", rendezvous host" if a.is_host and nodes > 1 else ""))
                for a in self.agents]
        rows += [(i, n, "no workers", "not started") for i, n in self.skipped]
        rows += [(i, n, "not used", "unreachable or above MAX") for i, n in self.unused]
        width = max(len(n.address) for _, n, _, _ in rows)
        for i, node, workers, how in sorted(rows, key=lambda r: r[0]):
            chief = "chief" if node.chief else ""
            lines.append(f"  node {i}  {node.address:<{width}}  {chief:<5}  {workers:<11}  {how}")
        return "\n".join(lines)


def torchrun_args(*, nnodes: int, nproc: int, endpoint: str, job_id: str, local_addr: str,
                  is_host: bool) -> list[str]:
    """torchrun options for one node's agent (without the training command)."""
    return [
        "--nnodes", str(nnodes),
        "--nproc-per-node", str(nproc),
        "--rdzv-backend", "c10d",
        "--rdzv-endpoint", endpoint,
        "--rdzv-id", job_id,
        "--rdzv-conf", f"is_host={int(is_host)}",
        "--local-addr", local_addr,
        "--max-restarts", "0",
    ]


def agent_argv(python: str, torchrun: list[str], script: str,
               script_args: tuple[str, ...]) -> list[str]:
    """The command that runs on a node: our agent wrapper around torchrun and the worker.

    The ``--`` before the worker module ends torchrun's options: the script's own options
    (``--n 1024``) are never read as (abbreviations of) torchrun's."""
    return [python, "-m", AGENT_MODULE, "--watch-stdin", "--failure-key-stdin", "--", *torchrun,
            "-m", "--", WORKER_MODULE, script, *script_args]

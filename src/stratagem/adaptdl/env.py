"""AdaptDL's ``adaptdl.env``: the job's environment, read from ``ADAPTDL_*`` variables.

Each function reads its AdaptDL variable first and, when it is unset, falls back to what
torch elastic (``torchrun``, ``stratagem run``) and Stratagem set, so an AdaptDL script
runs unchanged under either launcher.
"""

from __future__ import annotations

import os


def _int(names: tuple[str, ...], default: int) -> int:
    for name in names:
        value = os.environ.get(name)
        if value not in (None, ""):
            return int(value)
    return default


def _str(names: tuple[str, ...]) -> str | None:
    for name in names:
        value = os.environ.get(name)
        if value:
            return value
    return None


def checkpoint_path() -> str | None:
    """Checkpoint directory: ``ADAPTDL_CHECKPOINT_PATH``, else ``STRATAGEM_CHECKPOINT_DIR``."""
    return _str(("ADAPTDL_CHECKPOINT_PATH", "STRATAGEM_CHECKPOINT_DIR"))


def share_path() -> str | None:
    """A directory shared by all replicas (``ADAPTDL_SHARE_PATH``), or None."""
    return _str(("ADAPTDL_SHARE_PATH",))


def job_id() -> str | None:
    """The job id: ``ADAPTDL_JOB_ID``, else Stratagem's or torch elastic's run id."""
    return _str(("ADAPTDL_JOB_ID", "STRATAGEM_JOB_ID", "TORCHELASTIC_RUN_ID"))


def master_addr() -> str:
    """Address of the rank-0 replica (``ADAPTDL_MASTER_ADDR``, else ``MASTER_ADDR``)."""
    return _str(("ADAPTDL_MASTER_ADDR", "MASTER_ADDR")) or "0.0.0.0"


def master_port() -> int:
    """Port of the rank-0 replica (``ADAPTDL_MASTER_PORT``, else ``MASTER_PORT``), or 0."""
    return _int(("ADAPTDL_MASTER_PORT", "MASTER_PORT"), 0)


def replica_rank() -> int:
    """This replica's rank (``ADAPTDL_REPLICA_RANK``, else ``RANK``), or 0."""
    return _int(("ADAPTDL_REPLICA_RANK", "RANK"), 0)


def num_replicas() -> int:
    """Number of replicas (``ADAPTDL_NUM_REPLICAS``, else ``WORLD_SIZE``), or 1."""
    return _int(("ADAPTDL_NUM_REPLICAS", "WORLD_SIZE"), 1)


def num_nodes() -> int:
    """Number of nodes (``ADAPTDL_NUM_NODES``; under torch elastic, replicas divided by
    replicas per node); as in AdaptDL, :func:`num_replicas` when unknown."""
    if os.environ.get("ADAPTDL_NUM_NODES"):
        return int(os.environ["ADAPTDL_NUM_NODES"])
    if not os.environ.get("ADAPTDL_NUM_REPLICAS") and os.environ.get("LOCAL_WORLD_SIZE"):
        per_node = max(1, int(os.environ["LOCAL_WORLD_SIZE"]))
        return max(1, -(-num_replicas() // per_node))
    return num_replicas()


def num_restarts() -> int:
    """How often the job restarted (``ADAPTDL_NUM_RESTARTS``, else torch elastic's count)."""
    return _int(("ADAPTDL_NUM_RESTARTS", "TORCHELASTIC_RESTART_COUNT"), 0)


def supervisor_url() -> str | None:
    """URL of an AdaptDL supervisor (``ADAPTDL_SUPERVISOR_URL``); Stratagem ignores it."""
    return _str(("ADAPTDL_SUPERVISOR_URL",))


def adaptdl_sched_version() -> str | None:
    return _str(("ADAPTDL_SCHED_VERSION",))


def from_ray() -> bool:
    """AdaptDL's Ray Tune integration is not supported: always False."""
    return False


__all__ = [
    "adaptdl_sched_version",
    "checkpoint_path",
    "from_ray",
    "job_id",
    "master_addr",
    "master_port",
    "num_nodes",
    "num_replicas",
    "num_restarts",
    "replica_rank",
    "share_path",
    "supervisor_url",
]

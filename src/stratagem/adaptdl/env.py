"""AdaptDL's ``adaptdl.env``: the job's environment, read from ``ADAPTDL_*`` variables.

Each function reads its AdaptDL variable first and, when it is unset, falls back to what
torch elastic (``torchrun``, ``stratagem run``) and Stratagem set, so an AdaptDL script
runs unchanged under either launcher. The variables and their fallbacks are defined once,
in :mod:`stratagem.env`; these are AdaptDL's names for those accessors.
"""

from __future__ import annotations

from stratagem import env as _env

checkpoint_path = _env.adaptdl_checkpoint_path
share_path = _env.adaptdl_share_path
job_id = _env.adaptdl_job_id
master_addr = _env.adaptdl_master_addr
master_port = _env.adaptdl_master_port
replica_rank = _env.adaptdl_replica_rank
num_replicas = _env.adaptdl_num_replicas
num_nodes = _env.adaptdl_num_nodes
num_restarts = _env.adaptdl_num_restarts
supervisor_url = _env.adaptdl_supervisor_url
adaptdl_sched_version = _env.adaptdl_sched_version


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

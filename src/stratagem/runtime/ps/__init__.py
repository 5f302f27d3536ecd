"""The parameter-server runtime (see docs/concepts/parameter-server.md).

``plan`` (pieces, owners, buckets) -> ``cluster`` (logical ranks, gloo groups) ->
``engine`` (dense buckets, sparse rows, owner-side optimizers, the server loop).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from stratagem.errors import DistributedError, StrategyError
from stratagem.runtime.ps.cluster import (
    ENV_ROLE,
    Cluster,
    Layout,
    cluster_from_default_group,
    join_cluster,
)
from stratagem.runtime.stats import CommStats

__all__ = ["ENV_ROLE", "Cluster", "Layout", "join_cluster", "make_engine", "run_server"]


def _optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    if optimizer is None:
        return []
    if isinstance(optimizer, torch.optim.Optimizer):
        return [optimizer]
    if isinstance(optimizer, Sequence) and all(
            isinstance(o, torch.optim.Optimizer) for o in optimizer):
        return list(optimizer)
    raise StrategyError(f"expected a torch.optim.Optimizer or a list of them, got "
                        f"{type(optimizer).__name__}", where="parameter-server runtime",
                        fix="pass the optimizer(s) built over the model's parameters")


_DEFAULT_CLUSTERS: dict[tuple, Cluster] = {}


def _cluster_for(plan: Any, cluster: Cluster | None, process_group: Any) -> Cluster:
    ps = plan.ps
    if cluster is None:
        if ps.servers:
            raise DistributedError(
                f"the strategy uses dedicated servers {list(ps.servers)} but no cluster was "
                "given", where="parameter-server runtime",
                fix="start the job with AutoDist (or join_cluster) so servers can join")
        import torch.distributed as dist

        if not dist.is_initialized():
            raise DistributedError(
                f"the plan is for {plan.world_size} replicas but torch.distributed is not "
                "initialized", where="DistributedModel",
                fix="launch with `stratagem run` or torchrun (or call "
                    "torch.distributed.init_process_group first)")
        key = (id(process_group), ps.replicas)
        cluster = _DEFAULT_CLUSTERS.get(key)
        if cluster is None:
            cluster = cluster_from_default_group(ps.replicas, process_group)
            _DEFAULT_CLUSTERS[key] = cluster
    if cluster.rank != plan.rank or cluster.size != ps.size:
        raise DistributedError(
            f"the plan is for rank {plan.rank} of {ps.size} PS ranks, but this process is "
            f"rank {cluster.rank} of {cluster.size}", where="parameter-server runtime",
            fix="compile the plan with the cluster's rank and servers")
    return cluster


def make_engine(plan: Any, module: nn.Module, optimizer: Any, cluster: Cluster | None,
                process_group: Any, stats: CommStats) -> Any:
    """The PS engine of a worker (called by DistributedModel)."""
    return _engine_class(plan)(plan, module, _optimizers(optimizer),
                               _cluster_for(plan, cluster, process_group), stats)


def _engine_class(plan: Any) -> type:
    if plan.ps.sync and not plan.ps.staleness:
        from stratagem.runtime.ps.engine import PSEngine

        return PSEngine
    from stratagem.runtime.ps.consistency import AsyncEngine

    return AsyncEngine


def run_server(module: nn.Module, plan: Any, optimizer: Any, cluster: Cluster) -> CommStats:
    """Serve as dedicated parameter server ``plan.rank`` until the chief sends STOP.

    ``module`` and ``optimizer`` are built by the same code as on the workers (shapes and
    hyperparameters must match; the values come from worker 0). Returns the server's
    traffic counters.
    """
    if plan.ps is None or plan.role != "server":
        raise StrategyError(f"rank {plan.rank} is not a parameter server in this plan",
                            where="run_server", fix="compile the plan with a server rank")
    stats = CommStats()
    engine = _engine_class(plan)(plan, module, _optimizers(optimizer),
                                 _cluster_for(plan, cluster, None), stats)
    engine.serve()
    return stats

"""Parallax: dense parameters all-reduced, sparsely accessed ones on parameter servers.

After Parallax (Kim et al., EuroSys 2019, arXiv:1808.02621) as AutoDist builds it: a PS
suits sparse updates (each step touches a few rows of an embedding table), all-reduce suits
dense ones. See docs/reference/ps-builders.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from stratagem.analysis.profile import ModelProfile, ParamInfo
from stratagem.errors import StrategyError
from stratagem.resource import ResourceSpec
from stratagem.strategy.builders.base import register
from stratagem.strategy.builders.ps import (
    Placer,
    check_ps_options,
    largest_first,
    partitionable,
    ps_node,
    ps_servers,
)
from stratagem.strategy.schema import (
    ENGINES,
    AllReduceSynchronizer,
    GraphConfig,
    NodeConfig,
    PSSynchronizer,
    Strategy,
)


def sparse_access(info: ParamInfo) -> bool:
    """Whether Parallax treats ``info`` as sparse (parameter-server) rather than dense.

    True for a parameter whose gradient is sparse (``info.sparse``: every user is an
    ``nn.Embedding``/``nn.EmbeddingBag`` with ``sparse=True``), and for an untied embedding
    table with ``sparse=False``: its gradient is materialized densely but is non-zero only in
    the rows looked up this step, which is the access pattern Parallax sends to servers (in
    AutoDist's TensorFlow, an embedding gradient is always ``IndexedSlices``). A tied
    embedding without sparse gradients (``info.aliases``, e.g. shared with an output
    ``nn.Linear``) stays dense: the other user writes every row, so all-reduce is cheaper.
    """
    return info.sparse_access


@register("Parallax")
@dataclass(frozen=True)
class Parallax:
    """Dense parameters -> AllReduce, group ``dense_index // chunk_size`` (dense_index counts
    only the dense parameters, in profile order); sparse ones (:func:`sparse_access`) ->
    parameter servers, load-balanced by bytes and split along axis 0 into
    ``min(servers, rows)`` parts when there are several servers. ``engine``: who runs the
    all-reduce groups (``stratagem`` or torch's ``ddp`` reducer)."""

    chunk_size: int = 128
    local_proxy_variable: bool = False
    sync: bool = True
    staleness: int = 0
    engine: str = "stratagem"

    def __post_init__(self) -> None:
        if not isinstance(self.chunk_size, int) or isinstance(self.chunk_size, bool) \
                or self.chunk_size < 1:
            raise StrategyError(f"chunk_size must be an integer >= 1, got {self.chunk_size!r}",
                                fix="use a positive number of parameters per group, e.g. 128")
        check_ps_options(self.local_proxy_variable, self.sync, self.staleness)
        if self.engine not in ENGINES:
            raise StrategyError(f"unknown engine {self.engine!r}",
                                fix=f"use one of {', '.join(ENGINES)}")

    def build(self, profile: ModelProfile, spec: ResourceSpec) -> Strategy:
        params = list(profile.params)
        nodes: dict[str, NodeConfig] = {}
        dense = [p for p in params if not sparse_access(p)]
        for i, info in enumerate(dense):
            nodes[info.name] = NodeConfig(
                var_name=info.name,
                synchronizer=AllReduceSynchronizer(group=i // self.chunk_size,
                                                   engine=self.engine))
        placer = Placer(ps_servers(spec))
        make = PSSynchronizer(local_replication=self.local_proxy_variable, sync=self.sync,
                              staleness=self.staleness)
        for info in largest_first([p for p in params if sparse_access(p)]):
            if partitionable(info, len(placer.servers)):
                pieces = placer.even(info.shape[0], info.bytes // info.shape[0])
            else:
                pieces = placer.whole(info.bytes)
            nodes[info.name] = ps_node(info, pieces, placer, make)
        return Strategy(node_config=tuple(nodes[p.name] for p in params),
                        graph_config=GraphConfig(tuple(spec.replicas)),
                        builder=type(self).__name__)

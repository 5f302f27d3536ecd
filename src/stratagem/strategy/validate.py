"""Check a Strategy against a model profile and resource spec before training starts."""

from __future__ import annotations

import difflib

from stratagem.analysis.profile import ModelProfile, ParamInfo
from stratagem.errors import StrategyError
from stratagem.resource import ResourceSpec
from stratagem.strategy.compressors import check_compressor
from stratagem.strategy.schema import (
    ALL_REDUCE_SPECS,
    ENGINES,
    MAX_GROUP,
    MAX_POWERSGD_RANK,
    MAX_PREFETCH,
    MAX_STALENESS,
    SHARD_STAGES,
    AllReduceSynchronizer,
    NodeConfig,
    PSSynchronizer,
    ShardedSynchronizer,
    Strategy,
)


def server_devices(spec: ResourceSpec) -> list[str]:
    """Dedicated parameter-server devices: one per node that runs no worker."""
    return [f"{n.address}:PS:0" for n in spec.nodes if n.workers == 0]


def validate(strategy: Strategy, profile: ModelProfile, spec: ResourceSpec) -> Strategy:
    """Return ``strategy`` (replicas filled in from ``spec`` if empty) or raise StrategyError."""
    replicas = list(strategy.graph_config.replicas)
    if not replicas:
        strategy = strategy.with_replicas(spec.replicas)
    elif replicas != spec.replicas:
        raise StrategyError(
            f"graph_config.replicas {replicas} do not match the resource spec's workers "
            f"{spec.replicas}",
            where=f"strategy {strategy.id}",
            fix="rebuild the strategy for these resources, or empty graph_config.replicas",
        )
    destinations = set(spec.replicas) | set(server_devices(spec))
    by_name = {nc.var_name: nc for nc in strategy.node_config}
    if len(by_name) != len(strategy.node_config):
        dup = next(n for n in by_name if sum(c.var_name == n for c in strategy.node_config) > 1)
        raise StrategyError(f"parameter {dup!r} is configured twice",
                            where=f"strategy {strategy.id}", fix="keep one entry per parameter")
    known = {p.name for p in profile.params} | {a for p in profile.params for a in p.aliases}
    for name in by_name:
        if name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise StrategyError(
                f"unknown parameter {name!r}", where=f"strategy {strategy.id}",
                fix=f"{hint}names come from model.named_parameters() (trainable ones only)")
    for info in profile.params:
        names = [n for n in (info.name, *info.aliases) if n in by_name]
        if len(names) > 1:  # a tied parameter listed under two of its names
            raise StrategyError(
                f"parameter {info.name!r} is configured twice (as {' and '.join(names)}; "
                "they are one tied tensor)", where=f"strategy {strategy.id}",
                fix="keep one entry per parameter")
        nc = by_name[names[0]] if names else None
        if nc is None:
            raise StrategyError(
                f"parameter {info.name!r} has no config", where=f"strategy {strategy.id}",
                fix="add a node_config entry for it, or rebuild the strategy for this model")
        _check_node(nc, info, destinations)
    check_engines(strategy)
    check_sharded_units(strategy, profile)
    return strategy


def unit_of(name: str, sync: ShardedSynchronizer) -> str:
    """The module a stage-3 parameter is sharded with: ``sync.unit``, or its own module."""
    return sync.unit if sync.unit else name.rpartition(".")[0]


def _under(name: str, unit: str) -> bool:
    return unit == "" or name.startswith(unit + ".")


def check_sharded_units(strategy: Strategy, profile: ModelProfile) -> None:
    """Every trainable parameter under a stage-3 unit must be sharded with it: FSDP2 shards
    a module's parameters together, so one that another synchronizer (or another unit)
    owns would be owned twice. Refuses the first such parameter, naming it."""
    by_name = {nc.var_name: nc for nc in strategy.node_config}
    units: dict[str, tuple[str, ShardedSynchronizer]] = {}
    for nc in strategy.node_config:
        s = nc.synchronizer
        if isinstance(s, ShardedSynchronizer) and s.stage == 3:
            units.setdefault(unit_of(nc.var_name, s), (nc.var_name, s))
    for unit, (first, sync) in units.items():
        for info in profile.params:
            names = [n for n in (info.name, *info.aliases) if _under(n, unit)]
            if not names:
                continue
            nc = next((by_name[n] for n in (info.name, *info.aliases) if n in by_name), None)
            other = nc.synchronizer if nc is not None else None
            same = (isinstance(other, ShardedSynchronizer) and other.stage == 3
                    and unit_of(nc.var_name, other) == unit
                    and (other.reshard_after_forward, other.prefetch)
                    == (sync.reshard_after_forward, sync.prefetch))
            if not same:
                what = _describe(other, nc.var_name if nc else info.name)
                raise StrategyError(
                    f"parameter {names[0]!r} is inside the sharded unit {unit or '(root)'!r} "
                    f"(stage 3, from {first!r}) but is {what}: it would be owned twice",
                    where=f"node_config[{nc.var_name if nc else info.name}]",
                    fix=f"give {names[0]!r} the same Sharded synchronizer (stage 3, unit "
                        f"{unit!r}, same options), or choose a unit that does not contain it")
            outside = [n for n in (info.name, *info.aliases) if not _under(n, unit)]
            if outside:
                raise StrategyError(
                    f"parameter {info.name!r} is tied: {outside[0]!r} lies outside the "
                    f"sharded unit {unit or '(root)'!r}", where=f"node_config[{nc.var_name}]",
                    fix="choose a unit that contains every module sharing the parameter, "
                        "or shard it at stage 1 or 2")


def _describe(sync: object, name: str) -> str:
    if isinstance(sync, ShardedSynchronizer):
        if sync.stage != 3:
            return f"sharded at stage {sync.stage}"
        return (f"sharded with unit {unit_of(name, sync)!r}, "
                f"reshard_after_forward={sync.reshard_after_forward}, "
                f"prefetch={sync.prefetch}")
    if isinstance(sync, AllReduceSynchronizer):
        return "synchronized by AllReduce"
    if isinstance(sync, PSSynchronizer):
        return f"owned by the parameter server {sync.reduction_destination}"
    return "partitioned"


def _check_node(nc: NodeConfig, info: ParamInfo, destinations: set[str]) -> None:
    where = f"node_config[{nc.var_name}]"
    if nc.partitioner is None:
        if nc.part_config:
            raise StrategyError("part_config without a partitioner", where=where,
                                fix='add a partitioner, e.g. "2,1", or drop part_config')
        _check_sync(nc, info, destinations, where)
        return
    part = nc.partitioner
    if nc.synchronizer is not None:
        raise StrategyError("a partitioned parameter has a synchronizer of its own",
                            where=where, fix="put the synchronizers in part_config, one per "
                            "part, and remove the parameter-level one")
    if len(part.splits) != len(info.shape):
        raise StrategyError(
            f"partitioner {part} has {len(part.splits)} axes but the parameter has shape "
            f"{list(info.shape)}", where=where, fix="give one split count per axis")
    dim = info.shape[part.axis]
    if part.num_parts > dim:
        raise StrategyError(f"cannot split axis {part.axis} of size {dim} into "
                            f"{part.num_parts} parts", where=where,
                            fix=f"use at most {dim} parts")
    sizes = part.part_sizes(info.shape)
    if len(sizes) != part.num_parts or sum(sizes) != dim or min(sizes) < 1:
        raise StrategyError(f"part_sizes {sizes} must be {part.num_parts} positive lengths "
                            f"summing to {dim}", where=where, fix="fix part_sizes")
    if len(nc.part_config) != part.num_parts:
        raise StrategyError(f"{part.num_parts} parts but {len(nc.part_config)} part_config "
                            "entries", where=where, fix="give one config per part")
    for i, pc in enumerate(nc.part_config):
        if pc.var_name != f"{nc.var_name}/part_{i}":
            raise StrategyError(f"part {i} is named {pc.var_name!r}",
                                where=f"{where}.part_config[{i}]",
                                fix=f"name it {nc.var_name}/part_{i} (parts are "
                                "NAME/part_INDEX, in order)")
        if pc.partitioner is not None:
            raise StrategyError("nested partitioning", where=f"{where}.part_config[{i}]",
                                fix="partition the parameter once")
        _check_sync(pc, info, destinations, f"{where}.part_config[{i}]", part=True)


def _check_sync(nc: NodeConfig, info: ParamInfo, destinations: set[str], where: str,
                part: bool = False) -> None:
    s = nc.synchronizer
    if s is None:
        raise StrategyError("no synchronizer", where=where, fix="add one, e.g. {type: AllReduce}")
    if isinstance(s, AllReduceSynchronizer):
        check_compressor(s.compressor, s.powersgd_rank, info.sparse, where)
        if s.spec not in ALL_REDUCE_SPECS:
            raise StrategyError(f"unknown all-reduce spec {s.spec!r}", where=where,
                                fix=f"use one of {', '.join(ALL_REDUCE_SPECS)}")
        if s.group < 0:
            raise StrategyError(f"negative group {s.group}", where=where, fix="use group >= 0")
        if s.group > MAX_GROUP or s.powersgd_rank > MAX_POWERSGD_RANK:
            raise StrategyError(f"group {s.group} or powersgd_rank {s.powersgd_rank} too large",
                                where=where, fix=f"use a group up to {MAX_GROUP} and a "
                                                 f"powersgd_rank up to {MAX_POWERSGD_RANK}")
        if s.gather_rows:
            check_gather_rows(s, info, where, partitioned=part)
        check_engine(s, info, where, partitioned=part)
    elif isinstance(s, PSSynchronizer):
        if s.reduction_destination not in destinations:
            raise StrategyError(
                f"unknown reduction_destination {s.reduction_destination!r}", where=where,
                fix=f"use a worker replica or server of the resource spec: "
                    f"{sorted(destinations)}")
        if s.staleness < 0:
            raise StrategyError(f"negative staleness {s.staleness}", where=where,
                                fix="use 0 for bulk-synchronous training")
        if s.staleness > MAX_STALENESS:
            raise StrategyError(f"staleness {s.staleness} is too large", where=where,
                                fix=f"use at most {MAX_STALENESS}")
        if not s.sync and s.staleness:
            raise StrategyError("staleness applies only to synchronous PS (sync: true)",
                                where=where, fix="set staleness: 0 for asynchronous training")
        if s.row_sparse:
            check_row_sparse(s, info, where)
    elif isinstance(s, ShardedSynchronizer):
        check_sharded(s, info, where, partitioned=part)


def check_sharded(sync: ShardedSynchronizer, info: ParamInfo, where: str,
                  partitioned: bool) -> None:
    """A Sharded synchronizer must be runnable: a known stage, a whole dense parameter, a
    unit (stage 3 only) that contains the parameter."""
    if sync.stage not in SHARD_STAGES:
        raise StrategyError(f"unknown sharding stage {sync.stage}", where=where,
                            fix="use stage 1 (optimizer state), 2 (+ gradients) or 3 "
                                "(+ parameters)")
    if not 0 <= sync.prefetch <= MAX_PREFETCH:
        raise StrategyError(f"prefetch {sync.prefetch} out of range", where=where,
                            fix=f"use 0 to {MAX_PREFETCH} units")
    if partitioned:
        raise StrategyError(f"a Sharded synchronizer on a part of {info.name!r}", where=where,
                            fix="shard the whole parameter (sharding splits it already)")
    if info.sparse:
        raise StrategyError(f"sharding {info.name!r}, whose gradient is sparse", where=where,
                            fix="all-reduce it (gather_rows) or send its rows to parameter "
                                "servers")
    if sync.stage != 3 and sync.unit:
        raise StrategyError(f"unit {sync.unit!r} at stage {sync.stage}", where=where,
                            fix="units apply to stage 3 (parameters gathered per unit); "
                                "drop unit, or use stage 3")
    if sync.stage == 3 and sync.unit and not any(
            n.startswith(sync.unit + ".") for n in (info.name, *info.aliases)):
        raise StrategyError(f"unit {sync.unit!r} does not contain {info.name!r}", where=where,
                            fix="name a module the parameter belongs to (a prefix of its "
                                "name), or leave unit empty for its own module")


def check_gather_rows(sync: AllReduceSynchronizer, info: ParamInfo, where: str,
                      partitioned: bool) -> None:
    """A ``gather_rows`` all-reduce must be runnable: a whole parameter whose gradient is
    sparse (declared so), sent uncompressed."""
    if not info.sparse:
        raise StrategyError(
            f"gather_rows on {info.name!r}: its gradient is dense (only a sparse gradient, "
            "nn.Embedding(sparse=True)'s, comes as rows)", where=where,
            fix="drop gather_rows, or send its touched rows to parameter servers "
                "(PS with row_sparse: true)")
    if partitioned:
        raise StrategyError(f"gather_rows on a part of {info.name!r}", where=where,
                            fix="gather the rows of the whole parameter (no partitioner)")
    if sync.compressor != "none":
        raise StrategyError(f"gather_rows with compressor {sync.compressor!r}", where=where,
                            fix="use compressor none for gathered rows")


def check_row_sparse(sync: PSSynchronizer, info: ParamInfo, where: str) -> None:
    """A ``row_sparse`` synchronizer must be runnable: rows of a matrix, and unless the
    parameter is pulled through its own untied embedding module, kept on every worker."""
    if not info.shape or info.numel == 0:
        raise StrategyError(f"row_sparse on {info.name!r} of shape {list(info.shape)}: it "
                            "has no rows", where=where,
                            fix="drop row_sparse for scalars and empty parameters")
    pulled = info.sparse or (info.embedding_like and not info.aliases)
    if not pulled and not sync.local_replication:
        raise StrategyError(
            f"row_sparse on {info.name!r} needs local_replication: it is not the weight of an "
            "untied nn.Embedding, so its rows cannot be pulled on demand", where=where,
            fix="set local_replication: true (the owner sends updated rows to every worker)")


DDP_COMPRESSORS = ("none", "fp16", "bf16", "powersgd")
"""What the ``ddp`` engine compresses with: torch's own communication hooks."""


def check_engine(sync: AllReduceSynchronizer, info: ParamInfo, where: str,
                 partitioned: bool) -> None:
    """An all-reduce synchronizer's engine must exist and, for ``ddp``, fit DDP's reducer:
    whole dense parameters whose gradients torch's hooks can compress."""
    if sync.engine not in ENGINES:
        raise StrategyError(f"unknown engine {sync.engine!r} on {info.name!r}", where=where,
                            fix=f"use one of {', '.join(ENGINES)}")
    if sync.engine != "ddp":
        return
    fix = "use engine: stratagem for this model's all-reduce synchronizers"
    if partitioned:
        raise StrategyError(f"engine ddp on a part of {info.name!r}: DDP's reducer "
                            "reduces whole parameters", where=where,
                            fix=f"all-reduce the whole parameter (no partitioner), or {fix}")
    if sync.gather_rows:
        raise StrategyError(f"engine ddp with gather_rows on {info.name!r}", where=where,
                            fix=f"drop gather_rows, or {fix}")
    if info.sparse:
        raise StrategyError(f"engine ddp on {info.name!r}, whose gradient is sparse: torch's "
                            "communication hooks take dense buckets", where=where,
                            fix=f"send its rows to parameter servers (PS), or {fix}")
    if sync.compressor not in DDP_COMPRESSORS:
        raise StrategyError(f"engine ddp with compressor {sync.compressor!r} on "
                            f"{info.name!r}", where=where,
                            fix=f"use one of {', '.join(DDP_COMPRESSORS)} (torch's hooks), "
                                f"or {fix}")


def check_engines(strategy: Strategy) -> None:
    """Across the model: DDP's reducer runs every all-reduce synchronizer or none of them
    (the two reducers would each own a share of the backward pass and of its collectives),
    with one compressor (DDP takes one communication hook per model)."""
    syncs = [(leaf.var_name, leaf.synchronizer) for nc in strategy.node_config
             for leaf in nc.leaves() if isinstance(leaf.synchronizer, AllReduceSynchronizer)]
    ddp = [(n, s) for n, s in syncs if s.engine == "ddp"]
    if not ddp:
        return
    where = f"strategy {strategy.id}"
    first_name, first = ddp[0]
    sharded = next((leaf.var_name for nc in strategy.node_config for leaf in nc.leaves()
                    if isinstance(leaf.synchronizer, ShardedSynchronizer)), None)
    if sharded is not None:
        raise StrategyError(
            f"parameter {sharded!r} is sharded while {first_name!r} runs on engine 'ddp'",
            where=where, fix="use engine: stratagem for the all-reduce groups of a model "
                             "with sharded parameters (DDP's reducer would own their "
                             "gradients too)")
    for name, s in syncs:
        if s.engine != "ddp":
            raise StrategyError(
                f"parameter {name!r} runs on engine {s.engine!r} but {first_name!r} on "
                "'ddp'", where=where,
                fix="give every AllReduce synchronizer of the model the same engine "
                    "(parameter-server synchronizers may stay)")
        for attr in ("compressor", "powersgd_rank", "spec"):
            if getattr(s, attr) != getattr(first, attr):
                raise StrategyError(
                    f"engine ddp: parameter {name!r} has {attr} {getattr(s, attr)!r} but "
                    f"{first_name!r} has {getattr(first, attr)!r}", where=where,
                    fix=f"use one {attr} for every AllReduce synchronizer on engine ddp "
                        "(DDP runs one communication hook), or engine: stratagem")

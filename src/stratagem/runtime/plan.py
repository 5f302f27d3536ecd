"""Compile a :class:`Strategy` into one rank's :class:`Plan`.

A plan is plain data: the all-reduce groups in the order they are launched, each with its
backend, compressor and members (whole parameters, or slices of a partitioned parameter
along its partition axis) laid out in one flat buffer. Compiling checks everything the
runtime relies on, so an unrunnable strategy fails here, before any process group exists.
"""

from __future__ import annotations

import difflib
from dataclasses import asdict, dataclass, field
from math import prod
from typing import Any

import torch

from stratagem.analysis.profile import ModelProfile, ParamInfo
from stratagem.errors import StrategyError
from stratagem.runtime.ps.plan import (
    PSPiece,
    PSPlan,
    make_buckets,
    owner_of,
    uses_sparse_path,
)
from stratagem.strategy.compressors import check_compressor
from stratagem.strategy.schema import (
    ALL_REDUCE_SPECS,
    MAX_GROUP,
    AllReduceSynchronizer,
    NodeConfig,
    PSSynchronizer,
    ShardedSynchronizer,
    Strategy,
)
from stratagem.strategy.validate import (
    check_engine,
    check_engines,
    check_gather_rows,
    check_row_sparse,
    check_sharded,
    check_sharded_units,
    unit_of,
)

BACKENDS = ("gloo", "nccl")
STAGE1_GROUP = MAX_GROUP + 1
"""The all-reduce group of stage-1 parameters' gradients (beyond any strategy's group ids)."""


@dataclass(frozen=True)
class Owned:
    """A stage-1 or stage-2 parameter and the worker that updates it (holds its state)."""

    param: str
    stage: int
    owner: int
    numel: int


@dataclass(frozen=True)
class UnitPlan:
    """A stage-3 unit: the module torch's FSDP2 shards as one piece, and its options."""

    module: str
    params: tuple[str, ...]
    reshard_after_forward: bool
    prefetch: int


@dataclass(frozen=True)
class ShardPlan:
    """The sharded parameters of a plan (docs/concepts/sharding.md)."""

    owned: tuple[Owned, ...] = ()
    units: tuple[UnitPlan, ...] = ()
    places: tuple[tuple[str, int, tuple[int, ...], int], ...] = ()
    """(param, index, shape, bytes) of every sharded parameter, for :meth:`Plan.routes`."""

    def owned_by(self, rank: int) -> list[Owned]:
        return [o for o in self.owned if o.owner == rank]

    @property
    def unit_params(self) -> set[str]:
        return {p for u in self.units for p in u.params}

    def summary_lines(self) -> list[str]:
        lines = []
        for o in self.owned:
            lines.append(f"  sharded stage {o.stage}: {o.param} ({o.numel:,} values) "
                         f"updated by rank {o.owner}")
        for u in self.units:
            lines.append(f"  sharded stage 3 unit {u.module or '(root)'}: {len(u.params)} "
                         f"parameters (reshard_after_forward={u.reshard_after_forward}, "
                         f"prefetch={u.prefetch})")
        return lines


def assign_owners(sizes: list[tuple[str, int, int]], world_size: int) -> tuple[Owned, ...]:
    """Whole parameters to workers, largest first to the least loaded (ties: lowest rank),
    so each holds about 1/world of the optimizer state. ``sizes``: (param, stage, numel)."""
    load = [0] * world_size
    out = {}
    for name, stage, numel in sorted(sizes, key=lambda t: (-t[2], t[0])):
        owner = min(range(world_size), key=lambda r: (load[r], r))
        load[owner] += numel
        out[name] = Owned(param=name, stage=stage, owner=owner, numel=numel)
    return tuple(out[name] for name, _, _ in sizes)


@dataclass(frozen=True)
class DDPOptions:
    """The ``DistributedDataParallel`` options the ``ddp`` engine runs with, and why.

    ``gradient_as_bucket_view``: ``.grad`` lives in the buckets (no copy in or back).
    ``batched_grad_copy``: one copy and one scale per bucket, not per parameter (where a
    ``.grad`` is not yet a bucket view, e.g. after ``zero_grad(set_to_none=True)``).
    ``static_graph`` and ``find_unused_parameters`` stay off: the first would fix the set
    of parameters used in the first step (gradient accumulation, models that skip a
    branch), the second costs a graph traversal per step; a parameter left without a
    gradient is refused with a StratagemError instead. Buffers are kept equal by this
    runtime, not by DDP's broadcast before every forward (so an eval forward on one rank
    stays local), and parameters are not broadcast again (the model did).
    """

    gradient_as_bucket_view: bool = True
    batched_grad_copy: bool = True
    static_graph: bool = False
    find_unused_parameters: bool = False

    def describe(self) -> str:
        on = [k for k, v in asdict(self).items() if v]
        off = [k for k, v in asdict(self).items() if not v]
        return f"on: {', '.join(on) or 'none'}; off: {', '.join(off) or 'none'}"


DDP_OPTIONS = DDPOptions()


def hook_rule(compressor: str) -> str:
    """How the ddp engine reduces a group with ``compressor`` (the plan summary says it)."""
    cpp = {"none": "DDP's own C++ all-reduce, no comm hook (as plain DDP)",
           "fp16": "torch's built-in C++ FP16_COMPRESS hook"}.get(compressor)
    py = {"none": "allreduce_hook", "fp16": "fp16_compress_hook",
          "bf16": "bf16_compress_hook", "powersgd": "powerSGD_hook"}.get(compressor, compressor)
    if cpp is None:
        return f"torch's Python {py} (no C++ version)"
    return (f"{cpp}; torch's Python {py} instead while gradient observers (the adaptive "
            "loop's statistics) watch the buckets")


@dataclass(frozen=True)
class Member:
    """One gradient piece in a group's flat buffer.

    ``axis`` None: the whole parameter (``start``/``length`` then span its flattened
    elements). Otherwise the slice ``[start, start+length)`` along ``axis`` (part ``part``).
    """

    param: str
    index: int
    shape: tuple[int, ...]
    offset: int
    axis: int | None = None
    start: int = 0
    length: int = 0
    part: int | None = None

    @property
    def numel(self) -> int:
        return prod(self.shape)

    @property
    def whole(self) -> bool:
        return self.axis is None

    def describe(self) -> str:
        if self.whole:
            return f"{self.param}{list(self.shape)}"
        return (f"{self.param}[axis {self.axis}: {self.start}:{self.start + self.length}]"
                f"{list(self.shape)}")


@dataclass(frozen=True)
class GroupPlan:
    """One fused all-reduce: ``members`` packed back to back in a ``dtype`` buffer."""

    id: int
    spec: str
    backend: str
    compressor: str
    powersgd_rank: int
    dtype: str
    members: tuple[Member, ...]
    gather_rows: bool = False
    """The one member's sparse gradient is all-gathered as rows, not summed in a buffer."""
    engine: str = "stratagem"
    """Who runs it: this runtime's reducer, or torch's DDP reducer (one bucket)."""

    @property
    def numel(self) -> int:
        return sum(m.numel for m in self.members)

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=getattr(torch, self.dtype)).element_size()

    @property
    def params(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(m.param for m in self.members))


ROUTE_KINDS = ("all-reduce", "gathered rows", "PS", "PS sparse rows")
"""How a piece's gradient travels, in the words every report uses: summed by an all-reduce,
its touched rows all-gathered and summed on every worker, pushed densely to a parameter
server, or pushed to one as the rows it touched."""


@dataclass(frozen=True)
class Route:
    """One gradient piece (a whole parameter or one part) and how the plan moves it: the one
    source of the explanation's table, the per-parameter list and the picture, so the three
    say what the runtime does.

    ``unit``: the all-reduce group id, or the owner's rank, that handles the piece (-1 for a
    stage-3 shard: every worker holds a slice); ``how``: the compressor of an all-reduce,
    ``replicated``/``on demand`` for a PS piece, ``stage N`` for a sharded one (whose
    ``destination`` is its FSDP2 unit at stage 3)."""

    param: str
    index: int
    shape: tuple[int, ...]
    numel: int
    nbytes: int
    kind: str
    unit: int
    how: str
    axis: int | None = None
    start: int = 0
    length: int = 0
    part: int | None = None
    destination: str = ""

    @property
    def piece(self) -> str:
        """The part this piece is, or "" for a whole parameter."""
        if self.axis is None:
            return ""
        what = "rows" if self.axis == 0 else f"axis {self.axis}"
        return f"{what} {self.start}:{self.start + self.length}"

    def text(self) -> str:
        """The piece in words: ``all-reduce group 0 (none)``, ``rows all-gathered (group
        10004)``, ``PS sparse rows -> rank 1 (10.0.0.1:CPU:1, on demand)``."""
        if self.kind == "all-reduce":
            return f"all-reduce group {self.unit} ({self.how})"
        if self.kind == "gathered rows":
            return f"rows all-gathered, summed on every worker (group {self.unit})"
        if self.kind == "sharded":
            if self.unit < 0:
                return f"sharded {self.how}, FSDP2 unit {self.destination or '(root)'}"
            return f"sharded {self.how}, updated by rank {self.unit}"
        return f"{self.kind} -> rank {self.unit} ({self.destination}, {self.how})"


@dataclass(frozen=True)
class Plan:
    """What one rank executes: groups in launch order, parameters in profile order."""

    rank: int
    world_size: int
    device: str
    strategy_id: str
    groups: tuple[GroupPlan, ...]
    params: tuple[str, ...]
    densified: tuple[str, ...] = field(default=())  # sparse-gradient params reduced densely
    ps: PSPlan | None = None  # parameter-server pieces (None: all-reduce only)
    shards: ShardPlan | None = None  # sharded parameters (None: none)

    @property
    def role(self) -> str:
        """``worker`` (ranks below ``world_size``) or ``server`` (dedicated PS ranks)."""
        return "worker" if self.rank < self.world_size else "server"

    @property
    def engine(self) -> str:
        """``ddp`` when torch's DDP reducer runs the all-reduce groups, else ``stratagem``
        (compiling checks that one engine runs them all)."""
        return "ddp" if any(g.engine == "ddp" for g in self.groups) else "stratagem"

    @property
    def launch_order(self) -> tuple[int, ...]:
        return tuple(g.id for g in self.groups)

    @property
    def backends(self) -> tuple[str, ...]:
        return tuple(sorted({g.backend for g in self.groups}))

    def group(self, group_id: int) -> GroupPlan:
        for g in self.groups:
            if g.id == group_id:
                return g
        raise KeyError(group_id)

    def groups_of(self, param: str) -> list[GroupPlan]:
        return [g for g in self.groups if any(m.param == param for m in g.members)]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def routes(self) -> tuple[Route, ...]:
        """Every gradient piece and how it travels, in parameter then part order."""
        out = []
        for g in self.groups:
            if g.id == STAGE1_GROUP:  # stage-1 gradients: shown as the sharded pieces below
                continue
            size = torch.empty((), dtype=getattr(torch, g.dtype)).element_size()
            kind = "gathered rows" if g.gather_rows else "all-reduce"
            how = g.compressor + (f" rank {g.powersgd_rank}" if g.compressor == "powersgd"
                                  else "") + (", DDP" if g.engine == "ddp" else "")
            out += [Route(param=m.param, index=m.index, shape=m.shape, numel=m.numel,
                          nbytes=m.numel * size, kind=kind, unit=g.id, how=how, axis=m.axis,
                          start=m.start, length=m.length, part=m.part) for m in g.members]
        for p in self.ps.pieces if self.ps is not None else ():
            size = torch.empty((), dtype=getattr(torch, p.dtype)).element_size()
            out.append(Route(param=p.param, index=p.index, shape=p.shape, numel=p.numel,
                             nbytes=p.numel * size,
                             kind="PS sparse rows" if p.sparse else "PS", unit=p.owner,
                             how="replicated" if p.local_replication else "on demand",
                             axis=p.axis, start=p.start, length=p.length, part=p.part,
                             destination=p.destination))
        if self.shards is not None:
            owner = {o.param: o for o in self.shards.owned}
            unit = {p: u.module for u in self.shards.units for p in u.params}
            for name, index, shape, nbytes in self.shards.places:
                o = owner.get(name)
                out.append(Route(param=name, index=index, shape=shape,
                                 numel=prod(shape), nbytes=nbytes, kind="sharded",
                                 unit=o.owner if o else -1,
                                 how=f"stage {o.stage if o else 3}",
                                 destination="" if o else unit[name]))
        return tuple(sorted(out, key=lambda r: (r.index, r.part or 0)))

    def by_parameter(self) -> list[str]:
        """One line per parameter: how each of its pieces travels (from :meth:`routes`)."""
        pieces: dict[str, list[Route]] = {}
        for r in self.routes():
            pieces.setdefault(r.param, []).append(r)
        lines = []
        for name, rs in pieces.items():
            if len(rs) == 1 and not rs[0].piece:
                lines.append(f"  {name}: {rs[0].text()}")
            else:
                lines.append(f"  {name}: {len(rs)} parts: "
                             + "; ".join(f"{r.piece} {r.text()}" for r in rs))
        return lines

    def summary(self) -> str:
        total = sum(g.nbytes for g in self.groups)
        lines = [f"plan for rank {self.rank}/{self.world_size} on {self.device} "
                 f"(strategy {self.strategy_id}): {len(self.groups)} groups, "
                 f"{total / 2**20:.2f} MiB of gradients, launch order {list(self.launch_order)}"]
        for g in self.groups:
            comp = g.compressor + (f"(rank {g.powersgd_rank})" if g.compressor == "powersgd"
                                   else "")
            if g.engine == "ddp":
                lines.append(f"  group {g.id}: DDP bucket, {g.backend} ({g.spec}), {comp}, "
                             f"{g.dtype}, {g.numel:,} values in {len(g.members)} members")
            elif g.gather_rows:
                lines.append(f"  group {g.id}: {g.backend} ({g.spec}), rows all-gathered, "
                             f"{g.dtype}, of {g.numel:,} values")
            else:
                lines.append(f"  group {g.id}: {g.backend} ({g.spec}), {comp}, {g.dtype}, "
                             f"{g.numel:,} values in {len(g.members)} members")
            lines.extend(f"    {m.describe()} @ {m.offset}" for m in g.members)
        if self.engine == "ddp":
            lines.append("  engine: torch DistributedDataParallel, buckets = the groups in "
                         "launch order; options "
                         f"{DDP_OPTIONS.describe()}; reduced by "
                         f"{hook_rule(self.groups[0].compressor)}")
        if self.densified:
            lines.append(f"  sparse gradients reduced densely: {', '.join(self.densified)}")
        if self.ps is not None:
            lines.extend(self.ps.summary_lines())
        if self.shards is not None:
            lines.extend(self.shards.summary_lines())
        return "\n".join(lines)


def resolve_backend(spec: str, device: torch.device, where: str = "") -> str:
    """``auto`` -> nccl on CUDA, gloo otherwise; forced nccl off CUDA is an error."""
    if spec not in ALL_REDUCE_SPECS:
        raise StrategyError(f"unknown all-reduce spec {spec!r}", where=where or None,
                            fix=f"use one of {', '.join(ALL_REDUCE_SPECS)}")
    if spec == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if spec == "nccl" and device.type != "cuda":
        raise StrategyError(f"all-reduce spec 'nccl' needs CUDA tensors, but this rank's "
                            f"device is {device}", where=where or None,
                            fix="use spec 'auto' or 'gloo' for CPU training, or train on GPUs")
    return spec


def compile_plan(strategy: Strategy, profile: ModelProfile, *, rank: int, world_size: int,
                 device: torch.device, servers: tuple[str, ...] | list[str] | None = None
                 ) -> Plan:
    """Turn ``strategy`` into rank ``rank``'s plan; raises :class:`StrategyError`.

    ``world_size`` is the number of workers. ``servers`` lists the dedicated
    parameter-server devices in server-rank order (default: the strategy's ``:PS:``
    destinations, sorted); ranks ``world_size..world_size+len(servers)-1`` are servers.
    """
    device = torch.device(device)
    where = f"strategy {strategy.id}"
    configs = _configs_by_param(strategy, profile, where)
    check_engines(strategy)
    replicas = tuple(strategy.graph_config.replicas)
    if servers is None:
        servers = tuple(sorted({leaf.synchronizer.reduction_destination
                                for nc in strategy.node_config for leaf in nc.leaves()
                                if isinstance(leaf.synchronizer, PSSynchronizer)
                                and leaf.synchronizer.reduction_destination not in replicas}))
    servers = tuple(servers)
    total = world_size + len(servers)
    if world_size < 1 or not 0 <= rank < total:
        raise StrategyError(f"rank {rank} is not in a world of size {world_size}"
                            + (f" plus {len(servers)} servers" if servers else ""),
                            where=where, fix="pass 0 <= rank < world_size (+ servers)")

    pieces: dict[int, list[tuple[AllReduceSynchronizer, dict[str, Any]]]] = {}
    ps_leaves: list[tuple[PSSynchronizer, ParamInfo, int, dict[str, Any], str]] = []
    owned: list[tuple[str, int, int]] = []
    units: dict[str, tuple[ShardedSynchronizer, list[str]]] = {}
    places: list[tuple[str, int, tuple[int, ...], int]] = []
    if any(isinstance(nc.synchronizer, ShardedSynchronizer) for nc in strategy.node_config):
        check_sharded_units(strategy, profile)
    for index, info in enumerate(profile.params):
        nc = configs[info.name]
        nwhere = f"node_config[{nc.var_name}]"
        if isinstance(nc.synchronizer, ShardedSynchronizer) and nc.partitioner is None:
            sync = nc.synchronizer
            check_sharded(sync, info, nwhere, partitioned=False)
            places.append((info.name, index, tuple(info.shape), info.bytes))
            if sync.stage == 3:
                units.setdefault(unit_of(nc.var_name, sync), (sync, []))[1].append(info.name)
                continue
            owned.append((info.name, sync.stage, info.numel))
            if sync.stage == 2:
                continue
            # Stage 1: the gradient is all-reduced (one group of its own), then only its
            # owner updates it.
            sync = AllReduceSynchronizer(group=STAGE1_GROUP)
            pieces.setdefault(sync.group, []).append(
                (sync, {"param": info.name, "index": index, "shape": info.shape, "start": 0,
                        "length": info.numel}))
            continue
        leaves = _pieces(nc, info, nwhere)
        kinds = {type(sync) for sync, _ in leaves}
        if len(kinds) > 1:
            raise StrategyError("the parts of one parameter mix AllReduce and PS "
                                "synchronizers", where=nwhere,
                                fix="give all parts of a parameter the same kind of "
                                    "synchronizer")
        for sync, piece in leaves:
            if isinstance(sync, PSSynchronizer):
                ps_leaves.append((sync, info, index, piece, nwhere))
                continue
            if sync.gather_rows:
                check_gather_rows(sync, info, nwhere, partitioned="axis" in piece)
            check_engine(sync, info, nwhere, partitioned="axis" in piece)
            check_compressor(sync.compressor, sync.powersgd_rank, info.sparse, nwhere)
            pieces.setdefault(sync.group, []).append(
                (sync, {"param": info.name, "index": index, **piece}))

    groups = []
    for gid, entries in pieces.items():
        first = entries[0][0]
        for sync, _ in entries:
            for attr in ("spec", "compressor", "powersgd_rank", "gather_rows", "engine"):
                if getattr(sync, attr) != getattr(first, attr):
                    raise StrategyError(
                        f"group {gid} mixes {attr} {getattr(first, attr)!r} and "
                        f"{getattr(sync, attr)!r}", where=where,
                        fix="give each combination of spec/compressor/gather_rows/engine "
                            "its own group id")
        if first.gather_rows and len(entries) > 1:
            raise StrategyError(
                f"group {gid} gathers the rows of {len(entries)} parameters", where=where,
                fix="give each parameter whose rows are gathered its own group id")
        backend = resolve_backend(first.spec, device, f"{where}: group {gid}")
        dtypes = [getattr(torch, profile.params[e["index"]].dtype) for _, e in entries]
        dtype = dtypes[0]
        for d in dtypes[1:]:
            dtype = torch.promote_types(dtype, d)
        members, offset = [], 0
        for _, e in entries:
            m = Member(offset=offset, **e)
            members.append(m)
            offset += m.numel
        groups.append(GroupPlan(id=gid, spec=first.spec, backend=backend,
                                compressor=first.compressor,
                                powersgd_rank=first.powersgd_rank,
                                dtype=str(dtype).removeprefix("torch."),
                                members=tuple(members), gather_rows=first.gather_rows,
                                engine=first.engine))
    # Launch order = expected gradient-ready order: backward produces gradients roughly in
    # reverse registration order, and a group is ready once its earliest parameter is.
    groups.sort(key=lambda g: (-min(m.index for m in g.members), g.id))
    ar_params = {m.param for g in groups for m in g.members if not g.gather_rows}
    ps = _compile_ps(ps_leaves, replicas, servers, world_size, where) if ps_leaves else None
    return Plan(rank=rank, world_size=world_size, device=str(device),
                strategy_id=strategy.id, groups=tuple(groups),
                params=tuple(profile.names),
                densified=tuple(p.name for p in profile.params
                                if p.sparse and (p.name in ar_params or (
                                    ps is not None and any(
                                        not q.sparse for q in ps.pieces_of(p.name))))),
                ps=ps, shards=_shard_plan(owned, units, world_size, places))


def _shard_plan(owned: list[tuple[str, int, int]],
                units: dict[str, tuple[ShardedSynchronizer, list[str]]],
                world_size: int, places: list[tuple[str, int, tuple[int, ...], int]]
                ) -> ShardPlan | None:
    if not owned and not units:
        return None
    return ShardPlan(owned=assign_owners(owned, world_size),
                     units=tuple(UnitPlan(module=u, params=tuple(names),
                                          reshard_after_forward=s.reshard_after_forward,
                                          prefetch=s.prefetch)
                                 for u, (s, names) in units.items()),
                     places=tuple(places))


def _compile_ps(leaves: list[tuple[PSSynchronizer, ParamInfo, int, dict[str, Any], str]],
                replicas: tuple[str, ...], servers: tuple[str, ...], world_size: int,
                where: str) -> PSPlan:
    """The PS pieces with their owners, and the dense buckets."""
    if len(replicas) != world_size:
        raise StrategyError(f"graph_config.replicas lists {len(replicas)} workers but the "
                            f"world has {world_size}", where=where,
                            fix="build or validate the strategy for these resources (the "
                                "replicas name the workers that PS destinations refer to)")
    modes = {(s.sync, s.staleness) for s, *_ in leaves}
    if len(modes) > 1:
        raise StrategyError(f"PS synchronizers mix consistency modes {sorted(modes)} "
                            "(sync, staleness)", where=where,
                            fix="use one sync/staleness setting for every PS synchronizer")
    sync, staleness = modes.pop()
    if staleness < 0 or (not sync and staleness):
        raise StrategyError(f"invalid consistency mode sync={sync}, staleness={staleness}",
                            where=where, fix="use staleness >= 0, and 0 when sync is false")
    out: list[PSPiece] = []
    for s, info, index, piece, nwhere in leaves:
        owner = owner_of(s.reduction_destination, replicas, servers, nwhere)
        by_rows = uses_sparse_path(info) or s.row_sparse
        if s.row_sparse:
            check_row_sparse(s, info, nwhere)
        # A part of a 1-D parameter stays dense: torch's dense.add_(sparse) on a 1-D view at
        # a non-zero offset writes outside the view (torch 2.x), so rows of such a part
        # would be lost or corrupt memory at the owner's update.
        sparse = by_rows and (piece.get("axis") is None
                              or (piece.get("axis") == 0 and len(info.shape) >= 2))
        out.append(PSPiece(id=len(out), param=info.name, index=index, shape=piece["shape"],
                           dtype=info.dtype, owner=owner,
                           destination=s.reduction_destination, axis=piece.get("axis"),
                           start=piece["start"], length=piece["length"],
                           part=piece.get("part"), sparse=sparse,
                           sparse_grad=sparse and info.sparse,
                           local_replication=s.local_replication,
                           rows_from_grad=sparse and not uses_sparse_path(info)))
    placed, buckets = make_buckets(out)
    return PSPlan(workers=world_size, servers=servers, pieces=tuple(placed),
                  buckets=tuple(buckets), sync=sync, staleness=staleness, replicas=replicas)


def _configs_by_param(strategy: Strategy, profile: ModelProfile, where: str
                      ) -> dict[str, NodeConfig]:
    known = {p.name for p in profile.params} | {a for p in profile.params for a in p.aliases}
    configs: dict[str, NodeConfig] = {}
    for nc in strategy.node_config:
        if nc.var_name not in known:
            close = difflib.get_close_matches(nc.var_name, sorted(known), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise StrategyError(f"unknown parameter {nc.var_name!r}", where=where,
                                fix=f"{hint}names come from model.named_parameters()")
        name = profile.get(nc.var_name).name
        if name in configs:
            raise StrategyError(f"parameter {name!r} is configured twice", where=where,
                                fix="keep one entry per parameter")
        configs[name] = nc
    for info in profile.params:
        if info.name not in configs:
            raise StrategyError(f"parameter {info.name!r} has no config", where=where,
                                fix="add a node_config entry for it, or rebuild the strategy "
                                    "for this model")
    return configs


def _check_sync(sync: object, where: str) -> AllReduceSynchronizer | PSSynchronizer:
    if isinstance(sync, ShardedSynchronizer):
        raise StrategyError("a Sharded synchronizer on a part of a parameter", where=where,
                            fix="shard the whole parameter (sharding splits it already)")
    if isinstance(sync, PSSynchronizer):
        if not sync.reduction_destination:
            raise StrategyError("PS synchronizer without a reduction_destination",
                                where=where, fix="name the owning worker or server device")
        return sync
    if not isinstance(sync, AllReduceSynchronizer):
        raise StrategyError("no synchronizer", where=where,
                            fix="add one, e.g. {type: AllReduce}")
    if sync.group < 0:
        raise StrategyError(f"negative group {sync.group}", where=where, fix="use group >= 0")
    check_compressor(sync.compressor, sync.powersgd_rank, where=where)
    return sync


def _pieces(nc: NodeConfig, info: ParamInfo, where: str
            ) -> list[tuple[AllReduceSynchronizer | PSSynchronizer, dict[str, Any]]]:
    """(synchronizer, member fields) for the whole parameter or each of its parts."""
    if nc.partitioner is None:
        sync = _check_sync(nc.synchronizer, where)
        return [(sync, {"shape": info.shape, "start": 0, "length": info.numel})]
    part = nc.partitioner
    if len(part.splits) != len(info.shape):
        raise StrategyError(f"partitioner {part} has {len(part.splits)} axes but the parameter "
                            f"has shape {list(info.shape)}", where=where,
                            fix="give one split count per axis")
    axis = part.axis
    sizes = part.part_sizes(info.shape)
    if len(sizes) != part.num_parts or sum(sizes) != info.shape[axis] or min(sizes) < 1:
        raise StrategyError(f"part sizes {sizes} must be {part.num_parts} positive lengths "
                            f"summing to {info.shape[axis]}", where=where, fix="fix part_sizes")
    if len(nc.part_config) != len(sizes):
        raise StrategyError(f"{len(sizes)} parts but {len(nc.part_config)} part_config entries",
                            where=where, fix="give one config per part")
    out, start = [], 0
    for i, (pc, length) in enumerate(zip(nc.part_config, sizes, strict=True)):
        pwhere = f"{where}.part_config[{i}]"
        if pc.partitioner is not None:
            raise StrategyError("nested partitioning", where=pwhere,
                                fix="partition the parameter once")
        shape = list(info.shape)
        shape[axis] = length
        out.append((_check_sync(pc.synchronizer, pwhere),
                    {"shape": tuple(shape), "axis": axis, "start": start, "length": length,
                     "part": i}))
        start += length
    return out

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
from stratagem.strategy.schema import (
    ALL_REDUCE_SPECS,
    AllReduceSynchronizer,
    NodeConfig,
    PSSynchronizer,
    Strategy,
)

BACKENDS = ("gloo", "nccl")


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

    @property
    def numel(self) -> int:
        return sum(m.numel for m in self.members)

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=getattr(torch, self.dtype)).element_size()

    @property
    def params(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(m.param for m in self.members))


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

    def summary(self) -> str:
        total = sum(g.nbytes for g in self.groups)
        lines = [f"plan for rank {self.rank}/{self.world_size} on {self.device} "
                 f"(strategy {self.strategy_id}): {len(self.groups)} groups, "
                 f"{total / 2**20:.2f} MiB of gradients, launch order {list(self.launch_order)}"]
        for g in self.groups:
            comp = g.compressor + (f"(rank {g.powersgd_rank})" if g.compressor == "powersgd"
                                   else "")
            lines.append(f"  group {g.id}: {g.backend} ({g.spec}), {comp}, {g.dtype}, "
                         f"{g.numel:,} values in {len(g.members)} members")
            lines.extend(f"    {m.describe()} @ {m.offset}" for m in g.members)
        if self.densified:
            lines.append(f"  sparse gradients reduced densely: {', '.join(self.densified)}")
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
                 device: torch.device) -> Plan:
    """Turn ``strategy`` into rank ``rank``'s plan; raises :class:`StrategyError`."""
    device = torch.device(device)
    where = f"strategy {strategy.id}"
    if world_size < 1 or not 0 <= rank < world_size:
        raise StrategyError(f"rank {rank} is not in a world of size {world_size}",
                            where=where, fix="pass 0 <= rank < world_size")
    configs = _configs_by_param(strategy, profile, where)

    pieces: dict[int, list[tuple[AllReduceSynchronizer, dict[str, Any]]]] = {}
    for index, info in enumerate(profile.params):
        nc = configs[info.name]
        for sync, piece in _pieces(nc, info, f"node_config[{nc.var_name}]"):
            if info.sparse and sync.compressor == "powersgd":
                raise StrategyError("powersgd cannot compress a sparse embedding gradient",
                                    where=f"node_config[{nc.var_name}]",
                                    fix="use compressor none, or a PS synchronizer")
            pieces.setdefault(sync.group, []).append(
                (sync, {"param": info.name, "index": index, **piece}))

    groups = []
    for gid, entries in pieces.items():
        first = entries[0][0]
        for sync, _ in entries:
            for attr in ("spec", "compressor", "powersgd_rank"):
                if getattr(sync, attr) != getattr(first, attr):
                    raise StrategyError(
                        f"group {gid} mixes {attr} {getattr(first, attr)!r} and "
                        f"{getattr(sync, attr)!r}", where=where,
                        fix="give each combination of spec/compressor its own group id")
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
                                members=tuple(members)))
    # Launch order = expected gradient-ready order: backward produces gradients roughly in
    # reverse registration order, and a group is ready once its earliest parameter is.
    groups.sort(key=lambda g: (-min(m.index for m in g.members), g.id))
    return Plan(rank=rank, world_size=world_size, device=str(device),
                strategy_id=strategy.id, groups=tuple(groups),
                params=tuple(profile.names),
                densified=tuple(p.name for p in profile.params if p.sparse))


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


def _check_sync(sync: object, where: str) -> AllReduceSynchronizer:
    if isinstance(sync, PSSynchronizer):
        raise StrategyError("PS synchronizers are not supported by the runtime yet: the "
                            "parameter-server runtime is not available in this release",
                            where=where,
                            fix="use an AllReduce synchronizer (e.g. the AllReduce or "
                                "PartitionedAR builder) for this parameter")
    if not isinstance(sync, AllReduceSynchronizer):
        raise StrategyError("no synchronizer", where=where,
                            fix="add one, e.g. {type: AllReduce}")
    if sync.group < 0:
        raise StrategyError(f"negative group {sync.group}", where=where, fix="use group >= 0")
    if sync.compressor == "powersgd" and sync.powersgd_rank < 1:
        raise StrategyError(f"powersgd_rank must be >= 1, got {sync.powersgd_rank}",
                            where=where, fix="use a small positive rank such as 1 or 4")
    from stratagem.runtime.compressors import compressor_names

    if sync.compressor not in compressor_names():
        raise StrategyError(f"unknown compressor {sync.compressor!r}", where=where,
                            fix=f"use one of {', '.join(compressor_names())}")
    return sync


def _pieces(nc: NodeConfig, info: ParamInfo, where: str
            ) -> list[tuple[AllReduceSynchronizer, dict[str, Any]]]:
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

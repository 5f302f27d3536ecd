"""The state of a sharded model: this rank's pieces for a sharded save, full state in and out.

A *piece file* (one per rank, see :func:`stratagem.checkpoint.assemble_pieces`) holds plain
tensors only: ``{"pieces": {key: {"data", "offset", "shape"}}, "values": {...},
"skeleton": ...}``. Every tensor of the state is written once over all ranks: a stage-3
tensor (FSDP2 ``DTensor``, ``Shard(0)``) as each rank's row slice, every whole tensor by
one rank -- a stage-1/2 parameter and its optimizer state by its owner, the others spread
over the ranks by size -- so each rank writes about 1/world of the bytes. Keys do not
depend on the world size (model: the state-dict key; optimizer: ``"<index>/<name>"``,
the parameter's index in the optimizer's flat order, as ``optimizer.state_dict()``
numbers them), so pieces written by one world size assemble into the whole state for any
other one, or for a plain process.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from stratagem.distributed.process_group import all_gather_bytes
from stratagem.errors import StratagemError

PieceFile = dict[str, Any]


def _dtensor() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return None
    return DTensor


def _is_dtensor(t: Any) -> bool:
    cls = _dtensor()
    return cls is not None and isinstance(t, cls)


def shard_rows(n0: int, rank: int, world: int) -> tuple[int, int]:
    """(offset, rows) of ``rank``'s ``Shard(0)`` slice of ``n0`` rows (torch.chunk)."""
    chunk = -(-n0 // world) if n0 else 0
    start = min(rank * chunk, n0)
    return start, max(0, min(n0, start + chunk) - start)


def _local_piece(t: Any, rank: int, world: int, key: str) -> dict[str, Any] | None:
    local = t.to_local()
    shape = list(t.shape)
    offset, rows = shard_rows(shape[0], rank, world)
    if local.shape[0] != rows:
        raise StratagemError(f"{key}: this rank's shard has {local.shape[0]} rows, the dim-0 "
                             f"split of {shape[0]} over {world} workers gives {rows}",
                             where="sharded checkpoint",
                             fix="report this: the shard layout is not FSDP2's Shard(0)")
    if rows == 0:
        return None
    return {"data": local.detach(), "offset": offset, "shape": shape}


def _whole(t: torch.Tensor) -> dict[str, Any]:
    return {"data": t.detach(), "offset": 0, "shape": list(t.shape)}


class ShardLayout:
    """Which rank writes each whole tensor of a model's state (the same answer on every
    rank: a pure function of the plan and the state dict)."""

    def __init__(self, module: nn.Module, owners: dict[str, int], rank: int,
                 world: int) -> None:
        self.rank, self.world = rank, world
        self.owners = owners  # stage-1/2 parameter -> owner
        load = [0] * world
        for name, owner in owners.items():
            load[owner] += module.get_parameter(name).numel()
        state = module.state_dict(keep_vars=True)
        whole = [(k, v.numel()) for k, v in state.items()
                 if not _is_dtensor(v) and k not in owners]
        self.writer: dict[str, int] = dict(owners)
        for key, numel in sorted(whole, key=lambda t: (-t[1], t[0])):
            r = min(range(world), key=lambda r: (load[r], r))
            load[r] += numel
            self.writer[key] = r
        self.names = {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}

    def writes(self, key: str) -> bool:
        return self.writer.get(key, 0) == self.rank


def model_pieces(module: nn.Module, layout: ShardLayout) -> PieceFile:
    """This rank's pieces of ``module.state_dict()``."""
    pieces: dict[str, Any] = {}
    for key, value in module.state_dict().items():
        if _is_dtensor(value):
            piece = _local_piece(value, layout.rank, layout.world, key)
            if piece is not None:
                pieces[key] = piece
        elif layout.writes(key):
            pieces[key] = _whole(value)
    return {"pieces": pieces, "values": {}, "skeleton": None}


def flat_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's parameters in ``state_dict()`` order."""
    return [p for g in optimizer.param_groups for p in g["params"]]


def param_groups(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """``optimizer.state_dict()["param_groups"]`` without packing the state."""
    out, index = [], 0
    for g in optimizer.param_groups:
        entry = {k: v for k, v in g.items() if k != "params"}
        entry["params"] = list(range(index, index + len(g["params"])))
        index += len(g["params"])
        out.append(entry)
    return out


def optimizer_pieces(optimizer: torch.optim.Optimizer, layout: ShardLayout) -> PieceFile:
    """This rank's pieces of the optimizer's state (what it holds and writes): keys
    ``"<index>/<name>"``; non-tensor values under ``values``; rank 0 adds the param
    groups as ``skeleton``."""
    pieces: dict[str, Any] = {}
    values: dict[str, Any] = {}
    for i, p in enumerate(flat_params(optimizer)):
        state = optimizer.state.get(p)
        if not state:
            continue
        name = layout.names.get(id(p), "")
        writer = layout.writer.get(name, 0)  # a stage-3 parameter's whole values: rank 0
        for k, v in state.items():
            key = f"{i}/{k}"
            if _is_dtensor(v):
                piece = _local_piece(v, layout.rank, layout.world, key)
                if piece is not None:
                    pieces[key] = piece
            elif writer != layout.rank:
                continue
            elif torch.is_tensor(v):
                pieces[key] = _whole(v)
            else:
                values[key] = v
    skeleton = {"param_groups": param_groups(optimizer)} if layout.rank == 0 else None
    return {"pieces": pieces, "values": values, "skeleton": skeleton}


# -- full optimizer state into this rank's layout ------------------------------------------
def local_optimizer_state(optimizer: torch.optim.Optimizer, full: dict[str, Any],
                          owners: dict[str, int], names: dict[int, str], rank: int,
                          world: int) -> dict[str, Any]:
    """A whole (single-process) optimizer state dict cut to what this rank holds: stage-1/2
    parameters' state on their owner only, stage-3 (``DTensor``) parameters' state as this
    rank's ``DTensor`` slice, everything else whole."""
    params = flat_params(optimizer)
    state = full.get("state", {})
    out: dict[int, dict[str, Any]] = {}
    for raw, entry in state.items():
        i = int(raw)
        if i >= len(params):
            raise StratagemError(f"the optimizer state has parameter {i}, the optimizer "
                                 f"{len(params)}", where="load_full_optimizer_state_dict",
                                 fix="build the optimizer over the same parameters")
        p = params[i]
        owner = owners.get(names.get(id(p), ""))
        if owner is not None and owner != rank:
            continue
        out[i] = shard_entry(entry, p, rank, world) if _is_dtensor(p) else dict(entry)
    return {"state": out, "param_groups": full["param_groups"]}


def shard_entry(entry: dict[str, Any], p: Any, rank: int, world: int) -> dict[str, Any]:
    """One parameter's whole optimizer state cut to this rank's ``DTensor`` slice of the
    stage-3 parameter ``p`` (tensors of ``p``'s shape; others, e.g. ``step``, as they are)."""
    from torch.distributed.tensor import DTensor

    local: dict[str, Any] = {}
    for k, v in entry.items():
        if torch.is_tensor(v) and not _is_dtensor(v) and tuple(v.shape) == tuple(p.shape):
            offset, rows = shard_rows(v.shape[0], rank, world)
            piece = v[offset:offset + rows].to(p.dtype).clone()
            local[k] = DTensor.from_local(piece, p.device_mesh, p.placements,
                                          run_check=False, shape=p.shape, stride=p.stride())
        else:
            local[k] = v
    return local


# -- every rank takes the owners' state (before an in-process rescale) ---------------------
def _spec(v: Any) -> Any:
    if torch.is_tensor(v):
        return {"shape": list(v.shape), "dtype": str(v.dtype).removeprefix("torch.")}
    return {"value": v}


@torch.no_grad()
def gather_owned_state(optimizer: torch.optim.Optimizer, owners: dict[str, int],
                       names: dict[int, str], rank: int, group: Any,
                       global_ranks: list[int]) -> None:
    """Collective over ``group``: every rank's optimizer takes the state of every stage-1/2
    parameter from its owner, so that any rank holds the whole state (one listing per rank
    as JSON, then one broadcast per tensor; nothing unpickled)."""
    params = flat_params(optimizer)
    mine = {}
    for i, p in enumerate(params):
        owner = owners.get(names.get(id(p), ""))
        if owner == rank and optimizer.state.get(p):
            mine[str(i)] = {k: _spec(v) for k, v in optimizer.state[p].items()}
    try:
        listing = json.dumps(mine).encode()
    except TypeError as exc:
        raise StratagemError(f"optimizer state that is not tensors or plain numbers: {exc}",
                             where="in-process rescale of a sharded model",
                             fix="use an optimizer whose state is tensors and numbers, or "
                                 "checkpoint-restart") from None
    listings = [json.loads(b.decode()) for b in all_gather_bytes(listing, group=group)]
    for src, entries in enumerate(listings):
        for raw, spec in entries.items():
            p = params[int(raw)]
            state = optimizer.state[p] if src == rank else {}
            for k, s in spec.items():
                if "value" in s:
                    state[k] = s["value"]
                    continue
                t = state[k] if src == rank else torch.empty(
                    s["shape"], dtype=getattr(torch, s["dtype"]), device=p.device)
                dist.broadcast(t, src=global_ranks[src], group=group)
                state[k] = t
            if src != rank:
                optimizer.state[p] = state


def drop_foreign_state(optimizer: torch.optim.Optimizer, owners: dict[str, int],
                       names: dict[int, str], rank: int) -> None:
    """Forget the state of stage-1/2 parameters another rank owns (after a rescale, each
    rank keeps its share only)."""
    for p in flat_params(optimizer):
        owner = owners.get(names.get(id(p), ""))
        if owner is not None and owner != rank:
            optimizer.state.pop(p, None)

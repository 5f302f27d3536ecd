"""Moving job state between replicas without pickles: JSON skeletons plus raw tensors.

``broadcast_state`` sends a state dict (tensors, numbers, strings, lists, dicts) from a root:
its structure travels as JSON bytes in a uint8 tensor, its tensors as tensors.
"""

from __future__ import annotations

import json
import math
from typing import Any

import torch
import torch.distributed as dist

from stratagem.distributed.process_group import broadcast_bytes, comm_device

_T = "__tensor__"


def split_tensors(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """``obj`` with every tensor replaced by a placeholder (appended to ``tensors``)."""
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return {_T: len(tensors) - 1, "shape": list(obj.shape),
                "dtype": str(obj.dtype).removeprefix("torch.")}
    if isinstance(obj, dict):
        if not all(isinstance(k, (str, int)) for k in obj):
            raise TypeError(f"state dict keys must be str or int, got {list(obj)!r}")
        return {"__dict__": [[k, split_tensors(v, tensors)] for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {"__tuple__": [split_tensors(v, tensors) for v in obj]}
    if isinstance(obj, list):
        return [split_tensors(v, tensors) for v in obj]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"cannot send a {type(obj).__name__} (tensors, numbers, strings, "
                    "lists and dicts only)")


def join_tensors(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    """Inverse of :func:`split_tensors`."""
    if isinstance(skeleton, dict) and _T in skeleton:
        return tensors[skeleton[_T]]
    if isinstance(skeleton, dict) and "__tuple__" in skeleton:
        return tuple(join_tensors(v, tensors) for v in skeleton["__tuple__"])
    if isinstance(skeleton, dict):
        return {k: join_tensors(v, tensors) for k, v in skeleton["__dict__"]}
    if isinstance(skeleton, list):
        return [join_tensors(v, tensors) for v in skeleton]
    return skeleton


def tensor_specs(skeleton: Any, out: list[tuple[list[int], str]]) -> None:
    """The (shape, dtype) of every placeholder, in order."""
    if isinstance(skeleton, dict) and _T in skeleton:
        out.append((skeleton["shape"], skeleton["dtype"]))
    elif isinstance(skeleton, dict) and "__tuple__" in skeleton:
        tensor_specs(skeleton["__tuple__"], out)
    elif isinstance(skeleton, dict):
        for _, v in skeleton["__dict__"]:
            tensor_specs(v, out)
    elif isinstance(skeleton, list):
        for v in skeleton:
            tensor_specs(v, out)


@torch.no_grad()
def broadcast_state(obj: Any, src: int = 0, group: Any = None) -> Any:
    """Rank ``src``'s ``obj`` on every rank (received tensors are on CPU): one broadcast for
    the JSON structure, then one per dtype for the tensors, coalesced."""
    rank = dist.get_rank(group) if group is not None else dist.get_rank()
    tensors: list[torch.Tensor] = []
    data = json.dumps(split_tensors(obj, tensors)).encode() if rank == src else None
    skeleton = json.loads(broadcast_bytes(data, src, group).decode())
    specs: list[tuple[list[int], str]] = []
    tensor_specs(skeleton, specs)
    received: list[Any] = [None] * len(specs)
    device = comm_device(group)
    for dtype in sorted({d for _, d in specs}):
        members = [i for i, (_, d) in enumerate(specs) if d == dtype]
        sizes = [math.prod(specs[i][0]) for i in members]
        if rank == src:
            flat = torch.cat([tensors[i].detach().reshape(-1).to(device) for i in members])
        else:
            flat = torch.empty(sum(sizes), dtype=getattr(torch, dtype), device=device)
        dist.broadcast(flat, src=src, group=group)
        if rank != src:
            for i, piece in zip(members, flat.cpu().split(sizes), strict=True):
                received[i] = piece.view(specs[i][0]).clone()
    return obj if rank == src else join_tensors(skeleton, received)
